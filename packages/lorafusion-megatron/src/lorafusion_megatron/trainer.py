"""The single-process multi-job trainer: config -> data -> plan -> model -> execution -> adapters.

One frozen base model carries one LoRA adapter per job. The plan decides which samples of which
jobs share a microbatch and after which microbatch each job's optimizer steps; this module wires
the pieces together and keeps the books (progress, evaluation, TensorBoard, checkpoints).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from lorafusion_megatron.adapters_io import check_fresh_run, check_run_outputs, save_adapter
from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.checkpoint import (
    check_resume_config,
    checkpoint_to_resume,
    latest_checkpoint,
    load_checkpoint,
    recover_interrupted_writes,
    run_fingerprint,
    save_checkpoint,
)
from lorafusion_megatron.config import TrainerConfig
from lorafusion_megatron.data.job_data import JobData, load_job_data
from lorafusion_megatron.dropout_seeds import drawing_for, install_dropout_seeding
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.eval_reporting import EvalHistory, eval_table
from lorafusion_megatron.executor import StopSignal, execute_plan
from lorafusion_megatron.finished_run import FinishedRun, finished_run, forget_finished_run, new_run_id
from lorafusion_megatron.gc_tuning import start_up_objects_frozen
from lorafusion_megatron.planning import check_plan, make_plan
from lorafusion_megatron.reporting import ProgressDisplay, TensorBoardLogger, summary_table
from lorafusion_megatron.run_layout import EVAL_HISTORY, PLAN, SUMMARY
from lorafusion_megatron.run_lock import new_run_folders, removed_if_unused_on_error, run_locks
from lorafusion_megatron.state import JobProgress, RunState

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from lorafusion_megatron.evaluation import Evaluator
    from lorafusion_megatron.optim import AdapterOptimizer, QueuedStep, StepStats
    from lorafusion_megatron.runner import MicrobatchRunner, PendingResults
    from lorafusion_sched.models import Microbatch, Plan

__all__ = ["PreparedData", "TrainResult", "Trainer", "prepare_data"]

_log = logging.getLogger(__name__)

_FINAL_WRITE_STOP = (
    "{signal}: the run is done; writing the remaining adapters and summary.json, then exiting; {again} to abort "
    "at once (each adapter is written whole or not at all)"
)


@dataclass(frozen=True)
class PreparedData:
    """Everything known before the model is built.

    Attributes:
        model_config: The base model's transformers config.
        tokenizer: Its tokenizer (``None`` when every job is synthetic).
        jobs: Each job's training (and evaluation) data, in config order.
    """

    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    jobs: dict[str, JobData]


def prepare_data(config: TrainerConfig) -> PreparedData:
    """Read, tokenise and lay out every job's data (no model weights are loaded).

    Raises:
        TrainerError: A dataset or the tokenizer is missing or unusable.
    """
    from lorafusion_megatron.data.tokenizer import load_tokenizer
    from lorafusion_megatron.model import load_model_config

    model_config = load_model_config(config.base_model)
    vocab_size = int(model_config.vocab_size)
    needs_tokenizer = any(
        dataset is not None and dataset.path is not None
        for job in config.jobs
        for dataset in (job.dataset, job.eval_dataset)
    )
    tokenizer = load_tokenizer(config.base_model, vocab_size) if needs_tokenizer else None
    jobs = {job.name: load_job_data(config, job, tokenizer, vocab_size) for job in config.jobs}
    return PreparedData(model_config=model_config, tokenizer=tokenizer, jobs=jobs)


def _warn_past_context(config: TrainerConfig, prepared: PreparedData) -> None:
    """Warn when samples longer than the base model's context will train (silently, at positions it never saw)."""
    from lorafusion_megatron.checks import capacity_past_context

    warning = capacity_past_context(config, prepared.model_config.to_dict())
    if warning is None:
        return
    context = int(prepared.model_config.max_position_embeddings)
    longer = {
        name: count
        for name, job in prepared.jobs.items()
        if (count := sum(len(sample) > context for sample in job.samples))
    }
    if not longer:
        return  # the capacity could let one through, but this run's data has none
    found = "; ".join(f"job {name}: {count} sample(s) longer than {context} tokens" for name, count in longer.items())
    _log.warning("%s (%s)", warning, found)


@dataclass(frozen=True)
class TrainResult:
    """How a call to :meth:`Trainer.train` ended.

    Attributes:
        state: Final position and per-job counters.
        adapters: Each finished job's adapter folder (empty when interrupted).
        checkpoint: The checkpoint written when the run stopped early, else ``None``.
        stopped_by: A stop signal (Ctrl-C, SIGTERM) that came too late to stop the run: during its
            last microbatch or while the final adapters were written. The run finished and wrote
            every adapter and the summary first; ``None`` when no signal came.
    """

    state: RunState
    adapters: dict[str, Path]
    checkpoint: Path | None
    stopped_by: signal.Signals | None = None

    @property
    def interrupted(self) -> bool:
        """Whether the run stopped before the end of the plan."""
        return self.checkpoint is not None

    @property
    def exit_status(self) -> int:
        """The CLI's: 0 finished, 1 stopped at a checkpoint, 128 + ``stopped_by`` (130 for Ctrl-C) when one came."""
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return 1 if self.interrupted else 0


class Trainer:
    """Trains every job of ``config`` together on one device.

    Args:
        config: The validated run config.
        console: Where the progress bar and the summary go (stderr by default).
        stop: Polled after every microbatch; by default the first Ctrl-C stops after the current
            microbatch and writes a checkpoint. One that comes once the plan is done lets every
            job's adapter and the summary be written first (:attr:`TrainResult.stopped_by`).
        resume_command: The command an interrupted run prints to continue (the CLI passes the
            user's own command line).
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        console: Console | None = None,
        stop: StopSignal | None = None,
        resume_command: str = "lorafusion-megatron train CONFIG --resume",
    ):
        from lorafusion_megatron.profiler.run import with_profiled_choices

        self.config = with_profiled_choices(config)
        self.console = console or Console(stderr=True)
        self.stop = stop or StopSignal()
        self.resume_command = resume_command

    def train(self, *, resume: bool = False, overwrite: bool = False) -> TrainResult:
        """Run (or continue, with ``resume``) the whole plan and write each job's adapter.

        Args:
            resume: Continue from the newest checkpoint in ``output_dir``.
            overwrite: Let a fresh run replace an earlier run's adapters and summary.

        Raises:
            TrainerError: Bad data, unwritable folders, an earlier run's results without
                ``overwrite``, no checkpoint to resume, a checkpoint from a different config (refused
                before the data is read), another run writing to the same ``output_dir``, or a
                checkpoint or final adapter that cannot be written (a full disk, a read-only file
                system; the message says whether a checkpoint is left to resume from).
        """
        # A run refused or failed before it wrote anything leaves no folder of its own making behind
        # (one holding just the lock file and an empty adapters/).
        new_folders = new_run_folders(self.config)
        with removed_if_unused_on_error(new_folders):
            check_run_outputs(self.config)
        with run_locks(self.config, tidy=new_folders):  # one run per output folder (and job folder)
            recover_interrupted_writes(self.config)
            return self._train(resume=resume, overwrite=overwrite)

    def _train(self, *, resume: bool, overwrite: bool) -> TrainResult:
        config = self.config
        check_fresh_run(config, resume=resume, overwrite=overwrite)
        finished = finished_run(config) if resume else None
        if finished is not None:
            return self._report_finished(finished)
        checkpoint_path = checkpoint_to_resume(config.checkpoint_dir, resume=resume)
        if checkpoint_path is not None:
            # The config (and base weights) decide before the data is tokenised and the model built;
            # the data's hash, which needs the tokenised data, is compared when the checkpoint loads.
            check_resume_config(checkpoint_path, config)
        prepared = prepare_data(config)
        _warn_past_context(config, prepared)
        session = _Session.build(config, prepared)
        if checkpoint_path is not None:
            loaded = load_checkpoint(
                checkpoint_path,
                fingerprint=session.fingerprint,
                adapter_parameters=session.parameters,
                optimizers=session.optimizers,
            )
            plan = loaded.plan
            check_plan(plan, prepared.jobs, config)
            state = loaded.state
            # In config order, which a resume may change (a checkpoint names jobs, never numbers them).
            state.jobs = {job.name: state.jobs[job.name] for job in config.jobs}
            run_id = loaded.run_id
            _log.info("resuming from %s at microbatch %d", checkpoint_path, state.position)
        else:
            plan = make_plan(config, prepared.jobs)
            # An earlier run's summary (train --overwrite) goes before any of its adapters is replaced:
            # a failure among this run's final writes must not leave a folder --resume calls complete.
            forget_finished_run(Path(config.output_dir))
            write_text_atomically(Path(config.output_dir) / PLAN, plan.model_dump_json(indent=1))
            # An earlier run's evaluations (train --overwrite): this run writes its own, or none.
            (Path(config.output_dir) / EVAL_HISTORY).unlink(missing_ok=True)
            state = RunState(
                position=0,
                jobs={a.name: JobProgress(name=a.name, total_steps=a.num_global_batches) for a in plan.adapters},
            )
            run_id = new_run_id()
        # The collection that freezes the start-up objects is start-up too: the clock starts after it.
        # One stop handler from the first microbatch to the summary: no signal finds the default handler between.
        with start_up_objects_frozen(), self.stop:
            session.start(plan, state, self.console, run_id=run_id, resumed=checkpoint_path is not None)
            with ProgressDisplay(
                len(plan.microbatches), state.position, enabled=config.logging.progress_bar, console=self.console
            ) as display:
                session.display = display
                position = execute_plan(plan.microbatches, session, start=state.position, should_stop=self.stop)
            session.close()
            if position < len(plan.microbatches):
                path = session.save_checkpoint()
                self.console.print(f"Stopped at microbatch {position}/{len(plan.microbatches)}; checkpoint: {path}")
                self.console.print(f"Continue with: {self.resume_command}", soft_wrap=True, markup=False)
                return TrainResult(state=session.state, adapters={}, checkpoint=path)
            # Every job's adapter, then the summary: a first stop signal now waits for all of them (a second aborts).
            with self.stop.saying(_FINAL_WRITE_STOP):
                try:
                    outputs = session.save_adapters()
                    self._write_summary(session, outputs)
                except TrainerError as failed:  # a full disk, a read-only file system, a folder in the way
                    raise TrainerError(f"{failed}. {self._after_failed_final_write()}") from failed
        self.console.print(summary_table(session.state, outputs, Path(config.output_dir)))
        if session.eval_history is not None:
            self.console.print(eval_table(session.eval_history))
        stopped_by = self.stop.received  # in the last microbatch, or while the adapters were written
        if stopped_by is not None:
            self.console.print(
                f"{stopped_by.name} came as the run ended: every job's adapter and summary.json were written "
                "first, so the run is complete (nothing to resume)"
            )
        return TrainResult(state=session.state, adapters=outputs, checkpoint=None, stopped_by=stopped_by)

    def _after_failed_final_write(self) -> str:
        """What to do when the trained adapters (or the summary) could not all be written.

        The training is done; what can be recovered is the newest checkpoint, if the run wrote one
        (``save_steps``): ``--resume`` trains from there again and writes every adapter. Without one
        the trained weights are lost, and saying that ``--resume`` continues would be false.
        """
        newest = latest_checkpoint(self.config.checkpoint_dir)
        if newest is not None:
            return (
                f"The training finished, but not every adapter and summary.json were written: free space (or fix "
                f"the folder), then `{self.resume_command}` trains again from {newest} and writes them all"
            )
        return (
            "The training finished, but not every adapter and summary.json were written, and no checkpoint exists "
            "to resume from (none was due: see save_steps), so the trained weights are lost: free space (or fix the "
            "folder), then train again with --overwrite (the adapters written are replaced); set save_steps to have "
            "checkpoints written during the run"
        )

    def _report_finished(self, finished: FinishedRun) -> TrainResult:
        """``--resume`` of a run that already finished: say so, and write nothing.

        Raises:
            TrainerError: The config changed since in what decides the trained weights.
        """
        finished.check_config(run_fingerprint(self.config, None))
        self.console.print(summary_table(finished.state, finished.adapters, Path(self.config.output_dir)))
        self.console.print(finished.message(), soft_wrap=True, markup=False)
        return TrainResult(state=finished.state, adapters=finished.adapters, checkpoint=None)

    def _write_summary(self, session: _Session, outputs: Mapping[str, Path]) -> None:
        """``summary.json``: the run's counters, each job's adapter, and its latest and every eval loss.

        Also the run's id and the config it was trained with: ``--resume`` of the finished run reads
        them (:mod:`~lorafusion_megatron.finished_run`).
        """
        history = session.eval_history
        summary = {
            **session.state.to_json(),
            "adapters": {name: str(path) for name, path in outputs.items()},
            "run_id": session.run_id,
            **session.fingerprint.to_meta(),
        }
        for job in summary["jobs"]:
            latest = None if history is None else history.latest(job["name"])
            job["eval_loss"] = None if latest is None else latest.loss
        summary["eval"] = {} if history is None else history.to_json()
        write_json_atomically(Path(self.config.output_dir) / SUMMARY, summary)


class _Session:
    """The model, optimizers and counters of one training process; the executor's hooks."""

    def __init__(
        self,
        config: TrainerConfig,
        data: dict[str, JobData],
        model: PeftModel,
        runner: MicrobatchRunner,
        parameters: dict[str, dict[str, torch.nn.Parameter]],
        device: torch.device,
        evaluator: Evaluator | None,
    ) -> None:
        self.config = config
        self.data = data
        self.fingerprint = run_fingerprint(config, data)  # what a resume of this run's checkpoints must match
        self.model = model
        self.runner = runner
        self.parameters = parameters
        self.device = device
        self.evaluator = evaluator
        self.eval_history: EvalHistory | None = None
        self.optimizers: dict[str, AdapterOptimizer] = {}
        self.display: ProgressDisplay | None = None
        self.tensorboard = TensorBoardLogger(config.logging.tensorboard_dir, config.logging.logging_steps)
        self._denominators: dict[tuple[str, int], int] = {}
        self._checkpoint_due = False
        self._unsettled: PendingResults | None = None
        self._unsettled_steps: list[tuple[str, int, QueuedStep]] = []
        """Steps queued since the last settle: adapter, its global batch, the step."""
        self._clock = time.perf_counter()

    @classmethod
    def build(cls, config: TrainerConfig, prepared: PreparedData) -> _Session:
        from lorafusion_megatron.evaluation import Evaluator
        from lorafusion_megatron.model import (
            attach_adapters,
            build_base_model,
            lora_parameters,
            patch_kernels,
            resolve_attn_implementation,
            resolve_device,
            torch_dtype,
        )
        from lorafusion_megatron.pipeline.partition import recomputed_layers
        from lorafusion_megatron.runner import MicrobatchRunner

        device = resolve_device(config.runtime.device)
        base = build_base_model(
            config.base_model,
            device=device,
            seed=config.runtime.seed,
            recomputed_layers=recomputed_layers(
                prepared.model_config.to_dict(), 1, config.runtime.activation_checkpointing
            )[0],
        )
        model = attach_adapters(
            base, config.jobs, seed=config.runtime.seed, name_or_path=config.base_model.model_name_or_path
        )
        fused = config.runtime.fused_kernels and patch_kernels(model, siblings=config.runtime.fuse_sibling_layers)
        names = [job.name for job in config.jobs]
        runner = MicrobatchRunner(
            model,
            names,
            attn_implementation=resolve_attn_implementation(config.base_model.attn_implementation, device),
            dtype=torch_dtype(config.base_model.dtype),
            fused=fused,
        )
        parameters = {name: lora_parameters(model, name) for name in names}
        evaluates = any(job.eval_samples for job in prepared.jobs.values())
        evaluator = Evaluator(runner, prepared.jobs, config, device) if evaluates else None
        # Dropout draws as the pipeline stages draw them, whichever process runs a layer.
        causal_lm: Any = model.base_model.model
        install_dropout_seeding(dict(enumerate(causal_lm.model.layers)), run_seed=config.runtime.seed)
        session = cls(config, prepared.jobs, model, runner, parameters, device, evaluator)
        session._make_optimizers()
        return session

    def _make_optimizers(self) -> None:
        from lorafusion_megatron.optim import AdapterOptimizer

        for job in self.config.jobs:
            steps = self.data[job.name].num_global_batches(drop_last=self.config.scheduler.drop_last)
            self.optimizers[job.name] = AdapterOptimizer(job, self.parameters[job.name], steps)

    def start(self, plan: Plan, state: RunState, console: Console, *, run_id: str, resumed: bool) -> None:
        """Bind the plan, the counters (fresh, or restored when ``resumed``) and the run's id before executing."""
        self.plan = plan
        self.state = state
        self.console = console
        self.run_id = run_id
        self._plan_json = plan.model_dump_json()
        self._seconds_before = state.seconds
        self._clock = time.perf_counter()
        if resumed:
            self.eval_history = self._resumed_eval_history()
        elif self.evaluator is not None:
            self.eval_history = EvalHistory(Path(self.config.output_dir) / EVAL_HISTORY, self.evaluator.adapters)
            self.eval_history.save()

    def _resumed_eval_history(self) -> EvalHistory | None:
        """The evaluations up to the checkpoint's steps, written back to ``eval_history.json`` at once.

        A job whose ``eval_dataset`` was removed keeps its records (the log says up to which step),
        so the file and the summary agree even when no job evaluates any more; with no records and
        no job evaluating, the file (holding no evaluation up to the checkpoint) is deleted.
        """
        path = Path(self.config.output_dir) / EVAL_HISTORY
        evaluating = () if self.evaluator is None else self.evaluator.adapters
        steps = {name: job.steps_done for name, job in self.state.jobs.items()}
        held_out = [job.name for job in self.config.jobs if job.val_size is not None]
        eval_sets = {} if self.evaluator is None else self.evaluator.eval_sets
        history = EvalHistory.resumed(path, evaluating, steps, written_by=held_out, eval_sets=eval_sets)
        for name in history.stopped():
            _log.info(
                "%s no longer evaluates (its eval_dataset was removed): its evaluations up to step %d stay in %s "
                "and summary.json",
                name,
                history.records[name][-1].step,
                EVAL_HISTORY,
            )
        if not history.records:
            path.unlink(missing_ok=True)
            return None
        history.save()
        return history

    def close(self) -> None:
        """Release TensorBoard files."""
        self.tensorboard.close()

    def _denominator(self, adapter: str, global_batch: int) -> int:
        key = (adapter, global_batch)
        if key not in self._denominators:
            self._denominators[key] = self.data[adapter].global_batch_targets(global_batch)
        return self._denominators[key]

    # ---- executor hooks -------------------------------------------------------------------------

    def run_microbatch(self, index: int, microbatch: Microbatch) -> None:
        from lorafusion_megatron.packing import pack_microbatch

        batch = pack_microbatch(microbatch, self.data)
        for span in batch.segments:
            # Counted on the host (pack_microbatch counts trained tokens): no device read-back.
            assert span.targets is not None
            job = self.state.jobs[span.adapter]
            job.tokens += span.length
            job.targets += span.targets
            job.pending_targets[span.global_batch] = job.pending_targets.get(span.global_batch, 0) + span.targets
        denominators = {
            (span.adapter, span.global_batch): self._denominator(span.adapter, span.global_batch)
            for span in batch.segments
        }
        with drawing_for(microbatch):
            pending = self.runner.forward_backward(batch.to(self.device), denominators)
        # The previous microbatch's results are read only now, once this one's work is queued, so the
        # host never waits for the device with an empty queue between two microbatches.
        self._settle()
        self._unsettled = pending

    def _settle(self) -> None:
        """Read the unsettled microbatch's loss sums back (waits for the device), then log the steps queued since.

        A step's mean loss needs its global batch's last microbatch, and its gradient norm the
        step's own kernels: both are read here, once later work is queued behind them.
        """
        if self._unsettled is not None:
            results, self._unsettled = self._unsettled.get(), None
            for result in results:
                pending = self.state.jobs[result.adapter].pending_loss
                pending[result.global_batch] = pending.get(result.global_batch, 0.0) + result.loss_sum
        steps, self._unsettled_steps = self._unsettled_steps, []
        for adapter, global_batch, queued in steps:
            self._log_step(adapter, global_batch, queued.stats())

    def step_adapter(self, index: int, adapter: str) -> None:
        """Queue ``adapter``'s optimizer step; its loss and gradient norm are read back by the next settle.

        Only an evaluation due at this step waits for the device here.
        """
        job = self.state.jobs[adapter]
        global_batch = job.steps_done
        expected = self._denominator(adapter, global_batch)
        seen = job.pending_targets.pop(global_batch, 0)
        if seen != expected:
            raise RuntimeError(
                f"plan microbatch {index} steps {adapter} after {seen} of the {expected} trained tokens of its "
                f"global batch {global_batch}: the plan does not match the data"
            )
        queued = self.optimizers[adapter].step()
        job.steps_done = queued.step
        job.learning_rate = queued.learning_rate
        self.state.total_optimizer_steps += 1
        self._unsettled_steps.append((adapter, global_batch, queued))
        if self.evaluator is not None and self.evaluator.is_due(adapter, queued.step, job.total_steps):
            self._settle()
            self._evaluate(adapter, queued.step)
        save_steps = self.config.save_steps
        if save_steps is not None and self.state.total_optimizer_steps % save_steps == 0:
            self._checkpoint_due = True

    def _log_step(self, adapter: str, global_batch: int, stats: StepStats) -> None:
        """Record a finished step of ``adapter``: its global batch's mean loss, its gradient norm, the logs."""
        job = self.state.jobs[adapter]
        job.last_loss = job.pending_loss.pop(global_batch) / self._denominator(adapter, global_batch)
        if job.first_loss is None:
            job.first_loss = job.last_loss
        job.grad_norm = stats.grad_norm
        self.tensorboard.log_step(job, stats, self._elapsed())
        if stats.step % self.config.logging.logging_steps == 0 or stats.step == job.total_steps:
            _log.info(
                "%s %d/%d  loss %.4f  lr %.3g  grad norm %.3g",
                adapter,
                stats.step,
                job.total_steps,
                job.last_loss,
                stats.learning_rate,
                stats.grad_norm,
            )

    def _evaluate(self, adapter: str, step: int) -> None:
        assert self.evaluator is not None
        assert self.eval_history is not None
        result = self.evaluator.evaluate(adapter, step)
        self.eval_history.add(result)
        self.tensorboard.log_eval(result.adapter, result.step, result.loss)
        _log.info(
            "%s %d/%d  eval loss %.4f  (%d samples, %d trained tokens, %.1f s)",
            adapter,
            step,
            self.state.jobs[adapter].total_steps,
            result.loss,
            result.samples,
            result.targets,
            result.seconds,
        )

    def after_microbatch(self, index: int) -> None:
        """Advance the position; the losses shown lag by the microbatch whose results are unsettled."""
        if index + 1 == len(self.plan.microbatches):
            self._settle()
        self.state.position = index + 1
        self.state.seconds = self._elapsed()
        if self.display is not None:
            self.display.update(self.state)
        if self._checkpoint_due and self.state.position < len(self.plan.microbatches):
            self._checkpoint_due = False
            self.save_checkpoint()

    # ---- outputs --------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return self._seconds_before + time.perf_counter() - self._clock

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current position."""
        self._settle()
        return save_checkpoint(
            self.config.checkpoint_dir,
            state=self.state,
            plan_json=self._plan_json,
            fingerprint=self.fingerprint,
            run_id=self.run_id,
            model=self.model,
            adapter_parameters=self.parameters,
            optimizers=self.optimizers,
            keep=self.config.save_total_limit,
        )

    def save_adapters(self) -> dict[str, Path]:
        """Write every job's final adapter in PEFT format."""
        outputs = {}
        for job in self.config.jobs:
            directory = self.config.job_output_dir(job)
            save_adapter(self.model, job.name, directory)
            outputs[job.name] = directory
        return outputs
