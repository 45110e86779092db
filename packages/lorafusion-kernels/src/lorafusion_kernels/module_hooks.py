"""Whether a PEFT LoRA layer's parts have forward hooks that the fused ops would skip.

PEFT's forward calls the base layer, ``lora_A``, ``lora_B`` and ``lora_dropout`` as modules, so
their hooks run: accelerate's offloading and device alignment, DeepSpeed ZeRO-3's parameter
gathering, activation capture, quantization observers. The fused ops read the weights directly
and call none of them, so a layer whose parts are wrapped keeps PEFT's modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["is_wrapped", "parts_wrapped"]


def is_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks, or a ``forward`` replaced on the instance (accelerate)."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or "forward" in vars(module)


def parts_wrapped(layer: Any, adapters: Iterable[str]) -> bool:
    """Whether the base layer of PEFT layer ``layer``, or a LoRA module of one of ``adapters``, is wrapped."""
    if is_wrapped(layer.get_base_layer()):
        return True
    parts = ((layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]) for name in adapters)
    return any(is_wrapped(part) for group in parts for part in group)
