"""The package's one exception type and its warning category."""

from __future__ import annotations

import sys
import warnings
from typing import Any

__all__ = [
    "MODULE_PATH",
    "LoRAFusionKernelsError",
    "LoRAFusionKernelsWarning",
    "OnceWarnings",
    "ReadOnlyAttributeError",
    "module_path",
    "user_stacklevel",
]

MODULE_PATH = "_lorafusion_path"
"""Attribute that ``patch_peft_model`` sets on each PEFT layer and wrapper: its name in the model."""


def module_path(module: Any) -> str:
    """``module``'s name in its model, for error messages (its class name if it was not patched)."""
    return str(getattr(module, MODULE_PATH, type(module).__name__))


class LoRAFusionKernelsError(ValueError):
    """A mistake the caller can fix: a bad shape, rank, dtype, dropout probability or config file."""


class ReadOnlyAttributeError(LoRAFusionKernelsError, AttributeError):
    """An assignment to a read-only attribute (a field of a built ``MultiLoRABatch``).

    Both the package's error and Python's ``AttributeError``, which a frozen dataclass raises for the
    same mistake, so either ``except`` catches it.
    """


class LoRAFusionKernelsWarning(UserWarning):
    """A fallback was taken (heuristic launch config, PEFT's own path); emitted once per reason."""


_LIBRARIES = frozenset({"lorafusion_kernels", "torch", "peft", "transformers", "accelerate", "contextlib", "functools"})
"""Top-level modules whose frames a warning skips, to point at the line of the user's code that led to it."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for the caller's ``warnings.warn``: the first frame outside :data:`_LIBRARIES`.

    A fallback is found deep in a model's forward (PEFT's layer, torch's module call, a context
    manager's exit); the warning names the user's line that ran it (the last library frame if the
    whole stack is library code).
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame = frame.f_back
        level += 1
    return level


class OnceWarnings:
    """Emits each distinct :class:`LoRAFusionKernelsWarning` message once, until :meth:`clear`.

    The warning names the first line of the user's code on the stack (not the library frame that
    found the fallback), so that ``python -W error`` and warning filters by module work on it.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, message: str) -> None:
        """Warn with ``message`` unless it was emitted already."""
        if message not in self._seen:
            self._seen.add(message)
            warnings.warn(message, LoRAFusionKernelsWarning, stacklevel=user_stacklevel())

    def clear(self) -> None:
        """Let every message be emitted again."""
        self._seen.clear()
