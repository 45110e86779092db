"""Multi-adapter LoRA scheduler: pure Python (pydantic + HiGHS), never torch."""

from __future__ import annotations

from lorafusion_sched.__about__ import __version__

__all__ = ["__version__"]
