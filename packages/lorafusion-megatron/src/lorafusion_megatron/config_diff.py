"""What differs between two configs' JSON data, as lines a person can act on.

A refused ``--resume`` names the keys whose values changed since the checkpoint was written:
``scheduler.capacity: 4096 -> 8192``, ``jobs[summarise].r: 16 -> 32``. Jobs are named by their
``name`` rather than their index, so adding or reordering jobs does not blur every later job.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["changed_keys", "join_changes"]

_ABSENT = object()
"""Stands for a key that one side does not have."""


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if isinstance(value, str) and value:
        return value
    return json.dumps(value, sort_keys=True)


def _named_items(value: Any) -> dict[str, Any] | None:
    """``value`` as ``{name: item}`` when it is a list of mappings with distinct text ``name`` keys (jobs)."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        return None
    names = [item.get("name") for item in value]
    if not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
        return None
    return dict(zip(names, value, strict=True))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def changed_keys(old: Any, new: Any, path: str = "") -> list[str]:
    """Every difference between two JSON values, as ``path: old -> new``, in the order of ``new``'s keys.

    Mappings are compared key by key (dotted paths); lists of named mappings item by name
    (``jobs[name]``, with ``added``, ``removed`` and a changed order named as such); any other
    value is compared whole.

    Args:
        old: The earlier data (e.g. stored in a checkpoint).
        new: The current data.
        path: Where ``old`` and ``new`` sit in the whole (empty at the top).

    Returns:
        One line per difference; empty when the two are equal.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*new, *(key for key in old if key not in new)]
        return [
            line
            for key in keys
            for line in changed_keys(old.get(key, _ABSENT), new.get(key, _ABSENT), _join(path, key))
        ]
    old_items, new_items = _named_items(old), _named_items(new)
    if old_items is not None and new_items is not None:
        lines = []
        for name, item in new_items.items():
            where = f"{path}[{name}]"
            lines.extend(changed_keys(old_items[name], item, where) if name in old_items else [f"{where}: added"])
        lines.extend(f"{path}[{name}]: removed" for name in old_items if name not in new_items)
        old_order = [name for name in old_items if name in new_items]
        new_order = [name for name in new_items if name in old_items]
        if old_order != new_order:
            lines.append(f"{path}: order {', '.join(old_order)} -> {', '.join(new_order)}")
        return lines
    if old == new:
        return []
    return [f"{path}: {_show(old)} -> {_show(new)}"]


def join_changes(lines: list[str], *, limit: int = 5) -> str:
    """The first ``limit`` of ``lines`` (as :func:`changed_keys` writes them) joined by ``; ``, then ``and N more``.

    Returns:
        The description; empty when there are no lines.
    """
    shown = "; ".join(lines[:limit])
    rest = len(lines) - limit
    return f"{shown}; and {rest} more" if rest > 0 else shown
