"""An adapter's optimizer on one stage: data-parallel gradient all-reduce, pipeline-wide clipping, step.

The adapter's parameters are spread over the stages, so its gradient norm (for clipping) is the
root of the sum over stages of each stage's squared norm; each replica holds part of the global
batch, so gradients are summed over the data-parallel group first (each microbatch's loss is
already divided by the token count of the whole global batch, so the sum is the gradient of the
global batch). The AdamW step and the learning-rate schedule are the single-process trainer's
:class:`~lorafusion_megatron.optim.AdapterOptimizer`, with its local clipping turned off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from lorafusion_megatron.optim import AdapterOptimizer, StepStats

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.config import JobConfig
    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["StageOptimizer"]


class StageOptimizer:
    """One adapter's optimizer on one pipeline stage.

    Every stage and replica must call :meth:`step` for the same adapters in the same order (the
    engine steps at the plan's ``step_after``, identical everywhere), since it runs collectives.

    Args:
        job: The job's hyper-parameters.
        parameters: This stage's tensors of the adapter.
        total_steps: Optimizer steps of the job.
        layout: The process's groups.
    """

    def __init__(
        self, job: JobConfig, parameters: Mapping[str, torch.nn.Parameter], total_steps: int, layout: Layout
    ) -> None:
        self.layout = layout
        self.max_grad_norm = job.max_grad_norm
        self.parameters = list(parameters.values())
        self.inner = AdapterOptimizer(job.model_copy(update={"max_grad_norm": None}), parameters, total_steps)

    def _reduce_over_replicas(self) -> None:
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self.parameters if p.grad is not None]
        if self.layout.num_replicas == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.layout.data_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _global_norm(self) -> torch.Tensor:
        """The adapter's gradient norm over all stages (a float32 scalar tensor).

        Per stage it is computed as ``clip_grad_norm_`` computes it, so one stage gives the
        single-process trainer's norm bit for bit; stages combine their squares.
        """
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self.parameters if p.grad is not None]
        local: torch.Tensor = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        if grads:
            local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if self.layout.num_stages == 1:
            return local
        squares: torch.Tensor = local.float().pow(2)
        dist.all_reduce(squares, group=self.layout.pipeline_group)
        root: torch.Tensor = squares.sqrt()
        return root

    def step(self) -> StepStats:
        """All-reduce over replicas, clip by the pipeline-wide norm, step and clear gradients."""
        import torch

        for p in self.parameters:
            if p.grad is None:
                # A replica without samples of this global batch still joins the all-reduce.
                p.grad = torch.zeros_like(p)
        self._reduce_over_replicas()
        norm = self._global_norm()
        if self.max_grad_norm is not None:
            # The same float32 arithmetic as torch.nn.utils.clip_grad_norm_.
            coefficient = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for p in self.parameters:
                assert p.grad is not None
                p.grad.mul_(coefficient.to(p.grad.device, p.grad.dtype))
        stats = self.inner.step()
        return StepStats(step=stats.step, learning_rate=stats.learning_rate, grad_norm=float(norm))
