"""A job's training sequence: its samples in training order over all epochs, cut into global batches.

Position ``i`` of the training sequence is what the scheduler calls sample ``i`` of the adapter:
global batch ``g`` is positions ``[g * gbs, (g + 1) * gbs)``. Epochs are concatenated, each with its
own seeded shuffle, so a global batch may straddle an epoch boundary and only the very last global
batch of the run can be partial. With ``max_steps`` the sequence cycles through epochs until it
holds exactly ``max_steps`` global batches.

A job that evaluates also carries its evaluation samples (held out of its dataset, or read from its
``eval_dataset``); they never enter the training sequence.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from lorafusion_megatron.data.eval_split import split_held_out
from lorafusion_megatron.data.records import read_records
from lorafusion_megatron.data.samples import Sample, fit_to_capacity, synthetic_samples, tokenize_records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lorafusion_megatron.config import DatasetConfig, JobConfig, TrainerConfig

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
    """One job's samples and training order, and its evaluation samples.

    Attributes:
        name: Job (adapter) name.
        samples: Usable training samples, as read (without the held-out ones).
        order: Training position -> index into ``samples``.
        global_batch_size: Samples per optimizer step.
        eval_samples: Usable evaluation samples (held out of the dataset, or from ``eval_dataset``),
            in dataset order; empty when the job does not evaluate.
    """

    name: str
    samples: Sequence[Sample]
    order: np.ndarray
    global_batch_size: int
    eval_samples: Sequence[Sample] = ()

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
    config: TrainerConfig,
    job: JobConfig,
    dataset: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    *,
    role: Literal["train", "eval"],
) -> list[Sample]:
    if dataset.synthetic is not None:
        from lorafusion_sched.workloads import synthetic_lengths

        # The training set keeps its original seeds; a synthetic eval set draws its own.
        prefix = "" if role == "train" else "eval-"
        lengths = synthetic_lengths(
            dataset.synthetic, dataset.num_samples, job_seed(config.runtime.seed, job.name, f"{prefix}lengths") % 2**32
        )
        return synthetic_samples(
            lengths,
            vocab_size=vocab_size,
            seed=job_seed(config.runtime.seed, job.name, f"{prefix}tokens"),
            length_scale=dataset.length_scale,
        )
    assert dataset.path is not None
    if tokenizer is None:
        raise ValueError("a tokenizer is needed for a dataset read from a file")
    key = "dataset" if role == "train" else "eval_dataset"
    records = read_records(dataset.path, max_samples=dataset.max_samples, key=f"{key}.path")
    return tokenize_records(
        records,
        tokenizer,
        prompt_field=dataset.prompt_field,
        response_field=dataset.response_field,
        text_field=dataset.text_field,
        messages_field=dataset.messages_field,
        source=f"{dataset.path} (job {job.name})",
    )


def _source(dataset: DatasetConfig) -> str:
    return dataset.synthetic or str(dataset.path)


def load_job_data(
    config: TrainerConfig, job: JobConfig, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> JobData:
    """Read, tokenise and fit ``job``'s dataset and lay out its training order; the same for its eval set.

    With ``val_size`` the held-out samples are chosen before fitting (see
    :mod:`lorafusion_megatron.data.eval_split`), so the choice does not depend on the capacity.

    Args:
        config: The run (capacity, seed, long-sample policy).
        job: The job.
        tokenizer: The base model's tokenizer (unused for synthetic data).
        vocab_size: The model's vocabulary size (synthetic token ids stay below it).

    Raises:
        TrainerError: A dataset is missing, malformed or has no usable sample, or ``val_size``
            leaves nothing to train on.
    """
    capacity, long_samples = config.scheduler.resolved_capacity, config.scheduler.long_samples
    source = f"{_source(job.dataset)} (job {job.name})"
    samples = _samples_of(config, job, job.dataset, tokenizer, vocab_size, role="train")
    eval_samples: list[Sample] = []
    eval_source = source
    if job.val_size is not None:
        samples, eval_samples = split_held_out(
            samples, job.val_size, seed=job_seed(config.runtime.seed, job.name, "eval-split") % 2**32, source=source
        )
        eval_source = f"held-out part of {source}"
    elif job.eval_dataset is not None:
        eval_samples = _samples_of(config, job, job.eval_dataset, tokenizer, vocab_size, role="eval")
        eval_source = f"eval_dataset {_source(job.eval_dataset)} (job {job.name})"
    fitted, _ = fit_to_capacity(samples, capacity, long_samples, source=source)
    if eval_samples:
        eval_samples, _ = fit_to_capacity(eval_samples, capacity, long_samples, source=eval_source)
    order = training_order(
        len(fitted),
        global_batch_size=job.global_batch_size,
        num_train_epochs=job.num_train_epochs,
        max_steps=job.max_steps,
        shuffle=job.dataset.shuffle,
        seed=job_seed(config.runtime.seed, job.name, "shuffle") % 2**32,
    )
    return JobData(
        name=job.name,
        samples=fitted,
        order=order,
        global_batch_size=job.global_batch_size,
        eval_samples=eval_samples,
    )


def data_fingerprint(jobs: Mapping[str, JobData]) -> str:
    """Hash of every job's training samples (token ids and targets) in training order.

    A checkpoint stores it beside the config's fingerprint, so a resume notices a dataset whose
    content changed under the same path (which the config's fingerprint, holding only the path,
    cannot). Evaluation samples are left out, as the config's fingerprint leaves out eval datasets.
    """
    digest = hashlib.sha256()
    for name in sorted(jobs):
        job = jobs[name]
        digest.update(f"{name}:{job.global_batch_size}:{len(job)}".encode())
        digest.update(np.ascontiguousarray(job.order, dtype=np.int64).tobytes())
        for sample in job.samples:
            digest.update(np.ascontiguousarray(sample.input_ids, dtype=np.int64).tobytes())
            digest.update(np.ascontiguousarray(sample.targets, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]
