"""An adapter's optimizer on one stage: data-parallel gradient all-reduce, pipeline-wide clipping, step.

The adapter's parameters are spread over the stages, so its gradient norm (for clipping) is the
root of the sum over stages of each stage's squared norm; each replica holds part of the global
batch, so gradients are summed over the data-parallel group first (each microbatch's loss is
already divided by the token count of the whole global batch, so the sum is the gradient of the
global batch). The AdamW step and the learning-rate schedule are the single-process trainer's
:class:`~lorafusion_megatron.optim.AdapterOptimizer`, with its local clipping turned off.

A step has two halves, so that the norm's all-reduce over the pipeline never makes a stage wait.
:meth:`StageOptimizer.begin_step` runs where the plan says the adapter steps (after this stage's
backward of the global batch's last microbatch) and only *posts* the 4-byte all-reduce of the
squared norms, asynchronously, on the layout's gloo ``control_group`` (host memory: no GPU kernel
spins waiting for the other stages, and no NCCL stream is shared with the activations).
:meth:`StageOptimizer.finish_step` waits for it, clips and steps; the engine calls it just before
the adapter's next forward on this stage (or when the pipeline drains). The later stages reach
the step point first; a stage that waited there for stage 0 (as a blocking all-reduce does) would
idle for up to ``S - 1`` microbatch slots at every step of every adapter, a flush in all but
name. Deferring the wait costs nothing in exactness, since nothing reads the adapter's weights on
this stage between the two halves, and costs no time: stage 0 posts right after its backward of
microbatch ``k``, which comes before its forward of ``k + S``, and by the bubble lemma the
adapter's next forward on any stage is of microbatch ``k + S`` or later, which reaches that stage
only after stage 0 has run it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.optim import AdapterOptimizer, StepStats

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.config import JobConfig
    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["StageOptimizer"]


class StageOptimizer:
    """One adapter's optimizer on one pipeline stage.

    Every stage and replica must call :meth:`begin_step` for the same adapters in the same order
    (the engine steps at the plan's ``step_after``, identical everywhere), since it runs
    collectives; :meth:`finish_step` follows each before the adapter's next forward on the stage.

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
        self._posted: tuple[Any, torch.Tensor] | None = None
        """The posted all-reduce of :meth:`begin_step` and its host tensor of squared norms."""
        self.norm_wait_seconds = 0.0
        """Time the last :meth:`finish_step` spent waiting for the other stages' norms."""

    def begin_step(self) -> None:
        """All-reduce the gradients over the replicas, then post the norm's all-reduce over the stages.

        Raises:
            RuntimeError: The previous step was not finished.
        """
        import torch
        import torch.distributed as dist

        if self._posted is not None:
            raise RuntimeError("begin_step twice without finish_step: the engine must finish each step first")
        for p in self.parameters:
            if p.grad is None:
                # A replica without samples of this global batch still joins the all-reduce.
                p.grad = torch.zeros_like(p)
        self._reduce_over_replicas()
        # Per stage as ``clip_grad_norm_`` computes it, so one stage gives the single-process norm
        # bit for bit. To the host: the stage's stream is idle at a step point (the engine waits
        # for every backward), so the copy waits for nothing.
        grads = self._grads()
        local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else None
        norm = torch.zeros((), dtype=torch.float32) if local is None else local.float().cpu()
        if self.layout.num_stages == 1:
            self._posted = (None, norm)
            return
        squares = norm.pow(2)
        self._posted = (dist.all_reduce(squares, group=self.layout.control_group, async_op=True), squares)

    def finish_step(self) -> StepStats:
        """Wait for the pipeline-wide norm, clip by it, step and clear the gradients.

        Raises:
            RuntimeError: No step was begun.
        """
        import torch

        if self._posted is None:
            raise RuntimeError("finish_step without begin_step")
        work, value = self._posted
        self._posted = None
        norm = value
        self.norm_wait_seconds = 0.0
        if work is not None:
            begin = time.perf_counter()
            work.wait()
            self.norm_wait_seconds = time.perf_counter() - begin
            norm = value.sqrt()
        if self.max_grad_norm is not None:
            # The same float32 arithmetic as torch.nn.utils.clip_grad_norm_.
            coefficient = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0).to(self.layout.device)
            for g in self._grads():
                g.mul_(coefficient.to(g.dtype))
        learning_rate = self.inner.update()
        return StepStats(step=self.inner.steps_done, learning_rate=learning_rate, grad_norm=float(norm))

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters if p.grad is not None]

    def _reduce_over_replicas(self) -> None:
        import torch
        import torch.distributed as dist

        grads = self._grads()
        if self.layout.num_replicas == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.layout.data_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
