"""Checkpoints that resume to the same weights as an uninterrupted run.

A checkpoint may be taken after any microbatch, also in the middle of a job's global batch, so it
holds everything the next microbatch depends on: every adapter's weights *and* its accumulated
gradient, each optimizer's moments and schedule position, the run's position in the plan, the plan
itself (re-planning could differ: the MILP runs under a time limit), and the RNG state (dropout).

Layout of ``<output_dir>/checkpoints/checkpoint-<total optimizer steps>/``::

    trainer_state.json     position, per-job counters, config and data fingerprint, fingerprinted config, run id
    plan.json              the plan being executed
    lora.safetensors       "param:<name>" and "grad:<name>" of every adapter tensor
    optimizer.pt           per-job AdamW + schedule state (torch.save, loaded with weights_only)
    rng.pt                 torch CPU (and CUDA) generator states
    adapters/<job>/        each adapter in PEFT format, for use without resuming

The folder is written under a temporary name and renamed when complete, so a crash while saving
never leaves a checkpoint that looks complete but is not; an old one is renamed to a hidden name
before it is deleted (:func:`prune_checkpoints`), so a crash while deleting does not either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lorafusion_megatron.adapters_io import save_adapter
from lorafusion_megatron.atomic_dirs import replace_dir, restore_interrupted_replace
from lorafusion_megatron.base_fingerprint import PRESET_WEIGHTS, base_weights_fingerprint
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.planning import plan_from_json
from lorafusion_megatron.run_layout import PIPELINE_SUMMARY, PROFILE_REPORT, SUMMARY, TRAINER_STATE
from lorafusion_megatron.state import InvalidStateError, RunState
from lorafusion_megatron.write_errors import CannotWriteError, clear_write_errors

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_megatron.optim import AdapterOptimizer
    from lorafusion_sched.models import Plan

__all__ = [
    "LoadedCheckpoint",
    "RunFingerprint",
    "check_resume_config",
    "checkpoint_run_id",
    "checkpoint_to_resume",
    "config_match",
    "config_refusal",
    "damaged_message",
    "latest_checkpoint",
    "load_checkpoint",
    "load_torch_file",
    "prune_checkpoints",
    "read_checkpoint_file",
    "read_checkpoint_meta",
    "read_checkpoint_plan",
    "recover_interrupted_writes",
    "run_fingerprint",
    "save_checkpoint",
]

_NAME = re.compile(r"^checkpoint-(\d+)$")
_FORMAT = 1
_DELETING = ".deleting"
"""Suffix of the hidden name an old checkpoint is renamed to before it is deleted: ``.checkpoint-<n>.deleting``."""
_T = TypeVar("_T")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What a resume starts from (weights, gradients and optimizer states are already restored).

    Attributes:
        path: The checkpoint folder.
        state: The run's position and counters.
        plan: The plan being executed.
        run_id: The id the run drew when it started afresh (:func:`checkpoint_run_id`).
    """

    path: Path
    state: RunState
    plan: Plan
    run_id: str


@dataclass(frozen=True)
class RunFingerprint:
    """What a checkpoint must match to be resumed, and what it records to say why it does not.

    Attributes:
        value: ``<config fingerprint>/<data fingerprint>`` (16 hex digits each): the hash of
            ``config`` and the hash of every job's tokenized training samples.
        config: The config's data that ``value``'s first part hashes
            (:func:`~lorafusion_megatron.config.fingerprinted_config`); a checkpoint stores it, so a
            resume with another config can be told which keys changed.
        data_by_job: Per job, the hash of its training samples (empty where the data was not read).
        base_weights: The hash of the base model's weight files, or how a preset's are drawn
            (:func:`~lorafusion_megatron.base_fingerprint.base_weights_fingerprint`).
    """

    value: str
    config: Mapping[str, Any]
    data_by_job: Mapping[str, str] = field(default_factory=dict)
    """Per job, the hash of its training samples (so a refusal can name the jobs whose data changed)."""
    base_weights: str | None = None

    def to_meta(self) -> dict[str, Any]:
        """The ``fingerprint``, ``config``, ``data_by_job`` and ``base_weights`` entries of a ``trainer_state.json``."""
        return {
            "fingerprint": self.value,
            "config": dict(self.config),
            "data_by_job": dict(self.data_by_job),
            "base_weights": self.base_weights,
        }


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _NAME.match(child.name)
        if match and (child / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, if any."""
    found = _checkpoints(directory)
    return found[-1][1] if found else None


def checkpoint_to_resume(directory: Path, *, resume: bool, pipeline: bool = False) -> Path | None:
    """The checkpoint a run continues from: the newest one with ``--resume``, ``None`` for a fresh run.

    ``pipeline``: the run is the pipeline runtime's (where there is no checkpoint, a single-process
    run's summary in the folder is named, and the reverse).

    Raises:
        TrainerError: ``--resume`` finds no checkpoint, or a fresh run finds some (it would mix
            with them: the user forgot ``--resume`` or picked an output folder in use).
    """
    found = latest_checkpoint(directory)
    if resume and found is None:
        raise TrainerError(f"--resume: no checkpoint in {directory}{_other_runtime_hint(directory.parent, pipeline)}")
    if not resume and found is not None:
        raise TrainerError(
            f"{directory} holds checkpoints of an earlier run: continue it with --resume, or choose another "
            "output_dir, or delete that folder to start afresh here (--overwrite never deletes checkpoints)"
        )
    return found


def _other_runtime_hint(output_dir: Path, pipeline: bool) -> str:
    """What to do about a ``--resume`` without a checkpoint: the other runtime's run, if its summary is there.

    A run's summary tells which runtime finished it: ``summary.json`` the single process,
    ``pipeline_summary.json`` the pipeline runtime; a finished run is resumed only by its own.
    """
    if not pipeline and (output_dir / PIPELINE_SUMMARY).is_file():
        return (
            f"; {output_dir} holds a pipeline run ({PIPELINE_SUMMARY}): resume it with the parallel flags it ran with "
            "(--pipeline-stages, --data-parallel, --schedule: its parallel settings are in that file)"
        )
    if pipeline and (output_dir / SUMMARY).is_file():
        return f"; {output_dir} holds a single-process run ({SUMMARY}): resume it without pipeline parallelism"
    return "; train without --resume to start afresh"


def recover_interrupted_writes(config: TrainerConfig) -> None:
    """Tidy what a killed run left half-written: checkpoints' staging, replaces cut in two.

    A checkpoint is written as ``.checkpoint-<n>.tmp-*`` and renamed when complete, so such a
    folder that is left is incomplete and never read: it is deleted. A folder replace that a crash
    cut between its two renames (:mod:`lorafusion_megatron.atomic_dirs`, where the file system
    cannot swap folders) is finished, for the checkpoints and the jobs' adapter folders. What a
    deletion of an old checkpoint left is deleted (:func:`_delete_leftovers`). Call it only under
    the run locks (:func:`lorafusion_megatron.run_lock.run_locks`): then no other run is writing there.
    """
    directory = config.checkpoint_dir
    for folder in directory.glob(".checkpoint-*.tmp-*"):
        shutil.rmtree(folder, ignore_errors=True)
    for replaced in directory.glob(".checkpoint-*.replaced"):
        restore_interrupted_replace(directory / replaced.name[1 : -len(".replaced")])
    _delete_leftovers(directory)
    for job in config.jobs:
        restore_interrupted_replace(config.job_output_dir(job))


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints in ``directory``, and what killed deletions left."""
    _delete_leftovers(directory)
    for _, old in _checkpoints(directory)[:-keep]:
        _delete_checkpoint(old)


def _delete_checkpoint(folder: Path) -> None:
    """Delete checkpoint ``folder`` so that it is never half there under its own name.

    Deleting it in place, a kill in the middle left a ``checkpoint-<n>`` holding some of its files:
    without ``trainer_state.json`` it was no checkpoint to a resume, yet never pruned either; with
    it, it looked complete, and a damaged newer checkpoint's message pointed at it. So it is renamed
    to ``.checkpoint-<n>.deleting`` first (one atomic step), which no resume reads and the next
    start or pruning deletes (:func:`_delete_leftovers`).
    """
    doomed = folder.with_name(f".{folder.name}{_DELETING}")
    if doomed.exists():  # an earlier deletion under this name was killed, and not yet tidied
        shutil.rmtree(doomed)
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def _delete_leftovers(directory: Path) -> None:
    """Delete what deletions of old checkpoints that a kill cut short left in ``directory``.

    That is every ``.checkpoint-<n>.deleting`` folder (:func:`_delete_checkpoint`), and each husk an
    earlier version left, which deleted in place: a ``checkpoint-<n>`` folder without
    ``trainer_state.json`` older than the newest complete checkpoint (pruning deletes the oldest and
    keeps the newest). A newer such folder is no pruning's leftover and is left alone: its
    ``trainer_state.json`` may have been moved away by hand, to be restored.
    """
    for folder in directory.glob(f".checkpoint-*{_DELETING}"):
        shutil.rmtree(folder, ignore_errors=True)  # hidden: what is left is never read, and tried again next time
    complete = _checkpoints(directory)
    if not complete:
        return
    for child in directory.iterdir():
        if _is_husk(child, before=complete[-1][0]):
            _log.info(
                "deleting %s: a checkpoint whose deletion a kill cut short (it holds no %s)", child, TRAINER_STATE
            )
            _delete_checkpoint(child)


def _is_husk(folder: Path, *, before: int) -> bool:
    """Whether ``folder`` is a ``checkpoint-<n>`` folder with ``n < before`` and no ``trainer_state.json``."""
    match = _NAME.match(folder.name)
    if match is None or int(match.group(1)) >= before:
        return False
    return folder.is_dir() and not folder.is_symlink() and not (folder / TRAINER_STATE).is_file()


def read_checkpoint_file(checkpoint: Path, name: str, read: Callable[[Path], _T]) -> _T:
    """``read(checkpoint / name)``; a file that cannot be read raises what to do about it.

    Checkpoints are renamed into place only when complete, so a file that is missing, cut short or
    does not parse, or whose content no run writes (``read`` raises :class:`InvalidStateError`), was
    damaged since (a full disk, a copy, a hand edit): the message names it and the checkpoint to
    resume from instead. A file this user may not read, and a plan this version does not read
    (written by another version), are said to be that: deleting would not help.

    Raises:
        TrainerError: Naming the file and the reader's error.
    """
    from pydantic import ValidationError

    try:
        return read(checkpoint / name)
    except PermissionError as exc:
        raise TrainerError(
            f"checkpoint {checkpoint}: {name} cannot be read ({exc.strerror}): fix its permissions"
        ) from None
    except ValidationError as exc:
        if all(e["type"] != "json_invalid" for e in exc.errors()):
            found = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'top level'}: {e['msg']}" for e in exc.errors()[:3])
            raise TrainerError(
                f"checkpoint {checkpoint}: {name} is not a document this version of lorafusion-megatron reads "
                f"({found}); resume with the version that wrote it"
            ) from None
        raise TrainerError(damaged_message(checkpoint, f"{name} cannot be read ({exc.errors()[0]['msg']})")) from None
    except InvalidStateError as exc:
        raise TrainerError(damaged_message(checkpoint, f"{name} holds what no run writes ({exc})")) from None
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # safetensors, pickle, zip, JSON and other OS errors alike: the file is bad
        text = str(exc).strip()
        first = text.splitlines()[0][:200] if text else ""  # a parser's error may quote the whole file
        raise TrainerError(
            damaged_message(checkpoint, f"{name} cannot be read ({type(exc).__name__}: {first})")
        ) from None


def damaged_message(checkpoint: Path, problem: str) -> str:
    """The message for a damaged checkpoint: what is wrong with which file (``problem``), and how to go on."""
    before = [folder for _, folder in _checkpoints(checkpoint.parent) if folder != checkpoint]
    go_on = (
        f"delete that folder, and --resume continues from {before[-1].name}"
        if before
        else "it is the only checkpoint: restore the file, or train without --resume into a new output_dir"
    )
    return f"checkpoint {checkpoint} is damaged: {problem}; {go_on}"


def checkpoint_run_id(checkpoint: Path, meta: Mapping[str, Any] | None = None) -> str:
    """The id of the run that wrote ``checkpoint``, single-process or pipeline.

    A checkpoint of an earlier version holds none: its id is then derived from what every checkpoint
    of one run shares, the fingerprint and the plan, so a run resumed from it and finished keeps one
    id (a random one would differ from the checkpoint's on every ``--resume``, and the finished run
    would be trained again each time).

    Args:
        checkpoint: The checkpoint folder.
        meta: Its ``trainer_state.json``, where read already.

    Raises:
        TrainerError: As :func:`read_checkpoint_file`.
    """
    if meta is None:
        meta = _read_meta(checkpoint)
    run_id = meta.get("run_id")
    if isinstance(run_id, str):
        return run_id
    plan = read_checkpoint_file(checkpoint, "plan.json", _read_text)
    return hashlib.sha256(f"{meta.get('fingerprint')}\n{plan}".encode()).hexdigest()[:32]


def read_checkpoint_plan(checkpoint: Path) -> Plan:
    """The plan of ``checkpoint``.

    Raises:
        TrainerError: As :func:`read_checkpoint_file`.
    """
    return read_checkpoint_file(checkpoint, "plan.json", lambda path: plan_from_json(_read_text(path)))


def read_checkpoint_meta(path: Path, *, fingerprint: RunFingerprint) -> dict[str, Any]:
    """``trainer_state.json`` of checkpoint ``path``, checked to come from a run of this config and data.

    Settings that cannot change what the resume computes may differ
    (:mod:`~lorafusion_megatron.resume_config`), and so may dataset paths whose data hashes the same.

    Raises:
        TrainerError: The file is unreadable, or the checkpoint was written for other data or a
            different config (naming the changed keys when the checkpoint stores its config).
    """
    meta = _read_meta(path)
    stored_data = str(meta.get("fingerprint")).partition("/")[2]
    data_part = fingerprint.value.partition("/")[2]
    match = config_match(meta, fingerprint)
    if match != "other" and stored_data and data_part and stored_data != data_part:
        raise TrainerError(
            f"checkpoint {path} was written for other data: {_jobs_with_other_data(meta, fingerprint)} "
            "other samples than when the run started (other content or tokenizer): restore it, or train "
            "without --resume into a new output_dir"
        )
    if match == "moved" and data_part and not stored_data:
        match = "other"  # a dataset moved, and the checkpoint holds no hash of its content to compare
    if match == "other":
        refusal = config_refusal(
            meta, fingerprint, remedy="restore that config, or train without --resume into a new output_dir"
        )
        raise TrainerError(f"checkpoint {path} was written by a run with {refusal}" + _profile_hint(path))
    _check_base_weights(path, meta, fingerprint)
    return meta


def check_resume_config(path: Path, config: TrainerConfig) -> None:
    """Refuse a single-process resume from checkpoint ``path`` that the config alone decides against.

    Called before the data is tokenised and the base model built (minutes for a large model): a
    changed config, other base weights under the same path, or a pipeline run's checkpoint are
    refused at once, and so is a ``trainer_state.json`` whose position or counters no run writes
    (:func:`_resumed_state`). The data's hash needs the tokenised data, so :func:`load_checkpoint`
    checks that later (and the config again).

    Raises:
        TrainerError: As :func:`read_checkpoint_meta` or :func:`_resumed_state`, or the checkpoint is
            a pipeline run's.
    """
    meta = read_checkpoint_meta(path, fingerprint=run_fingerprint(config, None))
    _refuse_pipeline_checkpoint(path, meta)
    _resumed_state(path, meta, read_checkpoint_plan(path))


def _refuse_pipeline_checkpoint(path: Path, meta: Mapping[str, Any]) -> None:
    """The single-process trainer cannot resume a pipeline run's checkpoint (its tensors are per rank)."""
    from lorafusion_megatron.pipeline.checkpoint import PIPELINE_FORMAT

    if meta.get("format") == PIPELINE_FORMAT:
        raise TrainerError(
            f"checkpoint {path} was written by a pipeline run with parallel settings {meta.get('parallel')}: "
            "resume it with the same --pipeline-stages, --data-parallel and schedule"
        )


def _check_base_weights(path: Path, meta: Mapping[str, Any], fingerprint: RunFingerprint) -> None:
    """Refuse a checkpoint trained on other base weights than this run's (where both record them)."""
    from lorafusion_megatron.pipeline.checkpoint import PIPELINE_FORMAT

    stored = meta.get("base_weights")  # absent from checkpoints of earlier versions
    base = fingerprint.config.get("base_model", {}).get("model_name_or_path")
    if fingerprint.base_weights == PRESET_WEIGHTS:
        if stored != PRESET_WEIGHTS and meta.get("format") != PIPELINE_FORMAT:
            raise TrainerError(
                f"checkpoint {path} was written by an earlier version, whose single-process trainer drew preset "
                f"{base}'s random weights otherwise than this one (now each tensor from its name, as the pipeline "
                "runtime does): it cannot be resumed; train without --resume into a new output_dir"
            )
    elif stored and fingerprint.base_weights and stored != fingerprint.base_weights:
        raise TrainerError(
            f"checkpoint {path} was trained on other base weights: the weight files in {base} are not those "
            "the run started with (another model, revision or fine-tune under the same path): restore them, "
            "or train without --resume into a new output_dir"
        )


def config_match(meta: Mapping[str, Any], fingerprint: RunFingerprint) -> Literal["same", "moved", "other"]:
    """Whether the run that wrote ``meta`` (a checkpoint's state, a finished run's summary) had this config.

    Returns:
        ``same``: the same config, or one that differs only in what cannot change the result
        (:func:`~lorafusion_megatron.resume_config.comparable_config`); ``moved``: the same but for
        dataset paths (the data's hash decides); ``other``.
    """
    from lorafusion_megatron.resume_config import comparable_config

    if str(meta.get("fingerprint")).partition("/")[0] == fingerprint.value.partition("/")[0]:
        return "same"
    stored = meta.get("config")
    if not isinstance(stored, dict):
        return "other"
    if comparable_config(stored) == comparable_config(fingerprint.config):
        return "same"
    if comparable_config(stored, dataset_paths=False) == comparable_config(fingerprint.config, dataset_paths=False):
        return "moved"
    return "other"


def config_refusal(meta: Mapping[str, Any], fingerprint: RunFingerprint, *, remedy: str, finished: bool = False) -> str:
    """``a different config (changed: ...): <remedy>``, ending instead in what to do when a job's length changed.

    Args:
        meta: What the earlier run recorded (with its ``config`` where it stores one).
        fingerprint: This run's.
        remedy: What to do about a change of any other key.
        finished: The earlier run finished: restoring the old length continues nothing.
    """
    from lorafusion_megatron.config_diff import join_changes
    from lorafusion_megatron.resume_config import length_changed, relevant_changes

    stored = meta.get("config")
    lines = relevant_changes(stored, fingerprint.config) if isinstance(stored, dict) else []
    if not isinstance(stored, dict) or not lines:
        return f"a different config (model, jobs, data, scheduler or runtime settings changed): {remedy}"
    changes = f"a different config (changed: {join_changes(lines)})"
    longer = length_changed(stored, fingerprint.config)
    if not longer:
        return f"{changes}: {remedy}"
    names = ", ".join(repr(name) for name in longer)
    return (
        f"{changes}: the length of job {names} (max_steps, num_train_epochs) cannot change on --resume: the "
        "plan and each job's learning-rate warm-up and decay are laid out for the length the run started with, "
        "so the steps taken so far are not those of a run of the new length. Train the new length from the "
        "start, without --resume, into a new output_dir"
        + ("" if finished else "; or restore the old length to continue this run")
    )


def run_fingerprint(config: TrainerConfig, jobs: Mapping[str, JobData] | None) -> RunFingerprint:
    """What a checkpoint of this run records and a resume must match: config, training data, base weights.

    A checkpoint of an older version holds the config's part of the value only, and is checked on
    that part. ``jobs=None`` leaves the data's part empty, so a check compares the config alone
    (before the data is read: the pipeline launcher refuses a mismatching resume before any rank starts).
    """
    from lorafusion_megatron.config import config_fingerprint, fingerprinted_config
    from lorafusion_megatron.data.job_data import data_fingerprint

    data = "" if jobs is None else data_fingerprint(jobs)
    by_job = {} if jobs is None else {name: data_fingerprint({name: job}) for name, job in jobs.items()}
    return RunFingerprint(
        value=f"{config_fingerprint(config)}/{data}",
        config=fingerprinted_config(config),
        data_by_job=by_job,
        base_weights=base_weights_fingerprint(config.base_model.model_name_or_path),
    )


def _jobs_with_other_data(meta: Mapping[str, Any], fingerprint: RunFingerprint) -> str:
    """``"the dataset of job 'a' holds"`` for the jobs whose hashes differ, where both sides record them."""
    stored = meta.get("data_by_job")
    if isinstance(stored, dict) and fingerprint.data_by_job:
        changed = sorted(name for name, digest in fingerprint.data_by_job.items() if stored.get(name) != digest)
        if changed:
            names = ", ".join(repr(name) for name in changed)
            return f"the dataset of job {names} holds" if len(changed) == 1 else f"the datasets of jobs {names} hold"
    return "a dataset of this config holds"


def _profile_hint(checkpoint: Path) -> str:
    """Why an unchanged config may differ: a ``profile.json`` written after the checkpoint (``capacity: auto``)."""
    profile = checkpoint.parent.parent / PROFILE_REPORT
    try:
        newer = profile.stat().st_mtime > (checkpoint / TRAINER_STATE).stat().st_mtime
    except OSError:
        return ""
    if not newer:
        return ""
    return (
        f"; {profile} was written after this checkpoint, and with scheduler.capacity: auto it sets the "
        "run's capacity: give scheduler.capacity the value the checkpoint was written with (e.g. --set "
        "scheduler.capacity=N, N as the change above shows)"
    )


def save_checkpoint(
    directory: Path,
    *,
    state: RunState,
    plan_json: str,
    fingerprint: RunFingerprint,
    run_id: str,
    model: PeftModel,
    adapter_parameters: Mapping[str, Mapping[str, torch.nn.Parameter]],
    optimizers: Mapping[str, AdapterOptimizer],
    keep: int | None,
) -> Path:
    """Write a checkpoint of the run atomically and prune old ones.

    Args:
        directory: The run's checkpoint folder.
        state: Position and counters.
        plan_json: The plan being executed.
        fingerprint: :func:`run_fingerprint` of the run (its config and its data).
        run_id: The run's id (drawn when it started afresh, the same in all its checkpoints).
        model: The PEFT model (for the PEFT-format copies).
        adapter_parameters: Each adapter's trainable tensors by name.
        optimizers: Each adapter's optimizer.
        keep: Keep this many newest checkpoints (``None``: all).

    Returns:
        The checkpoint folder.

    Raises:
        CannotWriteError: A full disk or a read-only file system (a ``TrainerError``): nothing of this
            checkpoint is left, and the message says whether an older one is there to resume from.
    """
    import torch
    from safetensors.torch import save_file

    target = directory / f"checkpoint-{state.total_optimizer_steps}"
    # Staged beside the target, then swapped into place; a failed write leaves no staging folder.
    try:
        with clear_write_errors(target):
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(
                dir=directory, prefix=f".{target.name}.tmp-", ignore_cleanup_errors=True
            ) as tmp:
                staging = Path(tmp) / "checkpoint"
                staging.mkdir()
                tensors: dict[str, torch.Tensor] = {}
                for params in adapter_parameters.values():
                    for name, param in params.items():
                        tensors[f"param:{name}"] = param.detach().cpu().contiguous()
                        if param.grad is not None:
                            tensors[f"grad:{name}"] = param.grad.detach().cpu().contiguous()
                save_file(tensors, staging / "lora.safetensors")
                torch.save({name: opt.state_dict() for name, opt in optimizers.items()}, staging / "optimizer.pt")
                rng = {"torch": torch.get_rng_state()}
                if torch.cuda.is_available():
                    rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
                torch.save(rng, staging / "rng.pt")
                (staging / "plan.json").write_text(plan_json, encoding="utf-8")
                for adapter in adapter_parameters:
                    save_adapter(model, adapter, staging / "adapters" / adapter)
                meta = {"format": _FORMAT, **fingerprint.to_meta(), "state": state.to_json(), "run_id": run_id}
                (staging / TRAINER_STATE).write_text(json.dumps(meta, indent=2, sort_keys=True), "utf-8")
                replace_dir(staging, target)
    except CannotWriteError as failed:  # also one of its adapters' (named by its staging folder: say the checkpoint)
        raise CannotWriteError(target, failed.reason, _after_failed_checkpoint(directory)) from failed
    if keep is not None:
        prune_checkpoints(directory, keep)
    return target


def _after_failed_checkpoint(directory: Path) -> str:
    """What a run whose checkpoint could not be written can do: resume from an older one, or start again."""
    older = latest_checkpoint(directory)
    if older is None:
        return (
            " (nothing of it is left); no earlier checkpoint exists to resume from: free space (or choose a "
            "writable output_dir), then train again"
        )
    return (
        f" (nothing of it is left); the newest complete checkpoint, {older.name}, is intact: free space, "
        "then --resume continues from it"
    )


def load_checkpoint(
    path: Path,
    *,
    fingerprint: RunFingerprint,
    adapter_parameters: Mapping[str, Mapping[str, torch.nn.Parameter]],
    optimizers: Mapping[str, AdapterOptimizer],
) -> LoadedCheckpoint:
    """Restore weights, gradients, optimizer states and RNG from a checkpoint.

    Raises:
        TrainerError: The checkpoint was written for a different config, or is unreadable or damaged.
    """
    import torch
    from safetensors.torch import load_file

    meta = read_checkpoint_meta(path, fingerprint=fingerprint)
    _refuse_pipeline_checkpoint(path, meta)
    tensors = read_checkpoint_file(path, "lora.safetensors", load_file)
    states = read_checkpoint_file(path, "optimizer.pt", load_torch_file)
    rng = read_checkpoint_file(path, "rng.pt", load_torch_file)
    plan = read_checkpoint_plan(path)
    state = _resumed_state(path, meta, plan)
    with torch.no_grad():
        for params in adapter_parameters.values():
            for name, param in params.items():
                param.copy_(tensors[f"param:{name}"])
                grad = tensors.get(f"grad:{name}")
                param.grad = None if grad is None else grad.to(param.device, param.dtype)
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(states[name])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    return LoadedCheckpoint(path=path, state=state, plan=plan, run_id=checkpoint_run_id(path, meta))


def _resumed_state(checkpoint: Path, meta: Mapping[str, Any], plan: Plan) -> RunState:
    """The position and counters a single-process checkpoint's ``meta`` holds, checked against its ``plan``.

    A hand-edited ``trainer_state.json`` that is still valid JSON was trusted: a position past the
    plan's end wrote the checkpoint's weights as the finished adapters, and counters of jobs the
    plan lacks, or more steps than a job has, failed with a traceback deep in the run.

    Raises:
        TrainerError: Naming the file, the entry and what is wrong with it, and the checkpoint to
            resume from instead (as for a file that cannot be read).
    """
    try:
        state = RunState.from_json(meta.get("state"))
        _check_against_plan(state, plan)
    except InvalidStateError as exc:
        raise TrainerError(damaged_message(checkpoint, f"{TRAINER_STATE} holds what no run writes ({exc})")) from None
    return state


def _check_against_plan(state: RunState, plan: Plan) -> None:
    """Refuse a state that executing ``plan`` up to ``state.position`` does not reach.

    A checkpoint is written after a microbatch and before the plan's end; by then each job has
    taken exactly the steps that the plan's microbatches before the position take.

    Raises:
        InvalidStateError: Naming the first entry that differs.
    """
    count = len(plan.microbatches)
    if state.position >= count:
        raise InvalidStateError(f"state.position: {state.position} is past the plan's last microbatch, {count - 1}")
    names, planned = sorted(state.jobs), sorted(adapter.name for adapter in plan.adapters)
    if names != planned:
        raise InvalidStateError(f"state.jobs: the counters of jobs {names}, where the plan trains {planned}")
    taken = Counter(name for microbatch in plan.microbatches[: state.position] for name in microbatch.step_after)
    for adapter in plan.adapters:
        job, where = state.jobs[adapter.name], f"state.jobs[{adapter.name}]"
        if job.total_steps != adapter.num_global_batches:
            raise InvalidStateError(
                f"{where}.total_steps: {job.total_steps}, where the plan gives the job {adapter.num_global_batches}"
            )
        if job.steps_done != taken[adapter.name]:
            raise InvalidStateError(
                f"{where}.steps_done: {job.steps_done}, where the plan's microbatches before position "
                f"{state.position} take {taken[adapter.name]}"
            )
    if state.total_optimizer_steps != sum(taken.values()):
        raise InvalidStateError(
            f"state.total_optimizer_steps: {state.total_optimizer_steps}, where the jobs' steps add up to "
            f"{sum(taken.values())}"
        )


def _read_meta(checkpoint: Path) -> dict[str, Any]:
    """``trainer_state.json`` of ``checkpoint``: an object with the run's fingerprint, as every checkpoint writes.

    Raises:
        TrainerError: As :func:`read_checkpoint_file` (a list, say, or no ``fingerprint``: a hand edit).
    """
    return read_checkpoint_file(checkpoint, TRAINER_STATE, _read_meta_file)


def _read_meta_file(path: Path) -> dict[str, Any]:
    meta = _read_json(path)
    if not isinstance(meta, dict):
        raise InvalidStateError(f"a {type(meta).__name__} at the top level, not an object")
    if "fingerprint" not in meta:
        raise InvalidStateError("'fingerprint' is missing")
    if not isinstance(meta["fingerprint"], str):
        raise InvalidStateError(f"'fingerprint': {meta['fingerprint']!r} is not a fingerprint (a string)")
    return meta


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _read_json(path: Path) -> Any:
    return json.loads(_read_text(path))


def load_torch_file(path: Path) -> Any:
    """A ``torch.save`` file of tensors and plain containers (``weights_only``: no code runs)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
