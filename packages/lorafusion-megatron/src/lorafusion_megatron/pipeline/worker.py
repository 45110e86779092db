"""One process of a pipeline run: groups, data, plan, stage, execution, adapters, summary.

Every rank reads and tokenises the jobs' data itself (it needs the token ids, targets and loss
denominators of the microbatches it runs); the plan is made once, on global rank 0, and broadcast,
because the scheduler's MILP runs under a time limit and two ranks could otherwise pack differently.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.pipeline.stall import Heartbeat, StallWatchdog, no_heartbeat
from lorafusion_megatron.run_layout import PIPELINE_SUMMARY, PIPELINE_TRACE, PLAN

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.checkpoint import RunFingerprint
    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_megatron.pipeline.engine import EngineStats, StageEngine
    from lorafusion_megatron.pipeline.groups import Layout
    from lorafusion_megatron.pipeline.optim import StageOptimizer
    from lorafusion_megatron.pipeline.programs import Program
    from lorafusion_megatron.pipeline.progress import PipelineProgress
    from lorafusion_megatron.pipeline.stage_model import StageModel
    from lorafusion_megatron.state import RunState
    from lorafusion_sched.models import Plan

__all__ = ["make_pipeline_plan", "run_rank", "shared_plan", "stage_engine", "summarise"]

_log = logging.getLogger(__name__)


def make_pipeline_plan(config: TrainerConfig, data: dict[str, JobData], parallel: ParallelConfig) -> Plan:
    """The run's plan for ``S`` stages and ``d`` replicas, checked against the data.

    Raises:
        TrainerError: The scheduler refused the jobs or the plan breaks an invariant.
    """
    from lorafusion_megatron.planning import make_plan

    return make_plan(config, data, pipeline_stages=parallel.pipeline_stages, data_parallel=parallel.data_parallel)


@dataclass
class _Phases:
    """Seconds this rank spent in each phase of the run, in order (start-up cost shows where it goes)."""

    seconds: dict[str, float]
    mark: float

    @classmethod
    def start(cls) -> _Phases:
        return cls({}, time.perf_counter())

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self.mark
        self.mark = now


def _rank_zero_decides(
    layout: Layout, decide: Callable[[], Any], *, what: str = "decision", heartbeat: Heartbeat = no_heartbeat
) -> Any:
    """``decide()`` on rank 0, its result (or its :class:`TrainerError`) on every rank.

    ``heartbeat`` hears of rank 0 deciding ``what`` (its own work), then of every rank's wait for the
    broadcast of it.
    """
    import torch.distributed as dist

    message: list[Any] = [None]
    if layout.rank == 0:
        heartbeat(f"deciding the {what}")
        try:
            message[0] = ("ok", decide())
        except TrainerError as exc:
            message[0] = ("error", str(exc))
    waiting_for = f"sending the {what} to the other ranks" if layout.rank == 0 else f"waiting for rank 0's {what}"
    heartbeat(waiting_for, waiting=True)
    dist.broadcast_object_list(message, src=0)
    kind, value = message[0]
    if kind == "error":
        raise TrainerError(value)
    return value


@contextlib.contextmanager
def _run_lock_on_rank_zero(config: TrainerConfig, layout: Layout) -> Iterator[None]:
    """The run's locks (:func:`run_locks`), held by global rank 0 inside the block; a refusal is raised on every rank.

    Under ``torchrun`` no launcher process of this package holds it, so rank 0 does, and deletes
    the staging folders a killed run left and finishes its cut replaces (as the local launcher and the
    single-process trainer do).

    Raises:
        TrainerError: Another run holds the lock (on every rank).
    """
    from lorafusion_megatron.checkpoint import recover_interrupted_writes
    from lorafusion_megatron.run_lock import run_locks

    with contextlib.ExitStack() as held:

        def take() -> None:
            held.enter_context(run_locks(config))
            recover_interrupted_writes(config)

        _rank_zero_decides(layout, take)
        yield


def shared_plan(
    config: TrainerConfig,
    data: dict[str, JobData],
    parallel: ParallelConfig,
    layout: Layout,
    resume: bool,
    heartbeat: Heartbeat = no_heartbeat,
) -> tuple[Plan, Path | None, str]:
    """The plan every rank executes, the checkpoint to resume from (``None`` for a fresh run), and the run's id.

    Rank 0 checks the output folders, then plans and draws the run's id (or finds the newest
    checkpoint, whose plan is kept: re-planning could pack differently, and whose id is kept:
    :mod:`~lorafusion_megatron.finished_run`), and broadcasts; every rank re-checks the plan. A
    fresh run refuses a folder holding checkpoints, as the single-process trainer does; a resume
    refuses a checkpoint of another config or other parallel settings before its plan is checked
    (a plan for other stages or replicas would be refused too, but with advice to plan again,
    which a resume cannot do). ``heartbeat`` hears of the planning and of the waits for its broadcast.
    """
    from lorafusion_megatron.adapters_io import check_run_outputs
    from lorafusion_megatron.checkpoint import (
        checkpoint_run_id,
        checkpoint_to_resume,
        read_checkpoint_plan,
        run_fingerprint,
    )
    from lorafusion_megatron.finished_run import forget_finished_run, new_run_id
    from lorafusion_megatron.pipeline.checkpoint import read_run_state
    from lorafusion_megatron.planning import check_plan

    def decide() -> tuple[Plan, str | None, str]:
        check_run_outputs(config)
        found = checkpoint_to_resume(config.checkpoint_dir, resume=resume, pipeline=True)
        if found is None:
            made = make_pipeline_plan(config, data, parallel)
            # An earlier run's summary goes before any of its adapters is replaced (finished_run).
            forget_finished_run(Path(config.output_dir))
            write_text_atomically(Path(config.output_dir, PLAN), made.model_dump_json())
            return made, None, new_run_id()
        meta = read_run_state(found, fingerprint=run_fingerprint(config, data), parallel=parallel)
        return read_checkpoint_plan(found), str(found), checkpoint_run_id(found, meta)

    plan, checkpoint, run_id = _rank_zero_decides(layout, decide, what="plan", heartbeat=heartbeat)
    check_plan(plan, data, config, pipeline_stages=parallel.pipeline_stages, data_parallel=parallel.data_parallel)
    return plan, None if checkpoint is None else Path(checkpoint), run_id


def stage_engine(
    config: TrainerConfig, layout: Layout, stage: StageModel, data: dict[str, JobData]
) -> tuple[dict[str, StageOptimizer], StageEngine]:
    """Fresh optimizers of every job of ``config`` on this stage, and the engine that runs the stage."""
    from lorafusion_megatron.pipeline.engine import StageEngine
    from lorafusion_megatron.pipeline.optim import StageOptimizer
    from lorafusion_megatron.pipeline.p2p import StageLink

    optimizers = {
        job.name: StageOptimizer(
            job,
            stage.lora_parameters(job.name),
            data[job.name].num_global_batches(drop_last=config.scheduler.drop_last),
            layout,
        )
        for job in config.jobs
    }
    engine = StageEngine(
        layout=layout,
        stage=stage,
        link=StageLink(layout, stage.hidden_size, stage.dtype),
        data=data,
        optimizers=optimizers,
    )
    return optimizers, engine


def summarise(stats: list[EngineStats], schedule: str, jobs: Sequence[str]) -> dict[str, Any]:
    """Throughput and per-stage bubble ratios from every rank's measurements, and the steps taken.

    ``replayed_bubble_ratio_per_stage`` is the part of the bubble the measured compute durations
    alone imply (:func:`~lorafusion_megatron.pipeline.trace.replay`). ``steps`` lists the jobs in
    the order of ``jobs`` (the config's, as ``summary.json`` does), each job's steps in order.
    """
    from lorafusion_megatron.pipeline.trace import replay

    replayed = replay(stats)
    wall = max(s.wall_seconds for s in stats)
    first_stage = [s for s in stats if s.stage == 0]
    tokens = sum(s.tokens for s in first_stage)
    stages = sorted({s.stage for s in stats})
    slowest = [max((s for s in stats if s.stage == stage), key=lambda s: s.bubble_ratio) for stage in stages]
    bubbles = [s.bubble_ratio for s in slowest]
    last = max(stages)
    taken = [r for s in stats if s.stage == last and s.replica == 0 for r in s.steps]
    order = {name: index for index, name in enumerate(jobs)}
    steps = [asdict(r) for r in sorted(taken, key=lambda r: (order[r.adapter], r.step))]
    return {
        "schedule": schedule,
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "bubble_ratio_per_stage": bubbles,
        "bubble_ratio": sum(bubbles) / len(bubbles),
        "idle_shares_per_stage": [s.idle_shares() for s in slowest],
        "first_forward_seconds_per_stage": [s.first_forward_seconds for s in slowest],
        "replayed_bubble_ratio_per_stage": replayed.bubble_ratio_per_stage,
        "replayed_bubble_ratio": replayed.bubble_ratio,
        "steps": steps,
    }


def run_rank(
    config: TrainerConfig,
    parallel: ParallelConfig,
    *,
    resume: bool = False,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> dict[str, Any] | None:
    """Train ``config`` as one rank of the pipeline; rank 0 returns (and writes) the run's summary.

    SIGINT or SIGTERM (Ctrl-C) stops the run cleanly: the ranks agree at the next optimizer step,
    drain the pipeline and write a checkpoint (:mod:`.stopping`); the summary then names it.

    Args:
        config: The run (``save_steps`` and ``save_total_limit`` set the checkpoints).
        parallel: Stages, replicas and schedule.
        resume: Continue from the newest checkpoint in ``output_dir``.
        backend: ``nccl`` or ``gloo`` (default from the hardware).
        init_method: Rendezvous URL when not launched by torchrun.
        rank: Global rank (with ``init_method``).
        world_size: Processes (with ``init_method``).

    Returns:
        The summary on global rank 0, else ``None``.

    Under ``torchrun`` global rank 0 holds the output folder's run lock for the run (the local
    launcher holds it for its ranks).

    Raises:
        TrainerError: Unwritable outputs, a refused plan, no or a mismatching checkpoint, another
            run in the output folder.
    """
    import torch
    import torch.distributed as dist

    from lorafusion_megatron.gc_tuning import start_up_objects_frozen
    from lorafusion_megatron.pipeline.groups import parallel_layout
    from lorafusion_megatron.pipeline.launch import under_torchrun
    from lorafusion_megatron.pipeline.programs import build_program, split_for_checkpoints
    from lorafusion_megatron.pipeline.stopping import RANK_STOP_MESSAGE, StopAgreement, rank_stop_signal
    from lorafusion_megatron.pipeline.trace import chrome_trace
    from lorafusion_megatron.profiler.run import with_profiled_choices
    from lorafusion_megatron.trainer import prepare_data

    phases = _Phases.start()
    config = with_profiled_choices(config)
    with (
        rank_stop_signal() as stop,
        parallel_layout(
            parallel.pipeline_stages,
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout_minutes=parallel.collective_timeout_minutes,
        ) as layout,
        contextlib.ExitStack() as held,
    ):
        phases.done("capacity and process groups")
        if layout.rank == 0:
            stop.message = RANK_STOP_MESSAGE
        if layout.num_replicas != parallel.data_parallel:
            raise TrainerError(
                f"{layout.world_size} processes make {layout.num_replicas} replicas of {layout.num_stages} stages, "
                f"but parallel.data_parallel = {parallel.data_parallel}"
            )
        if under_torchrun():  # the local launcher holds the run lock itself, for all its ranks
            held.enter_context(_run_lock_on_rank_zero(config, layout))
        # Watched from here on: a rank stuck reading, planning or loading its layers would otherwise
        # leave its peers waiting on it in a collective that NCCL may never time out.
        watchdog = held.enter_context(StallWatchdog(parallel.collective_timeout_minutes * 60, layout))
        watchdog.beat("reading the jobs' data")
        prepared = prepare_data(config)
        phases.done("data")
        plan, checkpoint, run_id = shared_plan(config, prepared.jobs, parallel, layout, resume, watchdog.beat)
        phases.done("plan")
        watchdog.beat("building its stage of the model")
        program = build_program(plan, parallel.schedule, parallel.baseline_microbatch_samples)
        if config.save_steps is not None:
            program = split_for_checkpoints(program, config.save_steps)
        session = _RankSession.build(config, parallel, layout, prepared.jobs, plan, program, phases, run_id)
        session.heartbeat = watchdog.beat
        watchdog.beat("restoring the checkpoint")
        start = session.restore(checkpoint) if checkpoint is not None else 0
        # One collective on the pipeline group before its first point-to-point transfer: with NCCL,
        # a group's first call must involve all its ranks, which a pipeline's warm-up does not.
        watchdog.beat("the first collective of the pipeline", waiting=True)
        dist.all_reduce(torch.zeros(1, device=layout.device), group=layout.pipeline_group)
        dist.barrier()
        phases.done("restore and first collective")
        with start_up_objects_frozen(), session.showing_progress(start):
            position = session.engine.execute(
                program,
                start=start,
                on_drain=session.on_drain,
                stop=StopAgreement(stop, layout),
                heartbeat=session.heartbeat,
            )
            if session.progress is not None:
                session.progress.finish(position)
        phases.done("training")
        finished = position >= program.num_microbatches
        saved = None if finished else session.save_checkpoint(position)
        if finished:
            session.write_adapters()
        phases.done("outputs")
        everyone: list[Any] = [None] * layout.world_size
        progress = None if session.progress is None else session.progress.state.to_json()
        watchdog.beat("gathering the run's statistics", waiting=True)
        dist.all_gather_object(everyone, (session.engine.stats, progress))
        dist.barrier()
        watchdog.beat("writing the run's summary")
        if layout.rank != 0:
            return None
        summary = summarise([stats for stats, _ in everyone], program.name, [job.name for job in config.jobs])
        summary["adapters"] = {job.name: str(config.job_output_dir(job)) for job in config.jobs} if finished else {}
        summary["pipeline_stages"] = layout.num_stages
        summary["data_parallel"] = layout.num_replicas
        summary["position"] = position
        summary["num_microbatches"] = program.num_microbatches
        summary["checkpoint"] = None if saved is None else str(saved)
        summary["run_state"] = next(state for _, state in everyone if state is not None)
        summary["rank0_phase_seconds"] = phases.seconds
        # What `--resume` of the finished run checks (:mod:`lorafusion_megatron.finished_run`).
        summary["run_id"] = run_id
        summary["parallel"] = parallel.layout_settings()
        summary.update(session.fingerprint.to_meta())
        path = Path(config.output_dir) / PIPELINE_SUMMARY
        write_json_atomically(path, summary)
        write_json_atomically(path.with_name(PIPELINE_TRACE), chrome_trace([stats for stats, _ in everyone]))
        _log.info(
            "%s: %.0f tokens/s, bubble ratio per stage %s",
            program.name,
            summary["tokens_per_second"],
            ", ".join(f"{b:.1%}" for b in summary["bubble_ratio_per_stage"]),
        )
        return summary


@dataclass
class _RankSession:
    """This rank's stage, optimizers, engine and (on the reporting rank) progress, and what it saves."""

    config: TrainerConfig
    parallel: ParallelConfig
    layout: Layout
    plan: Plan
    program: Program
    data: dict[str, JobData]
    stage: StageModel
    optimizers: dict[str, StageOptimizer]
    engine: StageEngine
    run_id: str
    """The run's id, which its checkpoints carry (:func:`shared_plan`)."""
    progress: PipelineProgress | None = None
    _restored: RunState | None = None
    heartbeat: Heartbeat = no_heartbeat
    """Told of the phases of checkpoints and of the adapters' gathering (the rank's stall watchdog)."""
    _saved_steps: int = 0
    _saved: tuple[int, Path] | None = None

    @classmethod
    def build(
        cls,
        config: TrainerConfig,
        parallel: ParallelConfig,
        layout: Layout,
        data: dict[str, JobData],
        plan: Plan,
        program: Program,
        phases: _Phases,
        run_id: str,
    ) -> _RankSession:
        from lorafusion_megatron.model import load_model_config
        from lorafusion_megatron.pipeline.partition import partition_model
        from lorafusion_megatron.pipeline.stage_model import build_stage_model

        spec = partition_model(load_model_config(config.base_model).to_dict(), layout.num_stages)[layout.stage]
        stage = build_stage_model(config, spec, layout.device, on_phase=phases.done)
        optimizers, engine = stage_engine(config, layout, stage, data)
        phases.done("optimizers")
        return cls(config, parallel, layout, plan, program, data, stage, optimizers, engine, run_id)

    @functools.cached_property
    def fingerprint(self) -> RunFingerprint:
        """What a resume of this run's checkpoints must match: the config and the training data."""
        from lorafusion_megatron.checkpoint import run_fingerprint

        return run_fingerprint(self.config, self.data)

    @property
    def reports(self) -> bool:
        """Whether this rank shows the progress: the last stage of replica 0, which has the losses."""
        return self.layout.is_last and self.layout.replica == 0

    def _parameters(self) -> dict[str, dict[str, torch.nn.Parameter]]:
        return {job.name: self.stage.lora_parameters(job.name) for job in self.config.jobs}

    def restore(self, checkpoint: Path) -> int:
        """Load this rank's state from ``checkpoint``; returns the program position to continue at."""
        from lorafusion_megatron.pipeline.checkpoint import load_rank_state, read_run_state
        from lorafusion_megatron.state import RunState

        meta = read_run_state(checkpoint, fingerprint=self.fingerprint, parallel=self.parallel)
        engine_state = load_rank_state(
            checkpoint, layout=self.layout, parameters=self._parameters(), optimizers=self.optimizers
        )
        self.engine.load_state_dict(engine_state)
        self._saved_steps = self.engine.total_steps
        progress = engine_state.get("progress")
        self._restored = None if progress is None else RunState.from_json(progress)
        if self.layout.rank == 0:
            _log.info("resuming from %s at microbatch %d", checkpoint, meta["position"])
        return int(meta["position"])

    @contextlib.contextmanager
    def showing_progress(self, start: int) -> Iterator[None]:
        """On the reporting rank, the progress bar and TensorBoard while the engine runs."""
        from lorafusion_megatron.pipeline.progress import PipelineProgress, fresh_state

        if not self.reports:
            yield
            return
        state = self._restored
        if state is None:
            state = fresh_state(self.data, drop_last=self.config.scheduler.drop_last)
            state.position = start
        self.progress = PipelineProgress(self.config, self.program, self.data, state)
        self.engine.on_backward = self.progress.microbatch_done
        self.engine.on_step = self.progress.stepped
        with self.progress:
            yield

    def on_drain(self, position: int) -> None:
        """The engine's drain hook: a checkpoint whenever ``save_steps`` more steps were taken."""
        save_steps = self.config.save_steps
        if save_steps is None or position >= self.program.num_microbatches:
            return
        if self.engine.total_steps // save_steps > self._saved_steps // save_steps:
            self.save_checkpoint(position)

    def save_checkpoint(self, position: int) -> Path:
        """Write a checkpoint at program position ``position`` (collective; once per position)."""
        from lorafusion_megatron.pipeline.checkpoint import save_pipeline_checkpoint

        if self._saved is not None and self._saved[0] == position:
            return self._saved[1]
        engine_state = self.engine.state_dict()
        if self.progress is not None:
            engine_state["progress"] = self.progress.state.to_json()
        path = save_pipeline_checkpoint(
            self.config.checkpoint_dir,
            layout=self.layout,
            total_steps=self.engine.total_steps,
            position=position,
            parameters=self._parameters(),
            optimizers=self.optimizers,
            engine_state=engine_state,
            plan_json=self.plan.model_dump_json(),
            fingerprint=self.fingerprint,
            run_id=self.run_id,
            parallel=self.parallel,
            keep=self.config.save_total_limit,
            heartbeat=self.heartbeat,
        )
        self._saved_steps = self.engine.total_steps
        self._saved = (position, path)
        return path

    def write_adapters(self) -> None:
        """Every job's adapter in PEFT format, written by the first stage of replica 0."""
        from lorafusion_megatron.pipeline.adapters import gather_adapters, write_adapter

        names = [job.name for job in self.config.jobs]
        self.heartbeat("gathering the adapters on the first stage", waiting=True)
        gathered = gather_adapters(self.stage.model, names, self.layout) if self.layout.replica == 0 else None
        self.heartbeat("writing the adapters")
        if gathered is not None:
            for job in self.config.jobs:
                write_adapter(self.stage.model, job.name, gathered[job.name], self.config.job_output_dir(job))
