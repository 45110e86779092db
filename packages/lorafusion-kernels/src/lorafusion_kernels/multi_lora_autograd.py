"""FusedMultiLoRA's autograd: the Function of eager calls and the custom ops ``torch.compile`` sees.

Both run :func:`~lorafusion_kernels.multi_lora_core.forward_core` and
:func:`~lorafusion_kernels.multi_lora_core.backward_core` and save ``x``, ``S`` and the seed only
(the dropout mask is drawn again in the backward). The custom ops
``lorafusion::fused_multi_lora_forward``/``fused_multi_lora_backward`` take the batch as its segment
lists, which Dynamo can guard on; the Function takes the :class:`MultiLoRABatch` itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable

from lorafusion_kernels._kernels._common import rank_block, unaliased
from lorafusion_kernels._kernels.multi_lora_bwd import member_grads
from lorafusion_kernels.first_order import first_order_only
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora_core import backward_core, forward_core, side_by_side
from lorafusion_kernels.multi_lora_params import AdapterParams, seed_for

__all__ = [
    "FusedMultiLoRAFunction",
    "autograd_backward",
    "batch_of_segments",
    "compiled_forward",
    "save_for_backward",
]


def compiled_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    batch: MultiLoRABatch,
    params: AdapterParams,
    seed: int | None,
    deterministic: bool,
) -> torch.Tensor:
    """The Triton path as ``torch.compile`` sees it: the ``lorafusion::fused_multi_lora_forward`` custom op.

    The batch reaches the op as its host segment lists, which Dynamo guards on (a batch with other
    segments recompiles once, then Dynamo makes the lengths dynamic); the op looks the batch's
    device tables up by those lists, built once per distinct batch.
    """
    # Without dropout the seed is never read: a traced zeros op, not the cached tensor of `device_params`.
    no_seed = not params.has_dropout
    seed_t = torch.zeros(1, dtype=torch.int64, device=x.device) if no_seed else seed_for(seed, x.device)
    y, _ = torch.ops.lorafusion.fused_multi_lora_forward(
        x,
        weight,
        bias,
        a_cat,
        b_cat,
        seed_t,
        list(batch.segment_lengths),
        list(batch.segment_adapters),
        batch.num_adapters,
        list(params.ranks),
        list(params.scaling),
        list(params.dropout_p),
        list(params.members),
        deterministic,
    )
    return cast(torch.Tensor, y)


@functools.lru_cache(maxsize=64)
def batch_of_segments(
    segment_lengths: tuple[int, ...], segment_adapters: tuple[int, ...], num_adapters: int, device: torch.device
) -> MultiLoRABatch:
    """The batch a custom-op call describes by its segment lists; cached, so every layer reuses its tables."""
    return MultiLoRABatch(segment_lengths, segment_adapters, num_adapters, device)


def _op_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lorafusion::fused_multi_lora_forward``: :func:`forward_core` with the batch given as its segment lists.

    ``deterministic`` is read by the backward only (its autograd context keeps it).
    """
    batch = batch_of_segments(tuple(segment_lengths), tuple(segment_adapters), num_adapters, x.device)
    params = AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p), tuple(members))
    return forward_core(x, weight, bias, a_cat, b_cat, seed, batch, params)


def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lorafusion::fused_multi_lora_backward``: :func:`backward_core` with the batch given as its segment lists.

    Its outputs may not share storage, so dA comes out :func:`unaliased` from dB.
    """
    batch = batch_of_segments(tuple(segment_lengths), tuple(segment_adapters), num_adapters, x.device)
    params = AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p), tuple(members))
    dx, da, db = backward_core(dy, x, weight, a_cat, b_cat, s, seed, batch, params, need_dx, need_da, deterministic)
    return dx, unaliased(da, db), db


_SEGMENTS_SCHEMA = (
    "int[] segment_lengths, int[] segment_adapters, int num_adapters, int[] ranks, float[] scaling, float[] dropout_p, "
    "int[] members"
)

_multi_forward_op = torch.library.custom_op(
    "lorafusion::fused_multi_lora_forward",
    _op_forward,
    mutates_args=(),
    schema=f"(Tensor x, Tensor weight, Tensor? bias, Tensor a_cat, Tensor b_cat, Tensor seed, {_SEGMENTS_SCHEMA}, "
    "bool deterministic) -> (Tensor, Tensor)",
)


@_multi_forward_op.register_fake
def _op_forward_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    block_r = rank_block(max(1, len(members)) * max(1, *ranks))
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((x.shape[0], block_r))


_multi_backward_op = torch.library.custom_op(
    "lorafusion::fused_multi_lora_backward",
    _op_backward,
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor weight, Tensor a_cat, Tensor b_cat, Tensor s, Tensor seed, "
    f"{_SEGMENTS_SCHEMA}, bool need_dx, bool need_da, bool deterministic) -> (Tensor, Tensor, Tensor)",
)


@_multi_backward_op.register_fake
def _op_backward_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = dy.new_empty((dy.shape[0], weight.shape[1])) if need_dx else dy.new_empty(0)
    da = torch.empty_like(a_cat) if need_da else x.new_empty(0)
    return dx, da, torch.empty_like(b_cat)


def save_for_backward(
    ctx: Any,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor],
    s: torch.Tensor,
    segments: tuple[tuple[int, ...], tuple[int, ...], int],
    params: AdapterParams,
    deterministic: bool,
) -> None:
    """Saves ``x``, ``S`` and the seed (no mask, no ``x_hat``).

    Args:
        ctx: The autograd context.
        inputs: ``(x, W, bias, A_cat, B_cat, seed)``.
        s: ``S [T, BLOCK_R]`` from the forward.
        segments: ``(segment_lengths, segment_adapters, num_adapters)`` of the batch.
        params: Per-adapter ranks, scaling and p.
        deterministic: Whether the backward avoids atomics.
    """
    x, weight, bias, a_cat, b_cat, seed = inputs
    ctx.save_for_backward(x, weight, a_cat, b_cat, s, seed)
    ctx.segments = segments
    ctx.params = params
    ctx.deterministic = deterministic
    ctx.has_bias = bias is not None


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``setup_context`` of ``lorafusion::fused_multi_lora_forward`` (inputs in its schema's order).

    It also runs on fake tensors while AOTAutograd traces, so it builds no batch (no device tables).
    """
    x, weight, bias, a_cat, b_cat, seed, lengths, adapters, num_adapters, *per_adapter, det = inputs
    segments = (tuple(lengths), tuple(adapters), num_adapters)
    params = AdapterParams(*(tuple(values) for values in per_adapter))
    save_for_backward(ctx, (x, weight, bias, a_cat, b_cat, seed), output[1], segments, params, det)


def autograd_backward(
    ctx: Any, dy: torch.Tensor | tuple[torch.Tensor, ...], *_unused: Any, opaque: bool = True
) -> tuple[torch.Tensor | None, ...]:
    """Shared backward; ``opaque`` routes through the custom op (always, when AOTAutograd traces it).

    ``dy`` is ``[T, N]``, or (eager sibling calls, not opaque) the members' gradients ``[T, N_g]``.
    """
    x, weight, a_cat, b_cat, s, seed = ctx.saved_tensors
    params: AdapterParams = ctx.params
    need_dx, need_da = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[3])
    if opaque:
        assert isinstance(dy, torch.Tensor)
        lengths, adapters, num_adapters = ctx.segments
        dx, da, db = torch.ops.lorafusion.fused_multi_lora_backward(
            dy,
            x,
            weight,
            a_cat,
            b_cat,
            s,
            seed,
            list(lengths),
            list(adapters),
            num_adapters,
            list(params.ranks),
            list(params.scaling),
            list(params.dropout_p),
            list(params.members),
            need_dx,
            need_da,
            ctx.deterministic,
        )
    else:
        dx, da, db = backward_core(
            dy, x, weight, a_cat, b_cat, s, seed, ctx.batch, params, need_dx, need_da, ctx.deterministic
        )
    full = side_by_side(member_grads(dy)) if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None
    dw = full.t().mm(x) if full is not None and ctx.needs_input_grad[1] else None
    dbias = (
        full.sum(dim=0, dtype=torch.float32).to(full.dtype)
        if full is not None and ctx.has_bias and ctx.needs_input_grad[2]
        else None
    )
    grads = (dx if need_dx else None, dw, dbias, da if need_da else None, db if ctx.needs_input_grad[4] else None)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


class FusedMultiLoRAFunction(torch.autograd.Function):
    """Autograd of the Triton path for eager calls; saves ``x``, ``S`` and the seed.

    Eager calls use this Function, which takes the :class:`MultiLoRABatch` object itself (no Python
    dispatch of a custom op, no lookup of the batch); under ``torch.compile`` the same forward and
    backward run as the custom ops ``lorafusion::fused_multi_lora_forward`` / ``fused_multi_lora_backward``,
    which take the batch as its segment lists.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_cat: torch.Tensor,
        b_cat: torch.Tensor,
        seed: torch.Tensor,
        batch: MultiLoRABatch,
        params: AdapterParams,
        deterministic: bool,
    ) -> torch.Tensor:
        """``y [T, N]``."""
        y, s = forward_core(x, weight, bias, a_cat, b_cat, seed, batch, params)
        segments = (batch.segment_lengths, batch.segment_adapters, batch.num_adapters)
        save_for_backward(ctx, (x, weight, bias, a_cat, b_cat, seed), s, segments, params, deterministic)
        ctx.batch = batch
        return y

    @staticmethod
    @first_order_only  # the backward is not itself differentiable: create_graph=True raises
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(dx, dW, dbias, dA_cat, dB_cat, None, ...)`` by the chain rule of the module docstring."""
        return autograd_backward(ctx, dy, opaque=False)


# As FusedLoRA's: the guard acts where the custom op's backward runs at backward time (no AOTAutograd).
_multi_forward_op.register_autograd(first_order_only(autograd_backward), setup_context=_setup_context)
