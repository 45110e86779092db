"""Each adapter's own AdamW, learning-rate schedule and gradient clipping.

Jobs train side by side but never share optimizer state: adapter ``a`` steps only when the plan
says its global batch is complete, with its own learning rate at its own step count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.config import JobConfig

__all__ = ["AdapterOptimizer", "QueuedStep", "StepStats", "lr_multiplier"]


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Factor on the peak learning rate for the optimizer step after ``step`` completed steps.

    Linear warm-up from 0 over ``warmup_steps``, then cosine or linear decay to 0 at
    ``total_steps``, or constant; the same curves as transformers' ``get_*_schedule_with_warmup``,
    so a job's learning rates match what the HF Trainer would use.
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class StepStats:
    """One optimizer step of one adapter.

    Attributes:
        step: Steps completed, this one included.
        learning_rate: Learning rate the step used.
        grad_norm: L2 norm of the gradient before clipping.
    """

    step: int
    learning_rate: float
    grad_norm: float


@dataclass(frozen=True)
class QueuedStep:
    """An optimizer step whose work is queued on the device; its gradient norm is read by :meth:`stats`.

    Attributes:
        step: Steps completed, this one included.
        learning_rate: Learning rate the step used.
        grad_norm: 0-d tensor on the parameters' device: the L2 norm of the gradient before clipping.
    """

    step: int
    learning_rate: float
    grad_norm: torch.Tensor

    def stats(self) -> StepStats:
        """The step's figures on the host (waits for the device until the norm is computed)."""
        return StepStats(step=self.step, learning_rate=self.learning_rate, grad_norm=float(self.grad_norm))


class _Multiplier:
    """The schedule as a callable object: ``LambdaLR`` keeps its attributes in its state dict."""

    def __init__(self, total_steps: int, warmup_steps: int, kind: str) -> None:
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.kind = kind

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, total_steps=self.total_steps, warmup_steps=self.warmup_steps, kind=self.kind)


class AdapterOptimizer:
    """AdamW + schedule + clipping over one adapter's parameters.

    Args:
        job: The job's hyper-parameters.
        parameters: The adapter's trainable tensors by name.
        total_steps: Optimizer steps the job will take (the plan's global batches of the job).
    """

    def __init__(self, job: JobConfig, parameters: Mapping[str, torch.nn.Parameter], total_steps: int) -> None:
        import torch

        self.name = job.name
        self.total_steps = total_steps
        self.max_grad_norm = job.max_grad_norm
        self.parameters = list(parameters.values())
        self.optimizer = torch.optim.AdamW(
            self.parameters,
            lr=job.learning_rate,
            betas=(job.adam_beta1, job.adam_beta2),
            eps=job.adam_epsilon,
            weight_decay=job.weight_decay,
        )
        warmup = math.ceil(job.warmup_ratio * total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _Multiplier(total_steps, warmup, job.lr_scheduler_type)
        )
        self.steps_done = 0

    def step(self) -> QueuedStep:
        """Clip, step, advance the schedule and clear the gradients, without waiting for the device.

        The gradient norm stays on the device (``QueuedStep.stats()`` reads it), so a caller that
        reads it once more work is queued never leaves the device idle at a step.
        """
        import torch

        grads = [p.grad for p in self.parameters if p.grad is not None]
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
        elif grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        else:
            norm = torch.zeros(())
        learning_rate = self.update()
        return QueuedStep(step=self.steps_done, learning_rate=learning_rate, grad_norm=norm.detach())

    def update(self) -> float:
        """AdamW step with the gradients as they are (no clipping), advance the schedule, clear the gradients.

        Returns:
            The learning rate the step used.
        """
        learning_rate = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return learning_rate

    def state_dict(self) -> dict[str, Any]:
        """Optimizer moments, schedule position and step count."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = int(state["steps_done"])
