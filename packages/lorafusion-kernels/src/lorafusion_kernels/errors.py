"""The package's one exception type and its warning category."""

from __future__ import annotations

import warnings

__all__ = ["LoRAFusionKernelsError", "LoRAFusionKernelsWarning", "OnceWarnings"]


class LoRAFusionKernelsError(ValueError):
    """A mistake the caller can fix: a bad shape, rank, dtype, dropout probability or config file."""


class LoRAFusionKernelsWarning(UserWarning):
    """A fallback was taken (heuristic launch config, PEFT's own path); emitted once per reason."""


class OnceWarnings:
    """Emits each distinct :class:`LoRAFusionKernelsWarning` message once, until :meth:`clear`."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, message: str, *, stacklevel: int) -> None:
        """Warn with ``message`` unless it was emitted already; ``stacklevel`` counts from the caller."""
        if message not in self._seen:
            self._seen.add(message)
            warnings.warn(message, LoRAFusionKernelsWarning, stacklevel=stacklevel + 1)

    def clear(self) -> None:
        """Let every message be emitted again."""
        self._seen.clear()
