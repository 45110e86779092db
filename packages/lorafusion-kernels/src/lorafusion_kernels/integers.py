"""Whole numbers given by users: Python and NumPy integers and integer 0-d tensors; never a bool or a float."""

from __future__ import annotations

import operator

__all__ = ["integer_or_none"]


def integer_or_none(value: object) -> int | None:
    """``value`` as an int when it is an integer (what ``operator.index`` takes, a bool excepted), else ``None``.

    Callers raise their own error for ``None``, naming the argument: ``4.0``, ``"4"`` and ``True``
    are refused rather than read as 4 or 1.
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
