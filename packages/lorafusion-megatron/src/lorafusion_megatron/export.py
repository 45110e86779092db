"""``lorafusion-megatron export``: merge a trained adapter into its base model's weights.

The trainer keeps PEFT's own module layout (separate ``q_proj``/``k_proj``/``v_proj`` adapters, no
fused-QKV parameterisation), so its adapters already load with ``PeftModel.from_pretrained`` and
need no renaming; merging gives a plain transformers checkpoint for tools that know no LoRA.

Every export writes :data:`MANIFEST` beside the model: the adapter, the base, the dtype and the
files written. ``--overwrite`` replaces only such an earlier export, and only while the folder holds
nothing but the files its manifest lists: never a folder of other files (a project's data, another
model, a home folder), a training run's folder (one holding the run lock file, ``checkpoints/``,
``plan.json``, a summary or ``eval_history.json``, also further down) or a trained adapter
(``adapter_config.json``); checkpoints may be a run's only copy of its training state.
While the merged model is written, ``export`` holds the locks a run would take on the folder
(:func:`~lorafusion_megatron.run_lock.export_locks`): no run starts into it meanwhile, and a run
that holds them refuses the export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from lorafusion_megatron.adapters_io import holds_files
from lorafusion_megatron.atomic_dirs import replace_dir, restore_interrupted_replace
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.model import quiet_peft_deprecations
from lorafusion_megatron.presets import PRESETS
from lorafusion_megatron.run_layout import CHECKPOINTS, EVAL_HISTORY, LOCK_FILE, PIPELINE_SUMMARY, PLAN, SUMMARY
from lorafusion_megatron.run_lock import export_locks
from lorafusion_megatron.write_errors import clear_write_errors

__all__ = ["MANIFEST", "merge_adapter"]

MANIFEST = "lorafusion-export.json"
"""What an export writes beside the merged model: ``adapter``, ``base``, ``dtype`` and ``files``
(the other files written, relative to the folder, sorted)."""

_SHOWN = 3
"""Unlisted files an error message names."""

_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _read_adapter_config(adapter: Path) -> dict[str, object]:
    """``adapter_config.json`` of ``adapter``, checked to be there with its weights file.

    Raises:
        TrainerError: Either file is missing, or the config is not a JSON object.
    """
    config_file = adapter / "adapter_config.json"
    if not config_file.is_file():
        raise TrainerError(f"{adapter} holds no adapter_config.json: pass a folder written by `train`")
    if not any((adapter / name).is_file() for name in _ADAPTER_WEIGHTS):
        raise TrainerError(
            f"{adapter} holds no adapter weights ({' or '.join(_ADAPTER_WEIGHTS)}): if a run wrote it, "
            "`lorafusion-megatron train CONFIG --resume` writes it again from the run's newest checkpoint; "
            "otherwise pass a folder written by `train`"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainerError(f"{config_file} cannot be read ({exc}): the adapter folder is damaged") from None
    if not isinstance(config, dict):
        raise TrainerError(f"{config_file} holds a {type(config).__name__}, not a PEFT adapter config (an object)")
    return config


_RUN_MARKERS = (CHECKPOINTS, SUMMARY, PIPELINE_SUMMARY, PLAN, EVAL_HISTORY, LOCK_FILE)
"""What only a training run's folder holds: ``export`` never replaces a folder that holds one of them."""


def _refuse_run_or_adapter(output: Path, *, own_lock: bool = False) -> None:
    """Refuse an ``output`` that is or holds a training run's folder or a trained adapter, ``--overwrite`` or not.

    Args:
        output: The ``--output`` folder.
        own_lock: The run lock file directly in ``output`` is this export's own (it holds the lock).

    Raises:
        TrainerError: Naming what was found, where, and what to do.
    """
    if not output.is_dir():
        return
    for parent, folders, files in os.walk(output):
        here = Path(parent)
        names = set(folders) | set(files)
        if own_lock and here == output:
            names.discard(LOCK_FILE)
        marker = next((name for name in _RUN_MARKERS if name in names), None)
        if marker is not None:
            where = "is a training run's folder" if here == output else f"holds a training run's folder, {here}"
            raise TrainerError(
                f"--output {output} {where} (it holds {marker}); the merged model would replace it, and the "
                "run's checkpoints, plan and summary with it: export never replaces a run's folder, --overwrite "
                "or not; choose another --output (or delete that folder yourself first, if you mean to)"
            )
        if "adapter_config.json" in files:
            where = "is a trained adapter's folder" if here == output else f"holds a trained adapter, {here}"
            raise TrainerError(
                f"--output {output} {where} (adapter_config.json), which the merged model would replace: export "
                "never replaces an adapter, --overwrite or not (--overwrite replaces an earlier merged model); "
                "choose another --output"
            )
        folders.sort()


def _written_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative, ``/``-separated, sorted), but the manifest and a run lock file on top."""
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if not path.is_dir() and path.relative_to(folder).as_posix() not in (MANIFEST, LOCK_FILE)
    )


def _refuse_all_but_an_export(output: Path) -> None:
    """Refuse to replace ``output`` unless it is an earlier export holding only the files its manifest lists.

    Raises:
        TrainerError: No readable manifest, or files the export did not write (naming a few).
    """
    try:
        manifest = json.loads((output / MANIFEST).read_text(encoding="utf-8"))
        listed = set(manifest["files"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise TrainerError(
            f"--output {output} was not written by `lorafusion-megatron export` (it holds no readable {MANIFEST}): "
            "--overwrite replaces only an earlier merged model; choose another --output (an empty or new folder)"
        ) from None
    others = [name for name in _written_files(output) if name not in listed]
    if others:
        shown = ", ".join(others[:_SHOWN]) + (f" and {len(others) - _SHOWN} more" if len(others) > _SHOWN else "")
        raise TrainerError(
            f"--output {output} holds files its earlier export did not write ({shown}), which --overwrite would "
            "delete: move them out of the folder, or choose another --output"
        )


def merge_adapter(
    adapter: Path, output: Path, *, base: str | None = None, dtype: str = "float32", overwrite: bool = False
) -> Path:
    """Load ``base`` + ``adapter``, fold ``B @ A * scaling`` into the base weights, save to ``output``.

    Args:
        adapter: A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        output: Folder for the merged model (and the base's tokenizer files, if any).
        base: Base model folder; default: the adapter's ``base_model_name_or_path``.
        dtype: Dtype to load and save the merged weights in.
        overwrite: Replace an earlier merged model in ``output`` (the new model is written beside
            it, then renamed into place, so ``output`` is never half-written): only a folder that
            an export wrote and that holds nothing else.

    Returns:
        ``output``.

    Raises:
        TrainerError: The adapter or base folder is missing or damaged, the base is a random-weight
            preset or of other shapes than the adapter, ``output`` is a file, (without ``overwrite``)
            a non-empty folder, (with it) a folder an export did not write or that holds files it did
            not write, is or holds the adapter or the base, a training run's folder or a trained
            adapter, or is locked by a run; or ``output`` cannot be written (a full disk, a
            read-only file system: ``CannotWriteError``, nothing half-written left).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with clear_write_errors(output):
        restore_interrupted_replace(output)  # an earlier export cut between its renames: its model is back
    if output.exists() and not output.is_dir():
        raise TrainerError(f"--output {output} is a file: name a folder for the merged model")
    adapter_config = _read_adapter_config(adapter)
    stored_base = adapter_config.get("base_model_name_or_path")
    base = base or (stored_base if isinstance(stored_base, str) else None)
    if not base or base in PRESETS:
        raise TrainerError(
            f"cannot merge into base {base!r}: presets have random weights that are not saved; pass --base FOLDER"
        )
    base_path = Path(base)
    if not (base_path / "config.json").is_file():
        raise TrainerError(f"base model folder {base_path} holds no config.json: pass --base FOLDER")
    for what, folder in (("the adapter", adapter), ("the base model", base_path)):
        if folder.resolve().is_relative_to(output.resolve()):
            raise TrainerError(
                f"--output {output} is or holds {what} ({folder}), which writing the merged model there would "
                "delete: choose another folder"
            )
    _refuse_run_or_adapter(output)  # before the advice to pass --overwrite, which would not help
    if holds_files(output) and not overwrite:
        raise TrainerError(f"--output {output} is not empty: choose another folder, or pass --overwrite to replace it")
    if holds_files(output):
        _refuse_all_but_an_export(output)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    try:
        with quiet_peft_deprecations():
            merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    except RuntimeError as exc:  # torch's load_state_dict: the adapter's shapes are not the base's
        if "size mismatch" not in str(exc):
            raise
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), "")
        raise TrainerError(
            f"adapter {adapter} does not fit base model {base_path} ({detail[:200]}): pass the --base it was trained on"
        ) from None
    with clear_write_errors(output), export_locks(output):
        # Again under the locks: a run may have started into the folder, or written it, since the checks.
        _refuse_run_or_adapter(output, own_lock=True)
        if any(entry.name != LOCK_FILE for entry in output.iterdir()):
            if not overwrite:
                raise TrainerError(f"--output {output} is not empty: choose another folder, or pass --overwrite")
            _refuse_all_but_an_export(output)
        with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.tmp-") as tmp:
            staging = Path(tmp) / "model"
            merged.save_pretrained(staging)
            for name in _TOKENIZER_FILES:
                if (base_path / name).is_file():
                    shutil.copy2(base_path / name, staging / name)
            manifest = {"adapter": str(adapter.resolve()), "base": str(base_path.resolve()), "dtype": dtype}
            (staging / MANIFEST).write_text(
                json.dumps(manifest | {"files": _written_files(staging)}, indent=2, sort_keys=True), encoding="utf-8"
            )
            replace_dir(staging, output)
    return output
