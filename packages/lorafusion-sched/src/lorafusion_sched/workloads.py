"""Seeded SYNTHETIC token-length workloads standing in for the paper's datasets.

The paper schedules real XSum, CNN/DailyMail and WikiSum samples (document + summary, LLaMA-3
tokens, capped at 4,096). Those cannot be downloaded here, so this module draws log-normal lengths
whose medians and spreads are estimated from published averages; the parameters and their sources
live in ``data/workloads.json``. Use :func:`lorafusion_sched.io.read_lengths` for real lengths.

Workloads (each adapter draws its own samples from its own seed):

* ``xsum``, ``cnndm``, ``wikisum``: every adapter on that dataset;
* ``mixed``: every adapter on the equal mixture of the three;
* ``het``: adapters cycle through ``xsum``, ``cnndm``, ``wikisum``, ``mixed`` (the paper's
  heterogeneous setting with 4 adapters).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

import numpy as np

from lorafusion_sched.errors import SchedError
from lorafusion_sched.models import AdapterJob

__all__ = ["WORKLOADS", "synthetic_jobs", "synthetic_lengths", "workload_parameters"]

WORKLOADS = ("xsum", "cnndm", "wikisum", "mixed", "het")
"""Names accepted by :func:`synthetic_jobs`."""

_HET_CYCLE = ("xsum", "cnndm", "wikisum", "mixed")


@functools.cache
def workload_parameters() -> dict[str, Any]:
    """The shipped parameters (medians, spreads, clipping, citations) as a dict."""
    text = importlib.resources.files("lorafusion_sched").joinpath("data/workloads.json").read_text("utf-8")
    params: dict[str, Any] = json.loads(text)
    return params


def synthetic_lengths(dataset: str, num_samples: int, seed: int) -> list[int]:
    """Draw ``num_samples`` token lengths of ``dataset`` (a dataset or a mixture name).

    Args:
        dataset: ``xsum``, ``cnndm``, ``wikisum`` or ``mixed``.
        num_samples: How many lengths to draw.
        seed: Seed of the numpy generator; the same seed gives the same lengths.

    Returns:
        Integer lengths clipped to ``[min_tokens, max_tokens]`` of the parameter file.

    Raises:
        SchedError: For an unknown dataset or a negative sample count.
    """
    params = workload_parameters()
    datasets: dict[str, Any] = params["datasets"]
    mixtures: dict[str, list[str]] = params["mixtures"]
    if num_samples < 0:
        raise SchedError(f"num_samples = {num_samples}: it must be at least 0")
    rng = np.random.default_rng(seed)
    if dataset in mixtures:
        members = mixtures[dataset]
        choice = rng.integers(0, len(members), size=num_samples)
        medians = np.array([datasets[m]["median"] for m in members], dtype=float)[choice]
        sigmas = np.array([datasets[m]["sigma_log"] for m in members], dtype=float)[choice]
    elif dataset in datasets:
        medians = np.full(num_samples, float(datasets[dataset]["median"]))
        sigmas = np.full(num_samples, float(datasets[dataset]["sigma_log"]))
    else:
        known = ", ".join(sorted([*datasets, *mixtures]))
        raise SchedError(f"dataset = {dataset!r} is unknown: choose one of {known}")
    raw = np.exp(np.log(medians) + sigmas * rng.standard_normal(num_samples))
    clipped = np.clip(np.rint(raw), params["min_tokens"], params["max_tokens"])
    return [int(t) for t in clipped]


def synthetic_jobs(
    workload: str,
    num_samples: int,
    *,
    num_adapters: int = 4,
    global_batch_size: int = 16,
    seed: int = 0,
) -> list[AdapterJob]:
    """Jobs of a named synthetic workload, ``num_samples`` in total split evenly over the adapters.

    Args:
        workload: One of :data:`WORKLOADS`.
        num_samples: Total samples over all adapters (each gets ``num_samples // num_adapters``,
            the first ones one more when it does not divide).
        num_adapters: Number of jobs.
        global_batch_size: Global batch size of every job.
        seed: Base seed; adapter ``i`` draws with ``seed * 1000 + i``.

    Returns:
        Jobs named ``<dataset>-<i>``.

    Raises:
        SchedError: For an unknown workload or too few samples for the adapters.
    """
    if workload not in WORKLOADS:
        raise SchedError(f"workload = {workload!r} is unknown: choose one of {', '.join(WORKLOADS)}")
    if num_adapters < 1:
        raise SchedError(f"num_adapters = {num_adapters}: it must be at least 1")
    if num_samples < num_adapters:
        raise SchedError(f"num_samples = {num_samples}: give at least one sample per adapter ({num_adapters})")
    jobs = []
    for i in range(num_adapters):
        dataset = _HET_CYCLE[i % len(_HET_CYCLE)] if workload == "het" else workload
        count = num_samples // num_adapters + (1 if i < num_samples % num_adapters else 0)
        lengths = synthetic_lengths(dataset, count, seed * 1000 + i)
        jobs.append(
            AdapterJob(name=f"{dataset}-{i}", sample_tokens=tuple(lengths), global_batch_size=global_batch_size)
        )
    return jobs
