"""Hold part of a job's dataset out of training, as its evaluation set (``val_size``).

The held-out samples are a seeded random choice of ``k`` of the ``n`` samples as read, with
``k = ceil(val_size * n)`` for a fraction ``val_size < 1`` and ``k = val_size`` for a whole number
(as LLaMA-Factory's ``val_size``). The choice depends only on ``n``, ``val_size`` and the seed, so
a re-run or a resume holds out the same samples; both parts keep the dataset's order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from lorafusion_megatron.errors import TrainerError

__all__ = ["held_out_count", "held_out_indices", "split_held_out"]

T = TypeVar("T")


def held_out_count(num_samples: int, val_size: float, *, source: str) -> int:
    """``k``: samples to hold out of ``num_samples``.

    Raises:
        TrainerError: ``k`` leaves no sample to train on.
    """
    count = math.ceil(val_size * num_samples) if val_size < 1 else int(val_size)
    if count >= num_samples:
        if count == num_samples:
            held = f"holds out {count} of its {num_samples} samples"
        else:
            held = f"asks to hold out {count} samples, but it has {num_samples}"
        fix = (
            f"lower val_size (a count below {num_samples}, or a smaller fraction)"
            if num_samples > 1
            else "holding a sample out needs at least 2"
        )
        raise TrainerError(f"dataset {source}: val_size = {val_size:g} {held}, leaving none to train on: {fix}")
    return count


def held_out_indices(num_samples: int, count: int, *, seed: int) -> np.ndarray:
    """Sorted indices of the ``count`` held-out samples, a seeded random choice of ``range(num_samples)``."""
    chosen = np.random.default_rng(seed).permutation(num_samples)[:count]
    return np.sort(chosen)


def split_held_out(samples: Sequence[T], val_size: float, *, seed: int, source: str) -> tuple[list[T], list[T]]:
    """Split ``samples`` into (training, held-out), each in the original order.

    Args:
        samples: The job's samples as read (before fitting to the capacity).
        val_size: A fraction below 1, or a whole number of samples.
        seed: Seed of the choice (:func:`lorafusion_megatron.data.job_data.job_seed` of the job).
        source: Dataset name for messages.
    """
    count = held_out_count(len(samples), val_size, source=source)
    held = np.zeros(len(samples), dtype=bool)
    held[held_out_indices(len(samples), count, seed=seed)] = True
    training = [sample for sample, out in zip(samples, held, strict=True) if not out]
    held_out = [sample for sample, out in zip(samples, held, strict=True) if out]
    return training, held_out
