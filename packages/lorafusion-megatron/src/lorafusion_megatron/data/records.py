"""Read a job's raw records from JSONL/JSON, Parquet or a ``datasets`` ``save_to_disk`` folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafusion_megatron.errors import TrainerError

__all__ = ["read_records"]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TrainerError(f"{path} is not valid JSON: {exc}") from None
        return [_as_record(row, path, i) for i, row in enumerate(data)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainerError(f"{path}:{number} is not a JSON object: {exc.msg}") from None
        records.append(_as_record(row, path, number))
    return records


def _as_record(row: Any, path: Path, where: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise TrainerError(f"{path} record {where} is {type(row).__name__}, not an object with named fields")
    return row


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise TrainerError(f"{path} is not a readable Parquet file: {exc}") from None
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _read_saved_dataset(path: Path) -> list[dict[str, Any]]:
    import datasets  # type: ignore[import-untyped]

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise TrainerError(f"{path} is not a folder written by datasets' save_to_disk: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise TrainerError(f"{path} holds splits {sorted(loaded)}; point `path` at one split's folder")
        loaded = loaded["train"]
    return [dict(row) for row in loaded]


def read_records(
    path: str | Path, *, max_samples: int | None = None, key: str = "dataset.path"
) -> list[dict[str, Any]]:
    """Read the records of a dataset file or folder.

    Args:
        path: A ``.jsonl``/``.json`` file (one object per line, or one JSON array), a ``.parquet`` file,
            or a ``save_to_disk`` folder (a ``DatasetDict`` uses its ``train`` split).
        max_samples: Keep only the first this many records.
        key: The config key that named ``path`` (for messages).

    Returns:
        The records as dicts, in file order.

    Raises:
        TrainerError: The path is missing, of an unknown kind, or unreadable.
    """
    path = Path(path)
    if not path.exists():
        raise TrainerError(f"dataset {path} does not exist: fix `{key}` (relative paths start at the config)")
    if path.is_dir():
        records = _read_saved_dataset(path)
    elif path.suffix in {".jsonl", ".json"}:
        records = _read_jsonl(path)
    elif path.suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise TrainerError(
            f"dataset {path}: unknown kind {path.suffix!r}; use .jsonl, .json, .parquet or a save_to_disk folder"
        )
    return records[:max_samples] if max_samples is not None else records
