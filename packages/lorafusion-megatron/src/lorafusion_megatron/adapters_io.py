"""Write one job's adapter in PEFT's format, loadable with ``PeftModel.from_pretrained``.

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as PEFT's own
``save_pretrained`` writes them (keys without the adapter name, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.atomic_dirs import replace_dir, replaced_name
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_layout import EVAL_HISTORY, PIPELINE_SUMMARY, SUMMARY
from lorafusion_megatron.write_errors import clear_write_errors

if TYPE_CHECKING:
    from peft import PeftModel

    from lorafusion_megatron.config import TrainerConfig

__all__ = [
    "check_fresh_run",
    "check_run_outputs",
    "check_writable",
    "earlier_runs_adapters",
    "holds_files",
    "holds_other_files",
    "probe_write",
    "replace_adapter",
    "save_adapter",
    "sort_target_modules",
]


def holds_files(folder: Path) -> bool:
    """Whether ``folder`` is a folder with anything in it (what a write there could replace)."""
    return folder.is_dir() and any(folder.iterdir())


def holds_other_files(folder: Path) -> bool:
    """Whether ``folder`` holds files but no PEFT adapter (no ``adapter_config.json``): never replaced."""
    return holds_files(folder) and not (folder / "adapter_config.json").is_file()


def _refuse_other_files(folder: Path, job: str) -> None:
    if folder.exists() and not folder.is_dir():
        raise TrainerError(
            f"{folder}, where job {job} writes its adapter folder, is a file; the run would have to replace it: "
            "give the job an empty or new output_dir"
        )
    if holds_other_files(folder):
        raise TrainerError(
            f"{folder}, where job {job} writes its adapter, holds files that are not a PEFT adapter (no "
            "adapter_config.json); the run replaces that folder whole, so it never writes there: give the job "
            "an empty or new output_dir"
        )


def probe_write(folder: Path) -> None:
    """Create and delete a file in ``folder``, the one test of whether it can be written.

    Tried, as permission bits say nothing of a read-only mount, of ``/proc``, or anything to root.

    Raises:
        OSError: A file cannot be created there.
    """
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
        pass


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and make sure files can be written in it.

    Raises:
        TrainerError: The folder cannot be created or written.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe_write(directory)
    except OSError as exc:
        raise TrainerError(f"{what} {directory} cannot be written ({exc.strerror}): choose another folder") from None


def check_run_outputs(config: TrainerConfig) -> None:
    """Make sure a run can write everything it will: its output folder, each job's, TensorBoard's.

    Raises:
        TrainerError: One of them cannot be created or written (named in the message).
    """
    check_writable(Path(config.output_dir), "output_dir")
    for job in config.jobs:
        check_writable(config.job_output_dir(job).parent, f"output folder of job {job.name}")
    if config.logging.tensorboard_dir is not None:
        check_writable(Path(config.logging.tensorboard_dir), "logging.tensorboard_dir")


def check_fresh_run(config: TrainerConfig, *, resume: bool, overwrite: bool) -> None:
    """Refuse a run whose outputs would replace what they must not.

    Always: a job folder that is a file, or holds files but no PEFT adapter (a dataset, other work),
    which the run would replace whole at its end. A fresh run, unless ``overwrite``: an earlier run's results, its
    ``summary.json`` (``pipeline_summary.json``), ``eval_history.json`` and the jobs' adapter folders.
    A fresh run never replaces checkpoints (:func:`lorafusion_megatron.checkpoint.checkpoint_to_resume`
    refuses them, ``--overwrite`` or not), so where there are some this says both steps at once
    (delete them, then ``--overwrite``): ``--overwrite`` alone would only meet the next refusal.

    Raises:
        TrainerError: Naming the first result found and what to do.
    """
    for job in config.jobs:
        _refuse_other_files(config.job_output_dir(job), job.name)
    if resume or overwrite:
        return
    found = [p for p in (Path(config.output_dir) / n for n in _RESULTS) if p.is_file()]
    # A job folder a crash left aside in the middle of its replace counts (the run restores it first).
    found += [f for f in map(config.job_output_dir, config.jobs) if holds_files(f) or replaced_name(f).is_dir()]
    if not found:
        return
    shown = ", ".join(map(str, found[:_SHOWN_RESULTS])) + (
        f" and {len(found) - _SHOWN_RESULTS} more" if len(found) > _SHOWN_RESULTS else ""
    )
    verb = "holds" if len(found) == 1 else "hold"
    kept = config.checkpoint_dir
    if holds_files(kept):
        raise TrainerError(
            f"{shown} {verb} results of an earlier run, and {kept} its checkpoints, which --overwrite never "
            f"deletes: to train afresh in this folder, delete {kept}, then pass --overwrite to replace the results; "
            "to continue the earlier run (if it did not finish), pass --resume; or choose another output_dir"
        )
    raise TrainerError(
        f"{shown} {verb} results of an earlier run: choose another output_dir, delete them, "
        "or pass --overwrite to replace them"
    )


def earlier_runs_adapters(config: TrainerConfig) -> list[Path]:
    """Adapter folders in ``output_dir/adapters/`` that none of the config's jobs writes: an earlier run's.

    A fresh run with ``--overwrite`` replaces its own jobs' folders only; these stay beside them.
    """
    folder = Path(config.output_dir) / "adapters"
    if not folder.is_dir():
        return []
    ours = {config.job_output_dir(job).resolve() for job in config.jobs}
    return sorted(p for p in folder.iterdir() if (p / "adapter_config.json").is_file() and p.resolve() not in ours)


_RESULTS = (SUMMARY, PIPELINE_SUMMARY, EVAL_HISTORY)
"""A finished run's files in its output folder that a fresh run with ``--overwrite`` replaces."""

_SHOWN_RESULTS = 3
"""An earlier run's results that a refusal names (then how many more)."""


def replace_adapter(source: Path, target: Path, job: str) -> None:
    """:func:`replace_dir` for job ``job``'s adapter: a ``target`` holding anything but an adapter is refused.

    Raises:
        TrainerError: ``target`` holds files but no ``adapter_config.json`` (checked at the start of
            a run too, by :func:`check_fresh_run`).
    """
    _refuse_other_files(target, job)
    replace_dir(source, target)


def save_adapter(model: PeftModel, adapter: str, directory: Path) -> None:
    """Write ``adapter`` of ``model`` to ``directory`` in PEFT format (atomically replaced).

    Args:
        model: The multi-adapter PEFT model.
        adapter: The adapter (job) name.
        directory: Destination folder; its parent is created.

    Raises:
        CannotWriteError: A full disk or a read-only file system (a ``TrainerError`` naming
            ``directory``); an older folder there is kept as it was, and no staging folder is left.
        TrainerError: ``directory`` holds files but no adapter (:func:`replace_adapter`).
    """
    with clear_write_errors(directory):
        _save_adapter(model, adapter, directory)


def _save_adapter(model: PeftModel, adapter: str, directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.tmp-") as tmp:
        # Embeddings are frozen: no need for PEFT's "auto" check, which asks the Hub about the base.
        model.save_pretrained(tmp, selected_adapters=[adapter], save_embedding_layers=False)
        written = Path(tmp) / adapter
        if adapter == "default":
            # PEFT writes the adapter called "default" to the folder itself, any other to a sub-folder.
            written.mkdir()
            for item in Path(tmp).iterdir():
                if item != written:
                    os.replace(item, written / item.name)
        sort_target_modules(written / "adapter_config.json")
        replace_adapter(written, directory, adapter)


def sort_target_modules(config_file: Path) -> None:
    """Rewrite ``config_file`` with ``target_modules`` sorted (and its keys, ending in a newline).

    PEFT keeps them in a set, whose order differs per process, so the same adapter would otherwise
    be written differently by different runs or pipeline ranks.
    """
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
