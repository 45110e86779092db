"""``--set KEY=VALUE`` overrides: dotted keys (``jobs.0.r``, ``jobs.copy.r``) set in a parsed config."""

from __future__ import annotations

from typing import Any

from lorafusion_megatron.errors import TrainerError

__all__ = ["set_dotted"]


def set_dotted(data: Any, dotted: str, value: Any, *, source: str) -> None:
    """Set ``dotted`` (e.g. ``jobs.0.r``, or ``jobs.copy.r`` by the job's name) in ``data`` to ``value``.

    Raises:
        TrainerError: A part names no list entry, or lies inside a value that is not a mapping or list.
    """
    if not isinstance(data, dict):
        raise TrainerError(f"{source}: expected a mapping at the top level")
    *parents, last = dotted.split(".")
    node: Any = data
    for depth, part in enumerate([*parents, last]):
        where = ".".join(parents[:depth]) or "the top level"
        if isinstance(node, list):
            key: Any = _list_index(node, part, f"override {dotted}: {where}")
        elif isinstance(node, dict):
            key = part
        else:
            raise TrainerError(
                f"override {dotted}: {where} is {node!r} in {source}, not a mapping or list, so it has no {part!r}"
            )
        if depth == len(parents):
            node[key] = value
        elif isinstance(node, dict):
            node = node.setdefault(key, {})
        else:
            node = node[key]


def _list_index(items: list[Any], part: str, where: str) -> int:
    """The entry of ``items`` that ``part`` names: its index, or its ``name`` (a job's).

    A job named by digits (``"1"``) that is not entry 1 makes ``1`` ambiguous, and is refused.
    """
    if not items:
        raise TrainerError(f"{where} is an empty list: it has no entry {part!r} to set")
    names = {
        item["name"]: i for i, item in enumerate(items) if isinstance(item, dict) and isinstance(item.get("name"), str)
    }
    index = int(part) if part.isascii() and part.isdigit() and int(part) < len(items) else None
    named = names.get(part)
    if index is not None and named is not None and index != named:
        raise TrainerError(f"{where}: {part!r} is both entry {index} and the name of entry {named}; rename that job")
    if index is not None:
        return index
    if named is not None:
        return named
    choices = f" or a name ({', '.join(map(str, names))})" if names else ""
    raise TrainerError(f"{where} has no entry {part!r}: give an index from 0 to {len(items) - 1}{choices}")
