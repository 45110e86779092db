"""A jobs file's text as Python data: a ``.json`` file through ``json``, any other through YAML.

Both readers refuse a key given twice in one mapping and name its lines: ``json`` and PyYAML keep
the last silently, so a second ``options:`` block used to replace the first whole, and the plan was
made for settings nobody wrote. The YAML reader also takes YAML 1.2's booleans and numbers where
PyYAML follows YAML 1.1: only ``true`` and ``false`` are booleans (``yes``, ``no``, ``on`` and
``off`` are text, as in JSON), ``1e3`` is a number, and an integer with a leading zero is decimal
(``global_batch_size: 016`` was octal, 14) while ``1:30`` is text (it was 90, base 60).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from lorafusion_sched.errors import SchedError

__all__ = ["JobsLoader", "parse_jobs_text", "read_yaml_12_scalars"]

_BOOL_TAG = "tag:yaml.org,2002:bool"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _RepeatedKeyError(Exception):
    """A key given twice in one mapping; ``lines`` are the first's and the second's, where known."""

    def __init__(self, key: object, lines: tuple[int, int] | None) -> None:
        super().__init__(key, lines)
        self.key, self.lines = key, lines


class JobsLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans and numbers, refusing a key given twice.

    Under PyYAML's YAML 1.1, ``drop_last: on`` was ``true``, an adapter named ``no`` was refused as
    not a string, and ``1e3`` was a string, so a jobs file written as JSON was refused where a
    lengths file takes the same number.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """PyYAML's mapping, after checking that none of the mapping's own keys is given twice.

        Keys merged in with ``<<: *anchor`` are not the mapping's own: a key beside the merge
        overrides the anchor's, as YAML's merge key specifies.
        """
        first_line: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise _RepeatedKeyError(key, (first_line[key], line))
                first_line[key] = line
            except TypeError:  # an unhashable key: PyYAML's own construct_mapping refuses it
                continue
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2's integer (with PyYAML's underscores): decimal whatever its leading zeros; ``0o``, ``0x``, ``0b``."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    digits = text.lstrip("+-")
    value = int(digits, 0) if digits[:2] in ("0o", "0x", "0b") else int(digits, 10)
    return -value if text.startswith("-") else value


_YAML_12_FLOAT = (
    r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
    r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF))$|^\.(?:nan|NaN|NAN)$"
)
"""YAML 1.2's floats (with PyYAML's underscores): a dot or an exponent, signed or not; infinities, NaN."""


def read_yaml_12_scalars(loader: type[yaml.SafeLoader]) -> None:
    """Make ``loader`` (a ``SafeLoader`` subclass) read plain booleans and numbers as YAML 1.2 does.

    PyYAML follows YAML 1.1, where

    * ``yes``/``no``/``on``/``off`` are booleans (YAML 1.2: only ``true`` and ``false``, in three
      spellings; the others are text);
    * a leading zero makes an integer octal (``016`` was 14) and colons base 60 (``1:30`` was 90):
      YAML 1.2 reads decimal whatever the leading zeros, ``0o``, ``0x`` and ``0b`` give other bases,
      and ``1:30`` is text;
    * a float needs a dot and a signed exponent (``1e3`` and ``1.5e3`` were text).
    """
    replaced = {_BOOL_TAG, _INT_TAG, _FLOAT_TAG}
    loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in replaced]
        for first, resolvers in loader.yaml_implicit_resolvers.items()
    }
    loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    loader.add_implicit_resolver(  # before the floats, which would take a whole number too
        _INT_TAG, re.compile(r"^[-+]?(?:0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+|[0-9][0-9_]*)$"), list("-+0123456789")
    )
    loader.add_constructor(_INT_TAG, _construct_int)
    loader.add_implicit_resolver(_FLOAT_TAG, re.compile(_YAML_12_FLOAT), list("-+0123456789."))


read_yaml_12_scalars(JobsLoader)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: the object as a dict, unless a key is given twice."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _RepeatedKeyError(key, None)
        result[key] = value
    return result


_JSON_TOKEN = re.compile(r'("(?:[^"\\]|\\.)*")\s*:|"(?:[^"\\]|\\.)*"|[{}\[\]]')
"""A key (its string, then ``:``), another string, or a bracket; what lies between is skipped."""


def _repeated_json_key_lines(text: str) -> _RepeatedKeyError | None:
    """The first key given twice in one object of ``text``, with its lines (``json`` gives no positions).

    Called only after ``json`` found a repeated key, so the text is valid JSON up to it: strings are
    matched whole, so a bracket or colon inside one is never taken for structure.
    """
    objects: list[dict[str, int] | None] = []  # per open bracket: an object's keys and their offsets
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in ("{", "["):
            objects.append({} if token == "{" else None)
        elif token in ("}", "]"):
            if objects:
                objects.pop()
        elif match.group(1) is not None and objects and objects[-1] is not None:
            keys, key = objects[-1], json.loads(match.group(1))
            if key in keys:
                first, second = (text.count("\n", 0, offset) + 1 for offset in (keys[key], match.start()))
                return _RepeatedKeyError(key, (first, second))
            keys[key] = match.start()
    return None


def _parse_json(text: str, path: Path) -> object:
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as err:
        raise SchedError(
            f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); cut short or edited by "
            f"hand? (a .json jobs file is read as JSON: no comments, trailing commas or single quotes)"
        ) from None
    except _RepeatedKeyError as err:
        raise (_repeated_json_key_lines(text) or err) from None


def parse_jobs_text(text: str, path: Path) -> object:
    """The data of a jobs file's ``text``: JSON when ``path`` ends in ``.json``, else YAML.

    Raises:
        SchedError: The text does not parse, or a key is given twice in one mapping; the message
            names ``path`` and, for a repeated key, both lines.
    """
    try:
        if path.suffix.lower() == ".json":
            return _parse_json(text, path)
        try:
            return yaml.load(text, Loader=JobsLoader)  # a SafeLoader
        except yaml.YAMLError as err:
            raise SchedError(f"{path}: cannot parse ({err})") from None
    except _RepeatedKeyError as err:
        where, lines = (f"{path}:{err.lines[1]}", f" (first on line {err.lines[0]})") if err.lines else (str(path), "")
        raise SchedError(f"{where}: {err.key!r} is given twice in one mapping{lines}; keep one") from None
