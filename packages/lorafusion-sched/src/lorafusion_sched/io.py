"""Files: real sample lengths (JSON, JSONL, CSV), jobs files (JSON or YAML) and plan JSON.

A jobs file::

    {
        "adapters": [
            {"name": "a", "sample_tokens": [512, 1033], "global_batch_size": 16},
            {"name": "b", "lengths_file": "b.jsonl", "global_batch_size": 8},
        ],
        "options": {"capacity": 4096, "pipeline_stages": 4, "padding_multiple": 64},
    }

``lengths_file`` (relative to the jobs file) replaces ``sample_tokens``; ``lengths_field`` picks the
field or column when the file has several.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lorafusion_sched.errors import SchedError
from lorafusion_sched.models import AdapterJob, Plan, PlanOptions

__all__ = ["LENGTH_FIELDS", "describe_validation_error", "load_jobs", "load_plan", "read_lengths", "save_plan"]

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
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise SchedError(f"{where}: {value!r} is not a token count")
    try:
        number = float(value)
    except ValueError:
        raise SchedError(f"{where}: {value!r} is not a token count") from None
    if number != int(number) or number < 1:
        raise SchedError(f"{where}: {value!r} is not a positive whole token count")
    return int(number)


def read_lengths(path: str | Path, field: str | None = None) -> list[int]:
    """Token lengths from a file, in file order.

    Formats (by suffix): ``.json`` (a list of numbers or of objects), ``.jsonl`` (one number or
    object per line), ``.csv`` (a header row; a single column or the column ``field``). In objects
    and CSV headers, ``field`` or else the first of :data:`LENGTH_FIELDS` is used.

    Raises:
        SchedError: Missing file, unknown suffix, bad JSON, a missing field, or a value that is not
            a positive whole number; the message names the file and line or index.
    """
    path = Path(path)
    if not path.is_file():
        raise SchedError(f"lengths file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    text = path.read_text("utf-8")
    lengths: list[int] = []
    try:
        if suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise SchedError(f"{path}: expected a JSON list of lengths or of objects")
            for i, item in enumerate(data):
                where = f"{path}[{i}]"
                lengths.append(_as_length(_pick(item, field, where) if isinstance(item, dict) else item, where))
        elif suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    item = json.loads(line)
                    where = f"{path}:{n}"
                    lengths.append(_as_length(_pick(item, field, where) if isinstance(item, dict) else item, where))
        elif suffix == ".csv":
            rows = list(csv.DictReader(text.splitlines()))
            columns = list(rows[0]) if rows else []
            single = len(columns) == 1 and field is None
            for n, row in enumerate(rows, start=2):
                where = f"{path}:{n}"
                lengths.append(_as_length(row[columns[0]] if single else _pick(row, field, where), where))
        else:
            raise SchedError(f"{path}: unknown suffix {suffix!r}; use .json, .jsonl or .csv")
    except json.JSONDecodeError as err:
        raise SchedError(f"{path}: invalid JSON ({err})") from None
    if not lengths:
        raise SchedError(f"{path}: no lengths found")
    return lengths


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
            place = f"{where}{loc}" if loc else where.rstrip(". ")
            parts.append(f"{place}: {ours}" if place else ours)
            continue
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict | list | tuple) else type(value).__name__
        parts.append(f"{where}{loc or '(top level)'} = {shown}: {message}")
    return "; ".join(parts)


def load_jobs(path: str | Path) -> tuple[list[AdapterJob], PlanOptions]:
    """Jobs and options from a JSON or YAML jobs file (see the module docstring).

    Raises:
        SchedError: With the field and value at fault.
    """
    path = Path(path)
    if not path.is_file():
        raise SchedError(f"jobs file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text("utf-8"))  # YAML is a superset of JSON
    except yaml.YAMLError as err:
        raise SchedError(f"{path}: cannot parse ({err})") from None
    if not isinstance(raw, dict) or set(raw) - {"adapters", "options"} or "adapters" not in raw:
        raise SchedError(f"{path}: expected a mapping with 'adapters' (a list) and 'options' (a mapping)")
    adapters = raw["adapters"]
    if not isinstance(adapters, list) or not adapters:
        raise SchedError(f"{path}: adapters must be a non-empty list")
    jobs = []
    for i, entry in enumerate(adapters):
        if not isinstance(entry, dict):
            raise SchedError(f"{path}: adapters[{i}] must be a mapping")
        entry = dict(entry)
        if "lengths_file" in entry:
            lengths_file = path.parent / str(entry.pop("lengths_file"))
            entry["sample_tokens"] = read_lengths(lengths_file, entry.pop("lengths_field", None))
        try:
            jobs.append(AdapterJob.model_validate(entry))
        except ValidationError as err:
            raise SchedError(describe_validation_error(err, f"{path}: adapters[{i}].")) from None
    try:
        options = PlanOptions.model_validate(raw.get("options") or {})
    except ValidationError as err:
        raise SchedError(describe_validation_error(err, f"{path}: options.")) from None
    return jobs, options


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as indented JSON, atomically: a temporary file in the same folder, then a rename."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(plan.model_dump_json(indent=1) + "\n", "utf-8")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON file.

    Raises:
        SchedError: Missing file or a document that is not a valid plan.
    """
    path = Path(path)
    if not path.is_file():
        raise SchedError(f"plan file {str(path)!r} does not exist")
    try:
        return Plan.model_validate_json(path.read_text("utf-8"))
    except ValidationError as err:
        raise SchedError(describe_validation_error(err, f"{path}: ")) from None
