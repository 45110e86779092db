"""Which config changes ``--resume`` accepts: those that cannot change what the resumed run computes.

A checkpoint stores the config it was written with (:func:`~lorafusion_megatron.config.fingerprinted_config`).
A resume whose config differs from it only in these settings executes exactly what a resume with
the stored config would, so it is the same run:

* ``scheduler.milp_time_limit``: it bounds planning, and a resume executes the checkpoint's plan;
* the order of ``jobs``: the plan, the checkpoint's tensors and optimizer states, the data's hashes
  and the dropout seeds name a job, never its position;
* ``num_train_epochs`` of a job with ``max_steps``, which overrides it;
* ``runtime.activation_checkpointing``: a recomputed layer repeats its forward with the same
  weights and dropout draws, so the gradients are those of a layer that kept its activations
  (memory for time: a resume on a smaller GPU may recompute more), and the plan, whose stage costs
  it entered, is the checkpoint's;
* ``runtime.device`` and ``base_model.attn_implementation`` values that resolve to the same device
  and attention kernel on this host (``auto`` and ``cpu`` where torch sees no GPU).

Dataset paths may differ too when the data's hashes match (a project moved elsewhere): the
checkpoint module compares those. Any other difference can change the trained weights, and a
refusal names it; a job's length (``max_steps``, ``num_train_epochs``) gets its own explanation,
since a longer run is not a continuation of a shorter one.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any

from lorafusion_megatron.config_diff import changed_keys
from lorafusion_megatron.errors import TrainerError

__all__ = ["comparable_config", "length_changed", "relevant_changes"]


def comparable_config(config: Mapping[str, Any], *, dataset_paths: bool = True) -> dict[str, Any]:
    """``config`` (fingerprinted config data) without what a resume may change, the rest resolved on this host.

    Args:
        config: A config as :func:`~lorafusion_megatron.config.fingerprinted_config` returns it (a
            checkpoint's stored copy may come from an earlier version: missing keys are left missing).
        dataset_paths: Keep the jobs' dataset paths; ``False`` blanks them (the data's hash decides).

    Returns:
        A copy: equal for two configs whose resumes execute the same.
    """
    data = copy.deepcopy(dict(config))
    scheduler = data.get("scheduler")
    if isinstance(scheduler, dict):
        scheduler.pop("milp_time_limit", None)
    runtime, base_model = data.get("runtime"), data.get("base_model")
    if isinstance(runtime, dict):
        runtime.pop("activation_checkpointing", None)
    if isinstance(runtime, dict) and isinstance(base_model, dict):
        _resolve_device_and_attention(runtime, base_model)
    jobs = data.get("jobs")
    if isinstance(jobs, list) and all(isinstance(job, dict) for job in jobs):
        for job in jobs:
            if job.get("max_steps") is not None:
                job.pop("num_train_epochs", None)
            if not dataset_paths and isinstance(job.get("dataset"), dict):
                job["dataset"]["path"] = None
        data["jobs"] = sorted(jobs, key=lambda job: str(job.get("name")))
    return data


def _resolve_device_and_attention(runtime: dict[str, Any], base_model: dict[str, Any]) -> None:
    """Replace ``runtime.device`` and ``base_model.attn_implementation`` by what they are on this host.

    A value this host cannot resolve (``cuda`` without a GPU) stays as written, so it differs from
    any value that resolves.
    """
    from lorafusion_megatron.model import resolve_attn_implementation, resolve_device

    try:
        device = resolve_device(str(runtime.get("device")))
    except (TrainerError, RuntimeError):  # no GPU for cuda; torch's own error for a name it does not know
        return
    runtime["device"] = device.type
    with contextlib.suppress(TrainerError):  # flash_attention_2 without its package, varlen on an older torch
        attention = str(base_model.get("attn_implementation"))
        base_model["attn_implementation"] = resolve_attn_implementation(attention, device)


def relevant_changes(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The differences that matter to a resume, as :func:`~lorafusion_megatron.config_diff.changed_keys` lines.

    Each line shows the values as the configs hold them (``runtime.device: auto -> cpu``), but only
    keys that still differ in :func:`comparable_config` are listed.
    """
    relevant = {_key(line) for line in changed_keys(comparable_config(stored), comparable_config(current))}
    return [line for line in changed_keys(stored, current) if _key(line) in relevant]


def _key(line: str) -> str:
    """The key a :func:`~lorafusion_megatron.config_diff.changed_keys` line is about (``jobs[a].r``)."""
    return line.partition(": ")[0]


def length_changed(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The jobs of both configs whose length differs: another ``max_steps``, or epochs without ``max_steps``."""
    old, new = _jobs_by_name(comparable_config(stored)), _jobs_by_name(comparable_config(current))
    return [name for name, job in new.items() if name in old and _length(old[name]) != _length(job)]


def _jobs_by_name(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``config``'s jobs by their names (none where it holds no list of jobs)."""
    jobs = config.get("jobs")
    if not isinstance(jobs, list):
        return {}
    return {str(job.get("name")): job for job in jobs if isinstance(job, dict)}


def _length(job: Mapping[str, Any]) -> tuple[Any, Any]:
    """What sets a job's number of steps: ``max_steps``, else (popped by :func:`comparable_config` otherwise) epochs."""
    return job.get("max_steps"), job.get("num_train_epochs")
