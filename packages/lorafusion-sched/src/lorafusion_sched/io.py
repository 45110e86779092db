"""Files: real sample lengths (JSON, JSONL, CSV), jobs files (JSON or YAML) and plan JSON.

A ``.json`` jobs file is read as JSON, any other as YAML in which only ``true`` and ``false`` are
booleans (:mod:`lorafusion_sched.jobs_syntax`); both refuse a key given twice in one mapping.

A jobs file::

    {
        "adapters": [
            {"name": "a", "sample_tokens": [512, 1033], "global_batch_size": 16},
            {"name": "b", "lengths_file": "b.jsonl", "global_batch_size": 8},
        ],
        "options": {"capacity": 4096, "pipeline_stages": 4, "padding_multiple": 64},
    }

An adapter gives either ``sample_tokens`` or ``lengths_file`` (relative to the jobs file), exactly
one of them; ``lengths_field`` picks the field or column when the file has several.
"""

from __future__ import annotations

import csv
import json
import math
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lorafusion_sched.__about__ import __version__
from lorafusion_sched.errors import SchedError
from lorafusion_sched.jobs_syntax import parse_jobs_text
from lorafusion_sched.models import AdapterJob, Plan, PlanOptions, require_model

__all__ = [
    "LENGTH_FIELDS",
    "check_writable",
    "describe_validation_error",
    "load_jobs",
    "load_plan",
    "read_lengths",
    "save_plan",
    "write_atomically",
]

LENGTH_FIELDS = ("tokens", "num_tokens", "length", "len", "n_tokens")
"""Field or column names tried, in order, when a lengths file has objects or several columns."""


def _pick(record: dict[str, Any], field: str | None, where: str) -> Any:
    if field is not None:
        if field not in record:
            raise SchedError(f"{where}: no field {field!r} (fields: {sorted(record)})")
        return record[field]
    for name in LENGTH_FIELDS:
        if name in record:
            return record[name]
    raise SchedError(
        f"{where}: none of the fields {list(LENGTH_FIELDS)}; pass lengths_field (fields: {sorted(record)})"
    )


def _as_length(value: Any, where: str) -> int:
    """``value`` as a token count: a whole number of at least 1, read exactly (no rounding through float)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise SchedError(f"{where}: {value!r} is not a token count")
    number: int | float = value if not isinstance(value, str) else _parse_number(value, where)
    if isinstance(number, float):
        if not math.isfinite(number) or not number.is_integer():
            raise SchedError(f"{where}: {value!r} is not a positive whole token count")
        number = int(number)
    if number < 1:
        raise SchedError(f"{where}: {value!r} is not a positive whole token count")
    return number


def _parse_number(text: str, where: str) -> int | float:
    """A CSV cell or JSON string as an int when it is written as one (exact), else as a float."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise SchedError(f"{where}: {text!r} is not a token count") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv_lengths(path: Path, text: str, field: str | None) -> list[int]:
    """A CSV's lengths, from a header row's one column, ``field`` or a :data:`LENGTH_FIELDS` column.

    A CSV whose first row is all numbers has no header row; it must have a single column.
    """
    rows = [row for row in csv.reader(text.splitlines()) if row]
    if not rows:
        return []
    if all(_is_number(cell) for cell in rows[0]):
        if field is not None or len(rows[0]) != 1:
            raise SchedError(
                f"{path}:1: a CSV without a header row must have one column; add a header row naming "
                f"the columns and pass lengths_field"
            )
        return [_as_length(row[0], f"{path}:{n}") for n, row in enumerate(rows, start=1)]
    header, lengths = rows[0], []
    for n, row in enumerate(rows[1:], start=2):
        where = f"{path}:{n}"
        if len(row) != len(header):
            raise SchedError(f"{where}: {len(row)} cells under a header of {len(header)} columns")
        record = dict(zip(header, row, strict=True))
        single = len(header) == 1 and field is None
        lengths.append(_as_length(row[0] if single else _pick(record, field, where), where))
    return lengths


def _json_item(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SchedError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None


def read_lengths(path: str | Path, field: str | None = None) -> list[int]:
    """Token lengths from a file, in file order.

    Formats (by suffix): ``.json`` (a list of numbers or of objects), ``.jsonl`` (one number or
    object per line), ``.csv`` (a header row, then a single column or the column ``field``; or no
    header row and a single column of numbers). In objects and CSV headers, ``field`` or else the
    first of :data:`LENGTH_FIELDS` is used.

    Raises:
        SchedError: Missing file, unknown suffix, bad JSON, a missing field, or a value that is not
            a positive whole number; the message names the file and line or index.
    """
    path = Path(path)
    _require_file(path, "lengths file")
    suffix = path.suffix.lower()
    text = _read_text(path)
    lengths: list[int] = []
    if suffix == ".json":
        data = _json_item(text, str(path))
        if not isinstance(data, list):
            raise SchedError(f"{path}: expected a JSON list of lengths or of objects")
        for i, item in enumerate(data):
            where = f"{path}[{i}]"
            lengths.append(_as_length(_pick(item, field, where) if isinstance(item, dict) else item, where))
    elif suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                where = f"{path}:{n}"
                item = _json_item(line, where)
                lengths.append(_as_length(_pick(item, field, where) if isinstance(item, dict) else item, where))
    elif suffix == ".csv":
        lengths = _csv_lengths(path, text, field)
    else:
        raise SchedError(f"{path}: unknown suffix {suffix!r}; use .json, .jsonl or .csv")
    if not lengths:
        raise SchedError(f"{path}: no lengths found")
    return lengths


def _require_file(path: Path, what: str) -> None:
    """Raise unless ``path`` is a file: a missing path and a folder get different fixes."""
    if path.is_dir():
        raise SchedError(f"{what} {str(path)!r} is a folder; name a file")
    if not path.is_file():
        raise SchedError(f"{what} {str(path)!r} does not exist")


def _read_text(path: Path) -> str:
    """The file's text as UTF-8; a byte-order mark (as spreadsheets write) is dropped.

    Raises:
        SchedError: The file is not UTF-8 text.
    """
    try:
        return path.read_text("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SchedError(
            f"{path}: not UTF-8 text (byte {err.start} cannot be decoded: {err.reason}); save the file as UTF-8"
        ) from None


def describe_validation_error(err: ValidationError, where: str = "") -> str:
    """One line per error, naming the field and the value.

    Our own validators already write ``<field> = <value>: <fix>``; pydantic's built-in checks get
    ``<field> = <value>: <what is wrong>``. ``where`` (e.g. ``"jobs.yaml: options."``) is prefixed.
    """
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        message = str(e["msg"])
        ours = message.removeprefix("Value error, ")
        if ours != message:
            last = str(e["loc"][-1]) if e["loc"] else ""
            if last and ours.startswith((f"{last} = ", f"{last}[")):  # it names its field: name only the parents
                parents = ".".join(str(x) for x in e["loc"][:-1])
                parts.append(f"{where}{parents}.{ours}" if parents else f"{where}{ours}")
                continue
            place = f"{where}{loc}" if loc else where.rstrip(": .")
            parts.append(f"{place}: {ours}" if place else ours)
            continue
        if e["type"] == "missing":
            parts.append(f"{where}{loc}: missing; this field is required")
            continue
        if e["type"] == "json_invalid":  # its input is the whole document: not shown
            detail = message.removeprefix("Invalid JSON: ")
            parts.append(f"{where.rstrip(': ') or 'input'}: not valid JSON ({detail}); cut short or edited by hand?")
            continue
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict | list | tuple) else type(value).__name__
        if len(shown) > _SHOWN_CHARACTERS:
            shown = shown[: _SHOWN_CHARACTERS - 3] + "..."
        parts.append(f"{where}{loc or '(top level)'} = {shown}: {message}{_hint(e['type'], value)}")
    return "; ".join(parts)


_YAML_11_BOOLEANS = frozenset({"yes", "no", "on", "off", "y", "n"})
"""Words that YAML 1.1 (and so PyYAML) reads as booleans; a jobs file reads them as text."""


def _hint(kind: str, value: object) -> str:
    """What to write instead, for the refusals a jobs file's author meets most (appended to the message)."""
    if kind == "bool_type":
        text = value.lower() if isinstance(value, str) else None
        yaml_11 = " (yes, no, on and off are text in a jobs file, as in JSON)" if text in _YAML_11_BOOLEANS else ""
        return f"; write true or false{yaml_11}"
    if kind == "string_type" and (value is None or isinstance(value, bool | int | float)):
        return f'; in a jobs file, put it in quotes ("{json.dumps(value)}")'
    if kind == "tuple_type" and isinstance(value, int | float):
        return f"; give a list, e.g. [{value}]"
    return ""


_SHOWN_CHARACTERS = 80
"""The most characters of a refused value that an error message shows."""


_ADAPTER_KEYS = frozenset({*AdapterJob.model_fields, "lengths_file", "lengths_field"})
"""The keys of an adapter's entry in a jobs file."""


def load_jobs(path: str | Path) -> tuple[list[AdapterJob], PlanOptions]:
    """Jobs and options from a JSON or YAML jobs file (see the module docstring).

    Raises:
        SchedError: With the field and value at fault, the line of a key given twice, or the
            adapter whose lengths file is missing or bad.
    """
    path = Path(path)
    _require_file(path, "jobs file")
    raw = parse_jobs_text(_read_text(path), path)
    if not isinstance(raw, dict) or "adapters" not in raw:
        raise SchedError(f"{path}: expected a mapping with 'adapters' (a list) and 'options' (a mapping)")
    unknown = sorted(str(key) for key in set(raw) - {"adapters", "options"})
    if unknown:
        raise SchedError(f"{path}: unknown top-level keys {unknown}; a jobs file has only 'adapters' and 'options'")
    # A key of an adapter's entry under options (such as lengths_field) is named as such before the
    # adapters' lengths files are read without it.
    raw_options = raw.get("options") or {}
    misplaced = sorted(set(raw_options) & _ADAPTER_KEYS) if isinstance(raw_options, dict) else []
    if misplaced:
        raise SchedError(f"{path}: options has {misplaced}, which belong in an adapter's entry under adapters")
    adapters = raw["adapters"]
    if not isinstance(adapters, list) or not adapters:
        raise SchedError(f"{path}: adapters must be a non-empty list")
    jobs = []
    for i, entry in enumerate(adapters):
        if not isinstance(entry, dict):
            raise SchedError(f"{path}: adapters[{i}] must be a mapping")
        entry = dict(entry)
        name = entry.get("name")
        where = f"{path}: adapters[{i}]" + (f" ({name!r})" if isinstance(name, str) else "")
        if "lengths_file" in entry:
            if "sample_tokens" in entry:
                raise SchedError(f"{where} has both sample_tokens and lengths_file; keep one")
            entry["sample_tokens"] = _adapter_lengths(
                path, entry.pop("lengths_file"), entry.pop("lengths_field", None), where
            )
        elif "sample_tokens" not in entry:
            raise SchedError(
                f"{where}: give sample_tokens (the samples' token counts) or lengths_file (a file of them, relative "
                f"to the jobs file)"
            )
        try:
            jobs.append(AdapterJob.model_validate(entry))
        except ValidationError as err:
            raise SchedError(describe_validation_error(err, f"{path}: adapters[{i}].")) from None
    try:
        options = PlanOptions.model_validate(raw_options)
    except ValidationError as err:
        raise SchedError(describe_validation_error(err, f"{path}: options.")) from None
    return jobs, options


def _adapter_lengths(jobs_file: Path, lengths_file: object, field: object, where: str) -> list[int]:
    """An adapter's lengths from its ``lengths_file``, relative to the jobs file's folder.

    Raises:
        SchedError: Naming the adapter (``where``) and, for a missing file, the path it was looked for at.
    """
    given = str(lengths_file)
    resolved = jobs_file.parent / given
    if not resolved.exists():
        raise SchedError(
            f"{where}: lengths_file {given!r} does not exist (looked for {str(resolved.resolve())!r}; a lengths_file "
            f"is relative to the jobs file's folder)"
        )
    try:
        return read_lengths(resolved, None if field is None else str(field))
    except SchedError as err:
        raise SchedError(f"{where}: {err}") from None


def check_writable(path: str | Path) -> Path:
    """``path`` as a file to write: its folder exists and it is not itself a folder.

    Raises:
        SchedError: Naming the path and what to change.
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise SchedError(f"cannot write {str(target)!r}: the folder {str(target.parent)!r} does not exist")
    if target.is_dir():
        raise SchedError(f"cannot write {str(target)!r}: it is a folder; name a file")
    return target


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary)`` on a temporary path beside ``path``, then rename it onto ``path``.

    A reader never sees a half-written file, and a failed write leaves ``path`` as it was; the data
    and the rename are flushed to disk (``fsync``) before it returns. A symbolic link is followed (the
    file it names is replaced; the link stays), and a replaced file keeps its permissions. Threads and
    processes writing the same path each use a temporary of their own; the last rename wins.

    Raises:
        SchedError: See :func:`check_writable`.
    """
    written_path = check_writable(path)
    target = Path(os.path.realpath(written_path))
    temporary = target.with_name(f".{target.stem}.tmp-{os.getpid()}-{threading.get_ident()}{target.suffix}")
    try:
        write(temporary)
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(target.stat().st_mode))
        with temporary.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, target)
        _fsync_folder(target.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return written_path


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the platform allows it."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a folder
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as indented JSON, atomically (:func:`write_atomically`).

    Raises:
        TypeError: ``plan`` is not a :class:`Plan` (a dict, say: ``Plan.model_validate`` builds one).
    """
    require_model(plan, Plan, "plan")
    write_atomically(path, lambda temporary: temporary.write_text(plan.model_dump_json(indent=1) + "\n", "utf-8"))


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON file.

    Raises:
        SchedError: Missing file or a document that is not a valid plan.
    """
    path = Path(path)
    _require_file(path, "plan file")
    try:
        return Plan.model_validate_json(_read_text(path))
    except ValidationError as err:
        message = describe_validation_error(err, f"{path}: ")
        if any(e["type"] == "extra_forbidden" for e in err.errors()):
            message += (
                f"; a key this version ({__version__}) does not know may come from a newer lorafusion-sched: "
                "read the plan with that version, or plan again with this one"
            )
        raise SchedError(message) from None
