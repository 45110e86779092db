"""Read a job's raw records from JSONL/JSON, Parquet or a ``datasets`` ``save_to_disk`` folder."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from lorafusion_megatron.errors import TrainerError

__all__ = ["first_record", "read_records", "record_count"]

T = TypeVar("T")
Kind = Literal["jsonl", "parquet", "saved"]


def _read_jsonl(path: Path, *, first_only: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON-lines file or a JSON array; with ``first_only``, only the first is kept (and read)."""
    with path.open(encoding="utf-8-sig") as text:  # a BOM, as some editors write, is not data
        numbered = ((number, line) for number, line in enumerate(text, start=1) if line.strip())
        head = next(numbered, None)
        if head is None:
            return []
        if head[1].lstrip().startswith("["):
            text.seek(0)
            return _read_json_array(path, text.read())[: 1 if first_only else None]
        records = []
        for number, line in itertools.chain([head], numbered):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainerError(f"{path}:{number} is not a JSON object: {exc.msg} (column {exc.colno})") from None
            records.append(_as_record(row, f"{path}:{number}"))
            if first_only:
                break
    return records


def _count_jsonl(path: Path) -> int:
    """Records of a JSON-lines file (its non-blank lines, not parsed) or of a JSON array (parsed whole)."""
    with path.open(encoding="utf-8-sig") as text:
        lines = (line for line in text if line.strip())
        head = next(lines, None)
        if head is None:
            return 0
        if head.lstrip().startswith("["):
            text.seek(0)
            return len(_read_json_array(path, text.read()))
        return 1 + sum(1 for _ in lines)


def _read_json_array(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TrainerError(f"{path} is not valid JSON: {exc}") from None
    return [_as_record(row, f"{path} record {i} of {len(data)}") for i, row in enumerate(data, start=1)]


def _as_record(row: Any, where: str) -> dict[str, Any]:
    """``row`` if it is a JSON object; ``where`` names it (``path:line`` in a JSON-lines file)."""
    if not isinstance(row, dict):
        raise TrainerError(f"{where} is {type(row).__name__}, not an object with named fields")
    return row


def _read_parquet(path: Path, *, first_only: bool = False) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        if first_only:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
            return [] if batch is None else list(batch.to_pylist())
        rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise TrainerError(f"{path} is not a readable Parquet file: {exc}") from None
    return rows


def _count_parquet(path: Path) -> int:
    """Rows of a Parquet file, from its footer."""
    import pyarrow.parquet as pq

    try:
        return int(pq.ParquetFile(path).metadata.num_rows)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise TrainerError(f"{path} is not a readable Parquet file: {exc}") from None


def _load_saved(path: Path) -> Any:
    """A ``save_to_disk`` folder, memory-mapped (a ``DatasetDict``: its ``train`` split); None if it holds no data."""
    import datasets  # type: ignore[import-untyped]

    if _saved_without_data(path):
        return None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise TrainerError(f"{path} is not a folder written by datasets' save_to_disk: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise TrainerError(f"{path} holds splits {sorted(loaded)}; point `path` at one split's folder")
        loaded = loaded["train"]
    return loaded


def _read_saved_dataset(path: Path, *, first_only: bool = False) -> list[dict[str, Any]]:
    """A ``save_to_disk`` folder's records (memory-mapped: the first alone reads little)."""
    loaded = _load_saved(path)
    if loaded is None:
        return []
    if first_only:
        return [dict(loaded[0])] if len(loaded) else []
    return [dict(row) for row in loaded]


def _count_saved(path: Path) -> int:
    """Rows of a ``save_to_disk`` folder (memory-mapped, none read)."""
    loaded = _load_saved(path)
    return 0 if loaded is None else len(loaded)


def _saved_without_data(path: Path) -> bool:
    """Whether ``path`` is a saved dataset of no rows (``load_from_disk`` fails on one with an ``IndexError``)."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


_READERS: dict[Kind, Callable[..., list[dict[str, Any]]]] = {
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "saved": _read_saved_dataset,
}
"""Each kind's reader (each takes ``first_only=``)."""

_COUNTERS: dict[Kind, Callable[[Path], int]] = {"jsonl": _count_jsonl, "parquet": _count_parquet, "saved": _count_saved}
"""Each kind's record count, reading as little as the kind allows."""


def _kind(path: Path, key: str) -> Kind:
    """What kind of dataset ``path`` is."""
    if not path.exists():
        raise TrainerError(f"dataset {path} does not exist: fix `{key}` (relative paths start at the config)")
    if path.is_dir():
        return "saved"
    if path.suffix in {".jsonl", ".json"}:
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise TrainerError(
        f"dataset {path}: unknown kind {path.suffix!r}; use .jsonl, .json, .parquet or a save_to_disk folder"
    )


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
    records = _read(Path(path), key, first_only=False)
    return records[:max_samples] if max_samples is not None else records


def first_record(path: str | Path, *, key: str = "dataset.path") -> dict[str, Any] | None:
    """The first record of a dataset, reading no more of it than its kind needs (``validate``'s field check).

    A JSON-lines file is read to its first object, a Parquet file to its first row, a ``save_to_disk``
    folder is memory-mapped; a JSON array is parsed whole.

    Returns:
        The record, or None when the dataset holds none.

    Raises:
        TrainerError: As :func:`read_records`, for the part read.
    """
    records = _read(Path(path), key, first_only=True)
    return records[0] if records else None


def record_count(path: str | Path, *, key: str = "dataset.path") -> int:
    """How many records a dataset holds (``validate``'s ``val_size`` check), without reading them all.

    A JSON-lines file's non-blank lines are counted (not parsed: training refuses a bad one), a
    Parquet file's footer is read, a ``save_to_disk`` folder is memory-mapped; a JSON array is parsed whole.

    Raises:
        TrainerError: As :func:`read_records`, for the part read.
    """
    path = Path(path)
    counter = _COUNTERS[_kind(path, key)]
    return _guarded(path, lambda: counter(path))


def _read(path: Path, key: str, *, first_only: bool) -> list[dict[str, Any]]:
    reader = _READERS[_kind(path, key)]
    return _guarded(path, lambda: reader(path, first_only=first_only))


def _guarded(path: Path, action: Callable[[], T]) -> T:
    """``action()``, with a file that is not UTF-8 or cannot be read named in a :class:`TrainerError`."""
    try:
        return action()
    except UnicodeDecodeError as exc:
        raise TrainerError(f"dataset {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise TrainerError(f"dataset {path} cannot be read: {exc.strerror or exc}") from None
