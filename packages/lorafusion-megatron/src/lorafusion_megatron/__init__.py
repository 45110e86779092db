"""Multi-job LoRA trainer: several LoRA jobs sharing one base model, on 1..N GPUs.

Importing this package does no work: no CUDA query and no import of torch, megatron-core or
transformers (configs validate without a GPU). The public names below load their modules on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.__about__ import __version__
from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig, load_config
    from lorafusion_megatron.trainer import Trainer, TrainResult

__all__ = ["TrainResult", "Trainer", "TrainerConfig", "TrainerError", "__version__", "load_config"]

_LAZY = {
    "TrainResult": "lorafusion_megatron.trainer",
    "Trainer": "lorafusion_megatron.trainer",
    "TrainerConfig": "lorafusion_megatron.config",
    "load_config": "lorafusion_megatron.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lorafusion_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
