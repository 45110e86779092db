"""``lorafusion-megatron export``: merge a trained adapter into its base model's weights.

The trainer keeps PEFT's own module layout (separate ``q_proj``/``k_proj``/``v_proj`` adapters, no
fused-QKV parameterisation), so its adapters already load with ``PeftModel.from_pretrained`` and
need no renaming; merging gives a plain transformers checkpoint for tools that know no LoRA.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from lorafusion_megatron.adapters_io import holds_files
from lorafusion_megatron.atomic_dirs import replace_dir, restore_interrupted_replace
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.model import quiet_peft_deprecations
from lorafusion_megatron.presets import PRESETS

__all__ = ["merge_adapter"]

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
            f"{adapter} holds no adapter weights ({' or '.join(_ADAPTER_WEIGHTS)}): pass a folder written by "
            "`train`, or copy the weights from the run's latest checkpoint"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainerError(f"{config_file} cannot be read ({exc}): the adapter folder is damaged") from None
    if not isinstance(config, dict):
        raise TrainerError(f"{config_file} holds a {type(config).__name__}, not a PEFT adapter config (an object)")
    return config


def merge_adapter(
    adapter: Path, output: Path, *, base: str | None = None, dtype: str = "float32", overwrite: bool = False
) -> Path:
    """Load ``base`` + ``adapter``, fold ``B @ A * scaling`` into the base weights, save to ``output``.

    Args:
        adapter: A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        output: Folder for the merged model (and the base's tokenizer files, if any).
        base: Base model folder; default: the adapter's ``base_model_name_or_path``.
        dtype: Dtype to load and save the merged weights in.
        overwrite: Replace a non-empty ``output`` (the new model is written beside it, then renamed
            into place, so ``output`` is never half-written).

    Returns:
        ``output``.

    Raises:
        TrainerError: The adapter or base folder is missing or damaged, the base is a random-weight
            preset or of other shapes than the adapter, or ``output`` is a file, (without
            ``overwrite``) a non-empty folder, or is or holds the adapter or the base.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    restore_interrupted_replace(output)  # an earlier export cut between its renames: its model is back
    if output.exists() and not output.is_dir():
        raise TrainerError(f"--output {output} is a file: name a folder for the merged model")
    if holds_files(output) and not overwrite:
        raise TrainerError(f"--output {output} is not empty: choose another folder, or pass --overwrite to replace it")
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
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.tmp-") as tmp:
        staging = Path(tmp) / "model"
        merged.save_pretrained(staging)
        for name in _TOKENIZER_FILES:
            if (base_path / name).is_file():
                shutil.copy2(base_path / name, staging / name)
        replace_dir(staging, output)
    return output
