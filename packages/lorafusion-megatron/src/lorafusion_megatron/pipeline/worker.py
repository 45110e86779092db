"""One process of a pipeline run: groups, data, plan, stage, execution, adapters, summary.

Every rank reads and tokenises the jobs' data itself (it needs the token ids, targets and loss
denominators of the microbatches it runs); the plan is made once, on global rank 0, and broadcast,
because the scheduler's MILP runs under a time limit and two ranks could otherwise pack differently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import ParallelConfig

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_megatron.pipeline.engine import EngineStats, StageEngine, StepRecord
    from lorafusion_megatron.pipeline.groups import Layout
    from lorafusion_megatron.pipeline.optim import StageOptimizer
    from lorafusion_megatron.pipeline.programs import Program
    from lorafusion_megatron.pipeline.stage_model import StageModel
    from lorafusion_sched.models import Plan

__all__ = ["make_pipeline_plan", "run_rank", "summarise"]

_log = logging.getLogger(__name__)


def make_pipeline_plan(config: TrainerConfig, data: dict[str, JobData], parallel: ParallelConfig) -> Plan:
    """The run's plan for ``S`` stages and ``d`` replicas, checked against the data.

    Raises:
        TrainerError: The scheduler refused the jobs or the plan breaks an invariant.
    """
    from lorafusion_megatron.planning import make_plan

    return make_plan(config, data, pipeline_stages=parallel.pipeline_stages, data_parallel=parallel.data_parallel)


def _rank_zero_decides(layout: Layout, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0, its result (or its :class:`TrainerError`) on every rank."""
    import torch.distributed as dist

    message: list[Any] = [None]
    if layout.rank == 0:
        try:
            message[0] = ("ok", decide())
        except TrainerError as exc:
            message[0] = ("error", str(exc))
    dist.broadcast_object_list(message, src=0)
    kind, value = message[0]
    if kind == "error":
        raise TrainerError(value)
    return value


def _shared_plan(
    config: TrainerConfig, data: dict[str, JobData], parallel: ParallelConfig, layout: Layout, resume: bool
) -> tuple[Plan, Path | None]:
    """The plan every rank executes, and the checkpoint to resume from (``None`` for a fresh run).

    Rank 0 checks the output folders, then plans (or finds the newest checkpoint, whose plan is
    kept: re-planning could pack differently), and broadcasts; every rank re-checks the plan.
    """
    from lorafusion_megatron.adapters_io import check_writable
    from lorafusion_megatron.checkpoint import latest_checkpoint
    from lorafusion_megatron.planning import check_plan, plan_from_json

    def decide() -> tuple[str, str | None]:
        check_writable(Path(config.output_dir), "output_dir")
        for job in config.jobs:
            check_writable(config.job_output_dir(job).parent, f"output folder of job {job.name}")
        if not resume:
            plan_json = make_pipeline_plan(config, data, parallel).model_dump_json()
            Path(config.output_dir, "plan.json").write_text(plan_json, encoding="utf-8")
            return plan_json, None
        found = latest_checkpoint(config.checkpoint_dir)
        if found is None:
            raise TrainerError(
                f"--resume: no checkpoint in {config.checkpoint_dir}; train without --resume to start afresh"
            )
        return (found / "plan.json").read_text(encoding="utf-8"), str(found)

    plan_json, checkpoint = _rank_zero_decides(layout, decide)
    plan = plan_from_json(plan_json)
    check_plan(plan, data, drop_last=config.scheduler.drop_last)
    return plan, None if checkpoint is None else Path(checkpoint)


def summarise(stats: list[EngineStats], schedule: str) -> dict[str, Any]:
    """Throughput and per-stage bubble ratios from every rank's measurements."""
    wall = max(s.wall_seconds for s in stats)
    first_stage = [s for s in stats if s.stage == 0]
    tokens = sum(s.tokens for s in first_stage)
    stages = sorted({s.stage for s in stats})
    bubbles = [max(s.bubble_ratio for s in stats if s.stage == stage) for stage in stages]
    last = max(stages)
    steps = [asdict(r) for s in stats if s.stage == last and s.replica == 0 for r in s.steps]
    return {
        "schedule": schedule,
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "bubble_ratio_per_stage": bubbles,
        "bubble_ratio": sum(bubbles) / len(bubbles),
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

    Raises:
        TrainerError: Unwritable outputs, a refused plan, no or a mismatching checkpoint.
    """
    import torch
    import torch.distributed as dist

    from lorafusion_megatron.pipeline.groups import parallel_layout
    from lorafusion_megatron.pipeline.programs import build_program, split_for_checkpoints
    from lorafusion_megatron.profiler.run import with_profiled_capacity
    from lorafusion_megatron.trainer import prepare_data

    config = with_profiled_capacity(config)
    with parallel_layout(
        parallel.pipeline_stages, backend=backend, init_method=init_method, rank=rank, world_size=world_size
    ) as layout:
        if layout.num_replicas != parallel.data_parallel:
            raise TrainerError(
                f"{layout.world_size} processes make {layout.num_replicas} replicas of {layout.num_stages} stages, "
                f"but parallel.data_parallel = {parallel.data_parallel}"
            )
        prepared = prepare_data(config)
        plan, checkpoint = _shared_plan(config, prepared.jobs, parallel, layout, resume)
        program = build_program(plan, parallel.schedule, parallel.baseline_microbatch_samples)
        if config.save_steps is not None:
            program = split_for_checkpoints(program, config.save_steps)
        session = _RankSession.build(config, parallel, layout, prepared.jobs, plan)
        start = session.restore(checkpoint) if checkpoint is not None else 0
        # One collective on the pipeline group before its first point-to-point transfer: with NCCL,
        # a group's first call must involve all its ranks, which a pipeline's warm-up does not.
        dist.all_reduce(torch.zeros(1, device=layout.device), group=layout.pipeline_group)
        dist.barrier()
        stats = session.engine.execute(program, start=start, on_drain=session.checkpoint_if_due(program))
        session.write_adapters()
        everyone: list[Any] = [None] * layout.world_size
        dist.all_gather_object(everyone, stats)
        dist.barrier()
        if layout.rank != 0:
            return None
        summary = summarise(everyone, program.name)
        summary["adapters"] = {job.name: str(config.job_output_dir(job)) for job in config.jobs}
        summary["pipeline_stages"] = layout.num_stages
        summary["data_parallel"] = layout.num_replicas
        path = Path(config.output_dir) / "pipeline_summary.json"
        path.write_text(json.dumps(summary, indent=2, sort_keys=True), encoding="utf-8")
        _log.info(
            "%s: %.0f tokens/s, bubble ratio per stage %s",
            program.name,
            summary["tokens_per_second"],
            ", ".join(f"{b:.1%}" for b in summary["bubble_ratio_per_stage"]),
        )
        return summary


@dataclass
class _RankSession:
    """This rank's stage, optimizers and engine, and what it saves."""

    config: TrainerConfig
    parallel: ParallelConfig
    layout: Layout
    plan: Plan
    stage: StageModel
    optimizers: dict[str, StageOptimizer]
    engine: StageEngine

    @classmethod
    def build(
        cls, config: TrainerConfig, parallel: ParallelConfig, layout: Layout, data: dict[str, JobData], plan: Plan
    ) -> _RankSession:
        import torch

        from lorafusion_megatron.data.job_data import job_seed
        from lorafusion_megatron.model import load_model_config
        from lorafusion_megatron.pipeline.engine import StageEngine
        from lorafusion_megatron.pipeline.optim import StageOptimizer
        from lorafusion_megatron.pipeline.p2p import StageLink
        from lorafusion_megatron.pipeline.partition import partition_model
        from lorafusion_megatron.pipeline.stage_model import build_stage_model

        spec = partition_model(load_model_config(config.base_model).to_dict(), layout.num_stages)[layout.stage]
        stage = build_stage_model(config, spec, layout.device)
        # Dropout draws from the global generator; seeded as the single-process trainer seeds it.
        torch.manual_seed(job_seed(config.runtime.seed, "", "dropout") % 2**63)
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
            on_step=_step_logger(config, optimizers) if layout.is_last and layout.replica == 0 else None,
        )
        return cls(config, parallel, layout, plan, stage, optimizers, engine)

    def _parameters(self) -> dict[str, dict[str, torch.nn.Parameter]]:
        return {job.name: self.stage.lora_parameters(job.name) for job in self.config.jobs}

    def restore(self, checkpoint: Path) -> int:
        """Load this rank's state from ``checkpoint``; returns the program position to continue at."""
        from lorafusion_megatron.config import config_fingerprint
        from lorafusion_megatron.pipeline.checkpoint import load_rank_state, read_run_state

        meta = read_run_state(checkpoint, fingerprint=config_fingerprint(self.config), parallel=self.parallel)
        engine_state = load_rank_state(
            checkpoint, layout=self.layout, parameters=self._parameters(), optimizers=self.optimizers
        )
        self.engine.load_state_dict(engine_state)
        if self.layout.rank == 0:
            _log.info("resuming from %s at microbatch %d", checkpoint, meta["position"])
        return int(meta["position"])

    def checkpoint_if_due(self, program: Program) -> Callable[[int], None] | None:
        """The engine's drain hook: a checkpoint whenever ``save_steps`` more steps were taken."""
        from lorafusion_megatron.config import config_fingerprint
        from lorafusion_megatron.pipeline.checkpoint import save_pipeline_checkpoint

        save_steps = self.config.save_steps
        if save_steps is None:
            return None
        saved = [self.engine.total_steps]
        plan_json = self.plan.model_dump_json()

        def on_drain(position: int) -> None:
            steps = self.engine.total_steps
            if position >= program.num_microbatches or steps // save_steps == saved[0] // save_steps:
                return
            save_pipeline_checkpoint(
                self.config.checkpoint_dir,
                layout=self.layout,
                total_steps=steps,
                position=position,
                parameters=self._parameters(),
                optimizers=self.optimizers,
                engine_state=self.engine.state_dict(),
                plan_json=plan_json,
                fingerprint=config_fingerprint(self.config),
                parallel=self.parallel,
                keep=self.config.save_total_limit,
            )
            saved[0] = steps

        return on_drain

    def write_adapters(self) -> None:
        """Every job's adapter in PEFT format, written by the first stage of replica 0."""
        from lorafusion_megatron.pipeline.adapters import gather_adapters, write_adapter

        names = [job.name for job in self.config.jobs]
        gathered = gather_adapters(self.stage.model, names, self.layout) if self.layout.replica == 0 else None
        if gathered is not None:
            for job in self.config.jobs:
                write_adapter(self.stage.model, job.name, gathered[job.name], self.config.job_output_dir(job))


def _step_logger(config: TrainerConfig, optimizers: dict[str, Any]) -> Callable[[StepRecord], None]:
    """Log a job's loss every ``logging.logging_steps`` of its steps and at its last step."""
    every = config.logging.logging_steps

    def log(record: StepRecord) -> None:
        total = optimizers[record.adapter].inner.total_steps
        if record.step % every == 0 or record.step == total:
            _log.info(
                "%s step %d/%d  loss %.4f  lr %.3g  grad norm %.3g",
                record.adapter,
                record.step,
                total,
                record.loss,
                record.learning_rate,
                record.grad_norm,
            )

    return log
