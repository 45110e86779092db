"""Checks of a config against the file system, without torch (``lorafusion-megatron validate``).

The pydantic models check each value on its own; these checks look at what the values point to:
the model folder, the datasets (readable, with the config's fields, a chat template for chats,
enough samples for ``val_size``), the target modules of known architectures, the output folders.
Training runs the same checks again, more thoroughly, once the model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafusion_megatron.adapters_io import holds_other_files
from lorafusion_megatron.config import DatasetConfig, TrainerConfig
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.presets import LORA_TARGETS, PRESETS

__all__ = ["capacity_past_context", "check_config", "model_type"]

_DATASET_SUFFIXES = {".jsonl", ".json", ".parquet"}


def model_type(config: TrainerConfig) -> str | None:
    """The base model's ``model_type`` (``llama``, ``qwen2``, ...), if it can be read."""
    value = (_model_config(config) or {}).get("model_type")
    return value if isinstance(value, str) else None


def _model_config(config: TrainerConfig) -> dict[str, object] | None:
    """The base model's config as a dict (a preset's, or its ``config.json``), if it can be read."""
    preset = PRESETS.get(config.base_model.model_name_or_path)
    if preset is not None:
        return {"model_type": preset.model_type, **preset.config}
    path = Path(config.base_model.model_name_or_path) / "config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _partition_problem(config: TrainerConfig, stages: int) -> str | None:
    """Why the model cannot be split into ``stages`` stages with ``runtime.activation_checkpointing``, if so.

    Only the partition's own refusals count (more stages than decoder layers, a recomputation count
    a stage cannot hold); a model config it cannot read is left to the run, which names what it lacks.
    """
    from lorafusion_megatron.pipeline.partition import partition_model, recomputed_layers

    setting = config.runtime.activation_checkpointing
    model = _model_config(config)
    if model is None:
        return None
    try:
        if isinstance(setting, list):
            recomputed_layers(model, stages, setting)  # partitions the model first
        elif stages > 1:
            partition_model(model, stages)
    except TrainerError as exc:
        return str(exc)
    except (KeyError, TypeError, ValueError):  # a config the partition cannot read
        pass
    return None


def _writable_ancestor(path: Path) -> bool:
    """Whether ``path`` can be created (or written): a file can be made in its nearest existing folder.

    Tried as ``train`` tries its folders (:func:`~lorafusion_megatron.adapters_io.probe_write`), not
    judged by ``os.access``, which passed folders that ``train`` refused.
    """
    from lorafusion_megatron.adapters_io import probe_write

    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                return False
            try:
                probe_write(candidate)
            except OSError:
                return False
            return True
    return False


def capacity_past_context(config: TrainerConfig, model: Mapping[str, Any] | None = None) -> str | None:
    """Why ``scheduler.capacity`` lets samples run past the base model's context, if it does.

    Each packed sample's positions start at 0, so only a sample longer than the model's
    ``max_position_embeddings`` is affected; but ``capacity`` is what lets one that long through
    (it truncates or drops longer ones), and such a sample trains at positions the model was
    never trained on, without an error. A warning, not a refusal: models whose rotary scaling
    extends the context (``rope_scaling``) may be meant to train past it.

    Args:
        config: The run (its resolved capacity: ``auto`` is the profiled or default one).
        model: The base model's config (default: read as ``validate`` does; ``None`` if it cannot be).
    """
    model = _model_config(config) if model is None else model
    context = None if model is None else model.get("max_position_embeddings")
    capacity = config.scheduler.resolved_capacity
    if not isinstance(context, int) or capacity <= context:
        return None
    return (
        f"scheduler.capacity ({capacity} tokens) exceeds the base model's context (max_position_embeddings: "
        f"{context}): a sample longer than {context} tokens trains at positions the model never saw, with no "
        f"error; set scheduler.capacity to {context} or less to have scheduler.long_samples cut or drop such samples"
    )


def _dataset_problem(
    config: TrainerConfig, dataset: DatasetConfig, path: Path, *, val_size: float | None
) -> str | None:
    """Why a dataset file or folder cannot train, judged without tokenizing it.

    Unreadable, empty or without the config's fields (training's own rule, ``record_layout``, on the
    first record; training reads them all); chats for a tokenizer without a chat template; and a
    ``val_size`` (the job's, for its ``dataset``) that leaves no sample to train on.
    """
    from lorafusion_megatron.data.chat import no_chat_template_message
    from lorafusion_megatron.data.records import first_record, record_count
    from lorafusion_megatron.data.samples import record_layout
    from lorafusion_megatron.data.tokenizer import declares_chat_template, tokenizer_folder

    try:
        first = first_record(path)
        if first is None:
            return f"dataset {path} has no records"
        layout = record_layout(
            first,
            prompt_field=dataset.prompt_field,
            response_field=dataset.response_field,
            text_field=dataset.text_field,
            messages_field=dataset.messages_field,
            source=str(path),
        )
        tokenizer = tokenizer_folder(config.base_model)
        # A missing tokenizer folder is a problem of its own (named by the caller), not of the dataset.
        known_tokenizer = tokenizer is None or Path(tokenizer).is_dir()
        if layout == "chat" and known_tokenizer and not declares_chat_template(tokenizer):
            return no_chat_template_message(str(path), tokenizer or "a byte-level tokenizer")
        if val_size is not None:
            records = record_count(path)
            if dataset.max_samples is not None and dataset.max_samples < records:
                return _held_out_problem(dataset.max_samples, val_size, f"{path} (max_samples: {dataset.max_samples})")
            return _held_out_problem(records, val_size, str(path))
    except TrainerError as exc:
        return str(exc)
    return None


def _held_out_problem(num_samples: int, val_size: float, source: str) -> str | None:
    """Why ``val_size`` leaves none of ``num_samples`` samples to train on (training's own rule), if it does."""
    from lorafusion_megatron.data.eval_split import held_out_count

    try:
        held_out_count(num_samples, val_size, source=source)
    except TrainerError as exc:
        return str(exc)
    return None


def _problems(config: TrainerConfig, pipeline_stages: int) -> list[str]:
    problems = []
    model = config.base_model
    if not model.is_preset and not (Path(model.model_name_or_path) / "config.json").is_file():
        problems.append(
            f"base_model.model_name_or_path: {model.model_name_or_path} is neither a preset "
            f"({', '.join(PRESETS)}) nor a folder with a config.json"
        )
    if model.tokenizer_name_or_path is not None and not Path(model.tokenizer_name_or_path).is_dir():
        problems.append(f"base_model.tokenizer_name_or_path: folder {model.tokenizer_name_or_path} does not exist")
    known = LORA_TARGETS.get(model_type(config) or "")
    for index, job in enumerate(config.jobs):
        where = f"jobs.{index} ({job.name})"
        for key, dataset in (("dataset", job.dataset), ("eval_dataset", job.eval_dataset)):
            path = None if dataset is None else dataset.path
            if path is None:
                continue
            if not Path(path).exists():
                problems.append(f"{where}.{key}.path: {path} does not exist")
            elif Path(path).is_file() and Path(path).suffix not in _DATASET_SUFFIXES:
                problems.append(f"{where}.{key}.path: {path} is not .jsonl, .json, .parquet or a save_to_disk folder")
            elif dataset is not None:
                val_size = job.val_size if key == "dataset" else None
                problem = _dataset_problem(config, dataset, Path(path), val_size=val_size)
                if problem is not None:
                    problems.append(f"{where}.{key}: {problem}")
        if job.val_size is not None and job.dataset.synthetic is not None:
            source = f"synthetic {job.dataset.synthetic} (num_samples: {job.dataset.num_samples})"
            held_out = _held_out_problem(job.dataset.num_samples, job.val_size, source)
            if held_out is not None:
                problems.append(f"{where}.val_size: {held_out}")
        if known is not None and isinstance(job.target_modules, list):
            unknown = sorted(set(job.target_modules) - set(known))
            if unknown:
                problems.append(
                    f"{where}.target_modules: {unknown} are not linear layers of this model; it has {list(known)}"
                )
        folder = config.job_output_dir(job)
        if folder.exists() and not folder.is_dir():
            problems.append(f"{where}.output_dir: {folder} is a file; the job writes an adapter folder there")
        elif holds_other_files(folder):
            problems.append(
                f"{where}.output_dir: {folder} holds files that are not a PEFT adapter (no adapter_config.json); "
                "the run replaces the job's folder whole, so it never writes there: give the job an empty or new "
                "output_dir"
            )
        elif not _writable_ancestor(folder):
            problems.append(f"{where}.output_dir: {folder} cannot be created or written")
    for key, name in (("output_dir", config.output_dir), ("logging.tensorboard_dir", config.logging.tensorboard_dir)):
        if name is not None and Path(name).is_file():
            problems.append(f"{key}: {name} is a file: name a folder")
        elif name is not None and not _writable_ancestor(Path(name)):
            problems.append(f"{key}: {name} cannot be created or written")
    partition = _partition_problem(config, pipeline_stages)
    if partition is not None:
        problems.append(partition)
    return problems


def check_config(config: TrainerConfig, *, source: str = "config", pipeline_stages: int | None = None) -> None:
    """Check what the config points to.

    Args:
        config: The run.
        source: How the messages name the config (its file).
        pipeline_stages: The stages the run will use (a command-line flag may override the config's
            ``parallel.pipeline_stages``, which ``None`` takes).

    Raises:
        TrainerError: Listing every problem, each naming its key.
    """
    stages = config.parallel.pipeline_stages if pipeline_stages is None else pipeline_stages
    problems = _problems(config, stages)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise TrainerError(f"{source} has {len(problems)} problem(s):\n{lines}")
