"""Launch configs: per-GPU JSON files, lookup with fallbacks, and the ``lorafusion-tune`` sweep."""

from __future__ import annotations

from lorafusion_kernels.tuning.config import (
    ConfigFile,
    KernelConfig,
    KernelTable,
    ShapeKey,
    TunedEntry,
    clear_caches,
    config_dir,
    lookup_config,
    override_configs,
    register_fallback,
    register_heuristic,
)
from lorafusion_kernels.tuning.device import device_name, gpu_key

__all__ = [
    "ConfigFile",
    "KernelConfig",
    "KernelTable",
    "ShapeKey",
    "TunedEntry",
    "clear_caches",
    "config_dir",
    "device_name",
    "gpu_key",
    "lookup_config",
    "override_configs",
    "register_fallback",
    "register_heuristic",
]
