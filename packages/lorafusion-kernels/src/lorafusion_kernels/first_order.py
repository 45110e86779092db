"""The fused ops' backward is first order only: a backward that would build a graph is refused.

The guard runs where the backward runs when the gradient is asked for: the eager autograd Functions,
and the ``torch.library`` custom ops' registered backward (called directly, or under
``torch.compile(backend="eager")``). AOTAutograd backends (Inductor, ``aot_eager``) trace that
backward ahead of time, without grad mode, so the guard passes then and cannot act later; torch's
compiled function itself refuses a backward through a gradient taken with ``create_graph=True`` (or
that call, where Inductor's backward donates its buffers): docs/kernels/index.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from lorafusion_kernels.errors import LoRAFusionKernelsError

__all__ = ["first_order_only"]

_Backward = TypeVar("_Backward", bound=Callable[..., Any])


def first_order_only(backward: _Backward) -> _Backward:
    """Refuse ``backward`` under grad mode, i.e. ``create_graph=True``.

    ``once_differentiable`` alone raises only when the incoming gradient itself requires grad. In
    a gradient penalty (``grad(y.sum(), x, create_graph=True)`` then a loss of that gradient) it
    does not, and the returned gradient silently lacks its second-order term; so any backward
    that is asked for a graph is refused here. Put it above ``@once_differentiable``.
    """

    @functools.wraps(backward)
    def guarded(ctx: Any, *grads: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise LoRAFusionKernelsError(
                "the fused LoRA ops have no second derivative, so a backward with create_graph=True "
                "(a gradient penalty, double backward) cannot be differentiated: compute it with PEFT's "
                "own layers (unpatch_peft_model) or the plain torch functions of lorafusion_kernels.reference"
            )
        return backward(ctx, *grads)

    return cast(_Backward, guarded)
