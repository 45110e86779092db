"""The fused ops inside ``torch.autocast``, computing what ``nn.Linear`` computes there.

Under autocast, ``nn.Linear`` casts its input, weight and bias to autocast's dtype (fp16 or bf16)
and multiplies in that dtype; PEFT's LoRA branch does the same for ``A`` and ``B``. The fused ops
are custom autograd functions, which autocast does not cast, so the PEFT integration and
``FusedLoRALinear`` hand them the operands cast as ``nn.Linear`` would and run them with autocast
off. The adapters stay in their own dtype: the kernels round each tile to the activations' dtype
as they load it, which is the rounding autocast applies, and their gradients come back in the
parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lorafusion_kernels._kernels._common import SUPPORTED_DTYPES

__all__ = ["autocast_dtype", "call_as_linear", "linear_compute_dtype"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype for ``x``'s device where autocast is on there, else None."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def linear_compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype ``nn.Linear`` multiplies ``x`` and ``weight`` in on this call, where the fused ops can too.

    Autocast's dtype where autocast is on (fp16 or bf16; ``x`` and ``weight`` any of fp16, bf16 and
    fp32); otherwise ``x``'s dtype if ``weight`` has it and it is fp16, bf16 or fp32. None otherwise.
    """
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        return None
    dtype = autocast_dtype(x)
    if dtype is not None:
        return dtype if dtype in _HALF_DTYPES else None
    return x.dtype if weight.dtype == x.dtype else None


def call_as_linear(
    op: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    *args: Any,
    bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``op(x, weight, *args, bias=bias, **kwargs)`` with the operands ``nn.Linear`` would use here.

    Outside autocast, as given. Inside, ``x``, ``weight`` and ``bias`` cast to autocast's dtype
    (differentiably: gradients reach them in their own dtypes) and ``op`` run with autocast off.
    Autocast leaves float64 tensors alone, so a float64 operand stays float64 here too (a float64
    layer computes in float64 inside autocast, as ``nn.Linear`` does).
    """
    dtype = autocast_dtype(x)
    if dtype is None:
        return op(x, weight, *args, bias=bias, **kwargs)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float64 else t.to(dtype)

    with torch.autocast(x.device.type, enabled=False):
        return op(cast(x), cast(weight), *args, bias=None if bias is None else cast(bias), **kwargs)
