"""Evaluation: each job's mean loss over its whole evaluation set, packed and computed like training.

The eval loss of adapter ``a`` is the token-weighted mean next-token cross-entropy over its eval
set ``E_a``:

    L_eval(a) = sum_{s in E_a} sum_{t in T(s)} CE(s, t) / sum_{s in E_a} |T(s)|

with ``T(s)`` the trained positions of sample ``s`` (targets other than -100: responses, assistant
turns). Every token weighs the same, however the samples fall into microbatches, as in the
per-global-batch training loss. The eval samples are packed into microbatches of at most the
capacity by ``lorafusion_sched`` (one global batch holding the whole set), laid out by
:func:`~lorafusion_megatron.packing.pack_microbatch` and run by
:meth:`~lorafusion_megatron.runner.MicrobatchRunner.evaluate`: no dropout, no gradients, nothing
that training depends on is touched, so a run trains to the same weights with or without it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lorafusion_megatron.data.job_data import JobData, data_fingerprint
from lorafusion_megatron.packing import pack_microbatch

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.data.samples import Sample
    from lorafusion_megatron.runner import MicrobatchRunner
    from lorafusion_sched.models import Microbatch

__all__ = ["EvalLoss", "Evaluator", "as_one_global_batch", "eval_due", "pack_eval_set"]


@dataclass(frozen=True)
class EvalLoss:
    """One evaluation of one adapter.

    Attributes:
        adapter: Job name.
        step: The job's optimizer steps taken when it was evaluated.
        loss: ``L_eval``: mean loss per trained token of the eval set.
        samples: Samples in the eval set.
        targets: Trained tokens in the eval set (the mean's denominator).
        seconds: Wall time of the evaluation.
        eval_set: 16 hex digits of the eval set's hash (its samples' token ids and targets, as
            :func:`~lorafusion_megatron.data.job_data.data_fingerprint` hashes training data), so
            that a history whose ``eval_dataset`` changed at a resume shows which set each loss
            measured; empty in histories of earlier versions.
    """

    adapter: str
    step: int
    loss: float
    samples: int
    targets: int
    seconds: float
    eval_set: str = ""


def eval_due(step: int, total_steps: int, eval_steps: int | None) -> bool:
    """Whether a job evaluates after its optimizer step ``step`` (1-based) of ``total_steps``.

    Every ``eval_steps`` steps, and after the last step; only after the last when ``eval_steps`` is ``None``.
    """
    return step >= total_steps or (eval_steps is not None and step % eval_steps == 0)


def as_one_global_batch(name: str, samples: Sequence[Sample]) -> JobData:
    """``samples`` as a job with one global batch holding all of them, in order (what the packer reads)."""
    return JobData(name=name, samples=samples, order=np.arange(len(samples)), global_batch_size=len(samples))


def pack_eval_set(eval_set: JobData, config: TrainerConfig) -> list[Microbatch]:
    """The eval set's samples grouped into microbatches of at most the capacity.

    The scheduler's greedy packing, without its MILP: how full the eval microbatches are only
    changes how long an evaluation takes, not its result.

    Args:
        eval_set: The job's eval samples as one global batch (:func:`as_one_global_batch`).
        config: The run (capacity, padding multiple, seed).
    """
    import lorafusion_sched
    from lorafusion_sched.models import AdapterJob, PlanOptions

    job = AdapterJob(name=eval_set.name, sample_tokens=eval_set.sample_tokens, global_batch_size=len(eval_set))
    options = PlanOptions(
        capacity=config.scheduler.resolved_capacity,
        padding_multiple=config.scheduler.padding_multiple,
        use_milp=False,
        seed=config.runtime.seed,
    )
    return list(lorafusion_sched.plan([job], options).microbatches)


class Evaluator:
    """Computes the eval loss of any job that has an eval set.

    Args:
        runner: The training run's microbatch runner (same model, adapters and kernels).
        data: Every job's data; jobs with ``eval_samples`` are evaluated.
        config: The run (capacity, padding, seed, each job's ``eval_steps``).
        device: The model's device.
    """

    def __init__(
        self, runner: MicrobatchRunner, data: Mapping[str, JobData], config: TrainerConfig, device: torch.device
    ) -> None:
        self.runner = runner
        self.device = device
        self._eval_steps = {job.name: job.eval_steps for job in config.jobs}
        self._sets = {
            name: as_one_global_batch(name, job.eval_samples) for name, job in data.items() if job.eval_samples
        }
        self._microbatches = {name: pack_eval_set(eval_set, config) for name, eval_set in self._sets.items()}
        self.eval_sets = {name: data_fingerprint({name: eval_set}) for name, eval_set in self._sets.items()}
        """Each evaluating job's eval-set hash (:attr:`EvalLoss.eval_set`)."""

    @property
    def adapters(self) -> tuple[str, ...]:
        """The jobs that evaluate, in config order."""
        return tuple(self._sets)

    def is_due(self, adapter: str, step: int, total_steps: int) -> bool:
        """Whether ``adapter`` evaluates after its optimizer step ``step`` of ``total_steps``."""
        return adapter in self._sets and eval_due(step, total_steps, self._eval_steps[adapter])

    def evaluate(self, adapter: str, step: int) -> EvalLoss:
        """``L_eval`` of ``adapter`` with its current weights.

        Args:
            adapter: A job that has an eval set.
            step: The job's optimizer steps so far (recorded with the result).
        """
        started = time.perf_counter()
        loss_sum = 0.0
        targets = 0
        for microbatch in self._microbatches[adapter]:
            batch = pack_microbatch(microbatch, self._sets).to(self.device)
            for result in self.runner.evaluate(batch):
                loss_sum += result.loss_sum
                targets += result.targets
        return EvalLoss(
            adapter=adapter,
            step=step,
            loss=loss_sum / targets,
            samples=len(self._sets[adapter]),
            targets=targets,
            seconds=time.perf_counter() - started,
            eval_set=self.eval_sets[adapter],
        )
