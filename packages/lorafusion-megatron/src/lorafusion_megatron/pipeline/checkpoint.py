"""Checkpoints of a pipeline run, taken when the pipeline is drained, that resume to the same weights.

A continuous 1F1B run has no moment when every stage is idle, so the program is cut into runs at
the rounds where ``save_steps`` optimizer steps (over all jobs) have been taken
(:func:`~lorafusion_megatron.pipeline.programs.split_for_checkpoints`): the pipeline drains there,
which costs one fill and drain and changes no result. Every rank then writes its own state,
``rank-<r>.pt``: its stage's LoRA weights and accumulated gradients (a checkpoint may fall inside
a global batch, and replicas' gradients differ until the all-reduce), its optimizers, the engine's
counters (on the last stage of replica 0 also the progress counters of :mod:`.progress`) and its
RNG. Rank 0 adds ``plan.json`` and ``trainer_state.json`` (position, fingerprint and the config it
hashes, parallel layout, the run's id: :mod:`~lorafusion_megatron.finished_run`) and renames the
folder into place, so a crash never leaves a checkpoint that looks complete. The
folders need a file system all ranks share (one node, or a shared mount). Ctrl-C writes one more,
at the drain the ranks agree on (:mod:`.stopping`), named after the steps taken like the others.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.atomic_dirs import replace_dir
from lorafusion_megatron.checkpoint import (
    RunFingerprint,
    damaged_message,
    load_torch_file,
    prune_checkpoints,
    read_checkpoint_file,
    read_checkpoint_meta,
)
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.finished_run import FinishedRun, finished_run
from lorafusion_megatron.pipeline.stall import Heartbeat, no_heartbeat
from lorafusion_megatron.run_layout import TRAINER_STATE
from lorafusion_megatron.state import InvalidStateError, whole_count
from lorafusion_megatron.write_errors import clear_write_errors

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.pipeline.groups import Layout
    from lorafusion_megatron.pipeline.optim import StageOptimizer
    from lorafusion_megatron.pipeline.options import ParallelConfig

__all__ = ["PIPELINE_FORMAT", "check_resumable", "load_rank_state", "read_run_state", "save_pipeline_checkpoint"]

PIPELINE_FORMAT = "pipeline-1"
"""``format`` of a pipeline checkpoint's ``trainer_state.json``."""


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank:05d}.pt"


def save_pipeline_checkpoint(
    directory: Path,
    *,
    layout: Layout,
    total_steps: int,
    position: int,
    parameters: Mapping[str, Mapping[str, torch.nn.Parameter]],
    optimizers: Mapping[str, StageOptimizer],
    engine_state: dict[str, Any],
    plan_json: str,
    fingerprint: RunFingerprint,
    run_id: str,
    parallel: ParallelConfig,
    keep: int | None,
    heartbeat: Heartbeat = no_heartbeat,
) -> Path:
    """Write ``checkpoint-<total_steps>`` (collective: every rank calls it at the same drain).

    Args:
        directory: The run's checkpoint folder.
        layout: This rank's place.
        total_steps: Optimizer steps of all jobs so far (names the folder).
        position: Index in the program of the next microbatch to run.
        parameters: This stage's tensors of each adapter.
        optimizers: This stage's optimizer of each adapter.
        engine_state: :meth:`StageEngine.state_dict`.
        plan_json: The plan being executed.
        fingerprint: The run's fingerprint (config and data: :func:`~lorafusion_megatron.checkpoint.run_fingerprint`).
        run_id: The run's id (drawn when it started afresh, the same in all its checkpoints).
        parallel: Stages, replicas and schedule (a resume must use the same).
        keep: Keep this many newest checkpoints (``None``: all).
        heartbeat: Told of each phase (this rank's file; waits on the other ranks).

    Returns:
        The checkpoint folder.
    """
    import torch
    import torch.distributed as dist

    target = directory / f"checkpoint-{total_steps}"
    staging: list[Any] = [None]
    if layout.rank == 0:
        with clear_write_errors(target):
            directory.mkdir(parents=True, exist_ok=True)
            staging[0] = tempfile.mkdtemp(dir=directory, prefix=f".{target.name}.tmp-")
    heartbeat(f"the checkpoint's folder from rank 0 ({target.name})", waiting=True)
    dist.broadcast_object_list(staging, src=0)
    heartbeat(f"this rank's checkpoint file ({target.name})")
    folder = Path(staging[0])
    state = {
        "params": {n: p.detach().cpu() for params in parameters.values() for n, p in params.items()},
        "grads": {
            n: p.grad.detach().cpu() for params in parameters.values() for n, p in params.items() if p.grad is not None
        },
        "optimizers": {name: opt.inner.state_dict() for name, opt in optimizers.items()},
        "engine": engine_state,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(layout.device) if layout.device.type == "cuda" else None,
    }
    with clear_write_errors(target):  # a full disk: this rank's clear error, the launcher's message
        torch.save(state, _rank_file(folder, layout.rank))
    heartbeat(f"the other ranks' checkpoint files ({target.name})", waiting=True)
    dist.barrier()
    if layout.rank == 0:
        heartbeat(f"completing the checkpoint ({target.name})")
        with clear_write_errors(target):
            try:
                (folder / "plan.json").write_text(plan_json, encoding="utf-8")
                meta = {
                    "format": PIPELINE_FORMAT,
                    **fingerprint.to_meta(),
                    "parallel": parallel.layout_settings(),
                    "position": position,
                    "run_id": run_id,
                    "total_optimizer_steps": total_steps,
                    "world_size": layout.world_size,
                }
                (folder / TRAINER_STATE).write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
                replace_dir(folder, target)
            finally:
                if folder.exists():
                    shutil.rmtree(folder)
        if keep is not None:
            prune_checkpoints(directory, keep)
    heartbeat(f"rank 0 completing the checkpoint ({target.name})", waiting=True)
    dist.barrier()
    return target


def read_run_state(path: Path, *, fingerprint: RunFingerprint, parallel: ParallelConfig) -> dict[str, Any]:
    """``trainer_state.json`` of a pipeline checkpoint, checked against this run.

    Raises:
        TrainerError: Unreadable, written by the single-process trainer, for another config, or for
            another parallel layout.
    """
    meta = read_checkpoint_meta(path, fingerprint=fingerprint)
    if meta.get("format") != PIPELINE_FORMAT:
        raise TrainerError(
            f"checkpoint {path} was written by the single-process trainer: resume it without pipeline parallelism"
        )
    if meta.get("parallel") != parallel.layout_settings():
        raise TrainerError(
            f"checkpoint {path} was written with parallel settings {meta.get('parallel')}; this run has "
            f"{parallel.layout_settings()}: resume with the same stages, replicas and schedule"
        )
    try:  # what a hand edit could break: the rank files are binary
        for key in ("position", "total_optimizer_steps"):
            whole_count(meta.get(key), key)
    except InvalidStateError as exc:
        raise TrainerError(damaged_message(path, f"{TRAINER_STATE} holds what no run writes ({exc})")) from None
    return meta


def check_resumable(config: TrainerConfig, parallel: ParallelConfig) -> FinishedRun | None:
    """Refuse a ``--resume`` of ``config`` on ``parallel`` before any rank starts, as rank 0 would later.

    A run that already finished (:func:`~lorafusion_megatron.finished_run.finished_run`) is
    returned, once its config and parallel settings are found to be these: nothing is left to
    resume. Otherwise the newest checkpoint must exist, come from a pipeline run of this config
    (the data's part of the fingerprint needs the tokenized data: rank 0 checks it) and have these
    parallel settings. ``capacity: auto`` is compared as the ranks resolve it (from ``profile.json``),
    not as written; ``activation_checkpointing`` may differ (it cannot change the result).

    Returns:
        The finished run, or ``None``: the ranks resume from the newest checkpoint.

    Raises:
        TrainerError: As :func:`read_run_state` or :meth:`FinishedRun.check_config`, or no checkpoint to resume.
    """
    from lorafusion_megatron.checkpoint import checkpoint_to_resume, run_fingerprint
    from lorafusion_megatron.profiler.run import with_profiled_choices

    fingerprint = run_fingerprint(with_profiled_choices(config), None)
    finished = finished_run(config, pipeline=True)
    if finished is not None:
        finished.check_config(fingerprint, parallel=parallel.layout_settings())
        return finished
    found = checkpoint_to_resume(config.checkpoint_dir, resume=True, pipeline=True)
    assert found is not None  # resume=True raises instead
    read_run_state(found, fingerprint=fingerprint, parallel=parallel)
    return None


def load_rank_state(
    path: Path,
    *,
    layout: Layout,
    parameters: Mapping[str, Mapping[str, torch.nn.Parameter]],
    optimizers: Mapping[str, StageOptimizer],
) -> dict[str, Any]:
    """Restore this rank's weights, gradients, optimizers and RNG; returns the engine's state."""
    import torch

    state = read_checkpoint_file(path, _rank_file(path, layout.rank).name, load_torch_file)
    with torch.no_grad():
        for params in parameters.values():
            for name, param in params.items():
                param.copy_(state["params"][name])
                grad = state["grads"].get(name)
                param.grad = None if grad is None else grad.to(param.device, param.dtype)
    for name, optimizer in optimizers.items():
        optimizer.inner.load_state_dict(state["optimizers"][name])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng"], layout.device)
    engine: dict[str, Any] = state["engine"]
    return engine
