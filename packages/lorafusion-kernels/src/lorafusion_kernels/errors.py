"""The package's one exception type and its warning category."""

from __future__ import annotations

__all__ = ["LoRAFusionKernelsError", "LoRAFusionKernelsWarning"]


class LoRAFusionKernelsError(ValueError):
    """A mistake the caller can fix: a bad shape, rank, dtype, dropout probability or config file."""


class LoRAFusionKernelsWarning(UserWarning):
    """A fallback was taken (heuristic launch config, PEFT's own path); emitted once per reason."""
