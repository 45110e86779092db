"""Multi-adapter LoRA scheduler: pure Python (pydantic + HiGHS), never torch.

>>> from lorafusion_sched import AdapterJob, PlanOptions, plan, verify
>>> jobs = [AdapterJob(name="a", sample_tokens=(900, 400, 700, 300), global_batch_size=2)]
>>> p = plan(jobs, PlanOptions(capacity=1024, pipeline_stages=2, padding_multiple=64))
>>> verify(p)
[]
"""

from __future__ import annotations

from lorafusion_sched.__about__ import __version__
from lorafusion_sched.errors import InvalidPlanError, SchedError, SchedWarning
from lorafusion_sched.models import (
    SCHEMA_VERSION,
    AdapterInfo,
    AdapterJob,
    CostModel,
    Microbatch,
    Plan,
    PlanOptions,
    PlanStats,
    RunStats,
    RuntimeSettings,
    Segment,
    SimulationResult,
    Violation,
)
from lorafusion_sched.planner import plan
from lorafusion_sched.simulate import simulate
from lorafusion_sched.verify import verify

__all__ = [
    "SCHEMA_VERSION",
    "AdapterInfo",
    "AdapterJob",
    "CostModel",
    "InvalidPlanError",
    "Microbatch",
    "Plan",
    "PlanOptions",
    "PlanStats",
    "RunStats",
    "RuntimeSettings",
    "SchedError",
    "SchedWarning",
    "Segment",
    "SimulationResult",
    "Violation",
    "__version__",
    "plan",
    "simulate",
    "verify",
]
