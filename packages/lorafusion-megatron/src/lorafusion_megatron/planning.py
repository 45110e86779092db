"""From the jobs' token lengths to a verified ``lorafusion_sched`` plan (Contract 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_sched.models import AdapterJob, Plan

__all__ = ["check_plan", "make_plan", "plan_from_json"]


def make_plan(
    config: TrainerConfig, data: Mapping[str, JobData], *, pipeline_stages: int = 1, data_parallel: int = 1
) -> Plan:
    """Plan the run: every job's samples packed into microbatches of at most the capacity.

    With a ``profile.json`` of ``pipeline_stages`` stages in the output folder, the planner gets its
    measured cost model and splits the global batches that run alone where that model finds smaller
    microbatches faster (``lorafusion_sched.lone_batches``; the training is the same).

    Args:
        config: The run (capacity, padding multiple, solver limits, seed).
        data: Every job's training data, in config order.
        pipeline_stages: ``S``: the bubble lemma keeps an adapter's global batches ``S`` rounds apart.
        data_parallel: ``d``: replicas the microbatches are dealt to round-robin.

    Returns:
        A plan that :func:`check_plan` accepted.
    """
    import lorafusion_sched
    from lorafusion_megatron.profiler.run import profiled_cost_model
    from lorafusion_sched.errors import SchedError
    from lorafusion_sched.models import PlanOptions

    jobs = _scheduler_jobs(data)
    options = PlanOptions(
        capacity=config.scheduler.resolved_capacity,
        pipeline_stages=pipeline_stages,
        data_parallel=data_parallel,
        padding_multiple=config.scheduler.padding_multiple,
        drop_last=config.scheduler.drop_last,
        time_limit=config.scheduler.milp_time_limit,
        seed=config.runtime.seed,
        cost_model=profiled_cost_model(config, pipeline_stages),
    )
    try:
        plan = lorafusion_sched.plan(jobs, options)
    except SchedError as exc:
        raise TrainerError(f"the scheduler refused the jobs: {exc}") from None
    check_plan(plan, data, config, pipeline_stages=pipeline_stages, data_parallel=data_parallel)
    return plan


def _scheduler_jobs(data: Mapping[str, JobData]) -> list[AdapterJob]:
    """The jobs as the scheduler takes them: name, sample lengths in training order, global batch size."""
    from lorafusion_sched.models import AdapterJob

    return [
        AdapterJob(name=name, sample_tokens=job.sample_tokens, global_batch_size=job.global_batch_size)
        for name, job in data.items()
    ]


def plan_from_json(text: str) -> Plan:
    """Parse a plan document (as saved in a checkpoint)."""
    from lorafusion_sched.models import Plan

    return Plan.model_validate_json(text)


def check_plan(
    plan: Plan, data: Mapping[str, JobData], config: TrainerConfig, *, pipeline_stages: int = 1, data_parallel: int = 1
) -> None:
    """Refuse a plan that breaks an invariant, was made for other settings, or does not fit the jobs' data.

    Args:
        plan: The plan to execute.
        data: Every job's training data.
        config: The run (its capacity, padding multiple and ``drop_last``).
        pipeline_stages: The stages that execute the plan.
        data_parallel: The replicas that execute the plan.

    Raises:
        TrainerError: Naming each violation (``[jobs]``: the plan is not for these jobs' samples).
    """
    import lorafusion_sched
    from lorafusion_sched.models import RuntimeSettings

    runtime = RuntimeSettings(
        capacity=config.scheduler.resolved_capacity,
        pipeline_stages=pipeline_stages,
        data_parallel=data_parallel,
        padding_multiple=config.scheduler.padding_multiple,
        drop_last=config.scheduler.drop_last,
    )
    jobs = _scheduler_jobs(data)
    violations = lorafusion_sched.verify(plan, runtime=runtime, jobs=jobs)
    if violations:
        listed = "\n".join(f"  - {v}" for v in violations[:20])
        more = f"\n  ... and {len(violations) - 20} more" if len(violations) > 20 else ""
        raise TrainerError(f"the plan breaks {len(violations)} invariant(s):\n{listed}{more}")
