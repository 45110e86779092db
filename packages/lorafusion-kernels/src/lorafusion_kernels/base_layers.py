"""The base layers a PEFT ``lora.Linear`` may wrap that the fused ops take, and their ``[N, K]`` weight.

- ``nn.Linear`` (the class itself: quantized layers subclass it and keep PEFT's path):
  ``y = x W^T + b`` with ``W [N, K]``, its weight as it is.
- transformers' ``Conv1D`` (GPT-2's attention and MLP, which PEFT wraps with ``fan_in_fan_out=True``):
  ``y = x W + b`` with ``W [K, N]``, so the fused ops take the view ``W^T`` (no copy). FusedLoRA's
  kernels read any strides; the multi-adapter op copies such a view to unit K stride per call.
  LoRA's ``A [r, K]`` and ``B [N, r]`` are ``nn.Linear`` weights either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["base_weight", "unsupported_base"]


def _is_conv1d(module: nn.Module) -> bool:
    """Transformers' ``Conv1D``, recognised without importing transformers."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers"


def base_weight(layer: Any) -> torch.Tensor | None:
    """``W [N, K]`` of PEFT layer ``layer``'s base layer, or None when the fused ops cannot take that layer."""
    base: nn.Module = layer.get_base_layer()
    fan_in_fan_out = getattr(layer, "fan_in_fan_out", False)
    if isinstance(base, nn.Linear) and type(base) is nn.Linear and not fan_in_fan_out:  # isinstance: for mypy
        return base.weight
    weight = getattr(base, "weight", None) if _is_conv1d(base) and fan_in_fan_out else None
    return weight.t() if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def unsupported_base(layer: Any) -> str | None:
    """Why the fused ops cannot take ``layer``'s base layer (for a warning), or None when they can."""
    if base_weight(layer) is not None:
        return None
    base = layer.get_base_layer()
    if getattr(layer, "fan_in_fan_out", False) and not _is_conv1d(base):
        return f"fan_in_fan_out=True layers whose base layer is a {type(base).__name__}, not transformers' Conv1D"
    return f"base layers of type {type(base).__name__} (quantized, or another nn.Linear subclass)"
