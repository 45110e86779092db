"""A job's training sequence: its samples in training order over all epochs, cut into global batches.

Position ``i`` of the training sequence is what the scheduler calls sample ``i`` of the adapter:
global batch ``g`` is positions ``[g * gbs, (g + 1) * gbs)``. Epochs are concatenated, each with its
own seeded shuffle, so a global batch may straddle an epoch boundary and only the very last global
batch of the run can be partial. With ``max_steps`` the sequence cycles through epochs until it
holds exactly ``max_steps`` global batches.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from lorafusion_megatron.data.records import read_records
from lorafusion_megatron.data.samples import FitReport, Sample, fit_to_capacity, synthetic_samples, tokenize_records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lorafusion_megatron.config import JobConfig, TrainerConfig

__all__ = ["JobData", "job_seed", "load_job_data", "training_order"]


def job_seed(seed: int, name: str, purpose: str) -> int:
    """A seed for ``purpose`` of job ``name`` that does not depend on the other jobs or their order."""
    digest = hashlib.sha256(f"{seed}/{name}/{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def training_order(
    num_samples: int,
    *,
    global_batch_size: int,
    num_train_epochs: int,
    max_steps: int | None,
    shuffle: bool,
    seed: int,
) -> np.ndarray:
    """Sample indices in training order.

    Args:
        num_samples: Samples in the dataset.
        global_batch_size: Samples per optimizer step.
        num_train_epochs: Passes over the data (when ``max_steps`` is ``None``).
        max_steps: If set, exactly ``max_steps * global_batch_size`` positions, cycling epochs.
        shuffle: Permute each epoch (seed ``seed`` + epoch); else keep file order.
        seed: Base seed of the permutations.

    Returns:
        int64 array of indices into the samples.
    """
    wanted = max_steps * global_batch_size if max_steps is not None else num_samples * num_train_epochs
    epochs = math.ceil(wanted / num_samples)
    parts = []
    for epoch in range(epochs):
        if shuffle:
            parts.append(np.random.default_rng([seed, epoch]).permutation(num_samples))
        else:
            parts.append(np.arange(num_samples))
    return np.concatenate(parts)[:wanted].astype(np.int64)


@dataclass(frozen=True, eq=False)
class JobData:
    """One job's samples and training order.

    Attributes:
        name: Job (adapter) name.
        samples: Usable samples, as read.
        order: Training position -> index into ``samples``.
        global_batch_size: Samples per optimizer step.
        fit: What fitting to the capacity changed.
    """

    name: str
    samples: Sequence[Sample]
    order: np.ndarray
    global_batch_size: int
    fit: FitReport = field(default_factory=lambda: FitReport(0, 0, 0))

    def __len__(self) -> int:
        return int(self.order.shape[0])

    def sample(self, position: int) -> Sample:
        """The sample at training position ``position`` (the plan's sample index)."""
        return self.samples[int(self.order[position])]

    @property
    def sample_tokens(self) -> tuple[int, ...]:
        """Token count per training position (the scheduler's ``sample_tokens``)."""
        lengths = np.fromiter((len(s) for s in self.samples), dtype=np.int64, count=len(self.samples))
        return tuple(int(t) for t in lengths[self.order])

    def num_global_batches(self, *, drop_last: bool) -> int:
        """Optimizer steps of the job."""
        full, rest = divmod(len(self), self.global_batch_size)
        return full + (1 if rest and not drop_last else 0)

    def global_batch_targets(self, global_batch: int) -> int:
        """Trained tokens of global batch ``global_batch`` (its loss is their mean)."""
        start = global_batch * self.global_batch_size
        stop = min(start + self.global_batch_size, len(self))
        return sum(self.sample(i).num_targets for i in range(start, stop))


def _samples_of(
    config: TrainerConfig, job: JobConfig, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> list[Sample]:
    dataset = job.dataset
    if dataset.synthetic is not None:
        from lorafusion_sched.workloads import synthetic_lengths

        lengths = synthetic_lengths(
            dataset.synthetic, dataset.num_samples, job_seed(config.runtime.seed, job.name, "lengths") % 2**32
        )
        return synthetic_samples(
            lengths,
            vocab_size=vocab_size,
            seed=job_seed(config.runtime.seed, job.name, "tokens"),
            length_scale=dataset.length_scale,
        )
    assert dataset.path is not None
    if tokenizer is None:
        raise ValueError("a tokenizer is needed for a dataset read from a file")
    records = read_records(dataset.path, max_samples=dataset.max_samples)
    return tokenize_records(
        records,
        tokenizer,
        prompt_field=dataset.prompt_field,
        response_field=dataset.response_field,
        text_field=dataset.text_field,
        source=f"{dataset.path} (job {job.name})",
    )


def load_job_data(
    config: TrainerConfig, job: JobConfig, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> JobData:
    """Read, tokenise and fit ``job``'s dataset and lay out its training order.

    Args:
        config: The run (capacity, seed, long-sample policy).
        job: The job.
        tokenizer: The base model's tokenizer (unused for synthetic data).
        vocab_size: The model's vocabulary size (synthetic token ids stay below it).

    Raises:
        TrainerError: The dataset is missing, malformed or has no usable sample.
    """
    samples = _samples_of(config, job, tokenizer, vocab_size)
    source = job.dataset.synthetic or str(job.dataset.path)
    fitted, report = fit_to_capacity(
        samples, config.scheduler.resolved_capacity, config.scheduler.long_samples, source=f"{source} (job {job.name})"
    )
    order = training_order(
        len(fitted),
        global_batch_size=job.global_batch_size,
        num_train_epochs=job.num_train_epochs,
        max_steps=job.max_steps,
        shuffle=job.dataset.shuffle,
        seed=job_seed(config.runtime.seed, job.name, "shuffle") % 2**32,
    )
    return JobData(name=job.name, samples=fitted, order=order, global_batch_size=job.global_batch_size, fit=report)
