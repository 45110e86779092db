"""How a run is spread over processes: pipeline stages, data-parallel replicas and the schedule.

Torch-free, like the trainer's config, so that a config validates without torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from lorafusion_megatron.config_section import ConfigSection

__all__ = ["SCHEDULES", "ParallelConfig", "Schedule"]

Schedule = Literal["lorafusion", "megatron-1f1b", "mlora"]

SCHEDULES: tuple[Schedule, ...] = ("lorafusion", "megatron-1f1b", "mlora")
"""The schedules the pipeline runtime executes (the plan's, and the paper's two baselines)."""


class ParallelConfig(ConfigSection):
    """Pipeline and data parallelism of a run (tensor parallelism is always 1)."""

    pipeline_stages: int = Field(default=1, ge=1)
    """Pipeline stages ``S``: the decoder layers are split into ``S`` balanced stages, one per GPU."""

    data_parallel: int = Field(default=1, ge=1)
    """Data-parallel replicas ``d`` of the pipeline; ``S * d`` processes in all."""

    schedule: Schedule = "lorafusion"
    """``lorafusion``: the plan's packed microbatches in one continuous 1F1B pipeline;
    ``megatron-1f1b``: each adapter alone in turn, fixed samples per microbatch, a flush per global
    batch; ``mlora``: adapters round-robin, fixed samples per microbatch, one continuous pipeline."""

    baseline_microbatch_samples: int | None = Field(default=None, ge=1)
    """Samples per microbatch of the baselines; default: the most whose mean length fits the capacity."""

    collective_timeout_minutes: int = Field(default=30, ge=1)
    """How long a rank waits for its peers in a transfer or collective before it fails the run; one
    action of a rank's own (reading the data, planning, loading its layers, a forward, a backward,
    its checkpoint file) that lasts 0.9 of it, or a wait on other ranks that lasts 1.1 of it, ends
    the rank, named with its stack (:mod:`~lorafusion_megatron.pipeline.stall`). A rank that hangs
    without failing (a stalled file system, a deadlock) stalls the others about this long. Keep it
    above the longest start-up step and the longest wait of a healthy rank: a stage's first exchange
    waits for the first forwards of the stages before it, each of which may compile kernels."""

    def layout_settings(self) -> dict[str, Any]:
        """What a checkpoint records and its resume must match: every setting but the collective timeout."""
        return self.model_dump(mode="json", exclude={"collective_timeout_minutes"})

    @property
    def world_size(self) -> int:
        """Processes the run needs."""
        return self.pipeline_stages * self.data_parallel

    @property
    def needs_pipeline_runtime(self) -> bool:
        """Whether the run goes to the pipeline runtime: several processes, or a baseline schedule."""
        return self.world_size > 1 or self.schedule != "lorafusion"
