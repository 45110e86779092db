"""FusedMultiLoRA: one fused LoRA linear for a packed microbatch that mixes several adapters.

The tokens ``x [T, K]`` are consecutive segments; segment ``j`` holds ``segment_lengths[j]`` tokens
of adapter ``a = segment_adapters[j]`` (an adapter may own several segments, some none). With
``W [N, K]`` shared by all adapters and ``A_a [r_a, K]``, ``B_a [N, r_a]``, for a token ``t`` of ``a``::

    x_hat[t] = keep_a(t, :) * x[t] / (1 - p_a)
    y[t]     = x[t] W^T + bias + scaling_a * (x_hat[t] A_a^T) B_a^T

Gradients (``S[t] = x_hat[t] A_a^T``, ``dS[t] = scaling_a * dy[t] B_a``)::

    dB_a  = scaling_a * sum_{t in a} dy[t]^T S[t]        dA_a = sum_{t in a} dS[t]^T x_hat[t]
    dx[t] = dy[t] W + keep_a(t, :) * (dS[t] A_a) / (1 - p_a)    dbias = sum_t dy[t]

The keep mask follows the FusedLoRA rule (``lorafusion_kernels.dropout``) with ``row = t``, the
token's row in the packed batch, and is regenerated in the backward (only ``x``,
``S' = scaling * S`` and the seed are saved). The frozen GEMM is tiled over all ``T`` rows exactly
as the frozen layer; only the rank-r LoRA term is routed per segment. A microbatch whose tokens all
belong to one adapter takes the FusedLoRA path.

The module also holds the runtime hook :func:`multi_lora_batch` and the PEFT routing that
``patch_peft_model`` installs (mixed-adapter batches, in training too).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional

from lorafusion_kernels._kernels._common import rank_block, runs_triton
from lorafusion_kernels._kernels.multi_lora_bwd import multi_lora_dsx, multi_lora_dys_dyb, multi_lora_dyw_dsa
from lorafusion_kernels._kernels.multi_lora_fwd import multi_lora_linear, multi_lora_shrink
from lorafusion_kernels.dropout import draw_seed, dropout_keep_mask, keep_threshold, seed_tensor
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.lora import deterministic_mode, fused_lora_linear
from lorafusion_kernels.metadata import MultiLoRABatch

__all__ = [
    "BASE_ADAPTER",
    "fused_multi_lora_linear",
    "install_peft_mixed_batches",
    "multi_lora_batch",
    "multi_lora_checkpoint_contexts",
    "multi_lora_router",
    "peft_multi_lora_forward",
    "uninstall_peft_mixed_batches",
]

BASE_ADAPTER = "__base__"
"""PEFT's name for "no adapter" in ``adapter_names``: those tokens get the frozen layer only."""


@dataclass(frozen=True)
class _AdapterParams:
    """Host-side per-adapter values of one call (they differ per layer, so never live in the batch)."""

    ranks: tuple[int, ...]
    scaling: tuple[float, ...]
    dropout_p: tuple[float, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for r in self.ranks:
            out.append(acc)
            acc += r
        return tuple(out)

    @property
    def has_dropout(self) -> bool:
        return any(p > 0.0 for p in self.dropout_p)

    @property
    def max_rank(self) -> int:
        return max(1, *self.ranks)

    @property
    def block_r(self) -> int:
        return rank_block(self.max_rank)


@dataclass(frozen=True)
class _DeviceParams:
    ranks: torch.Tensor
    """int32 ``[n, 2]``: ``(r_a, roff_a)``."""
    scaling: torch.Tensor
    """fp32 ``[n]``."""
    s_scale: torch.Tensor
    """fp32 ``[n]``: ``scaling_a / (1 - p_a)``, applied to ``S'`` before its one rounding."""
    inv_keep: torch.Tensor
    """fp32 ``[n]``: ``1 / (1 - p_a)``."""
    thresholds: torch.Tensor
    """int32 ``[n]``: ``ceil(p_a * 2**24)``."""
    zero_seed: torch.Tensor
    """int64 ``[1]``, passed where no dropout runs (the kernels never read it then)."""


@functools.lru_cache(maxsize=256)
def _device_params(params: _AdapterParams, device: torch.device) -> _DeviceParams:
    """The per-adapter tables on ``device``; cached, so layers with equal values share one copy.

    Values stay fp32 (never rounded to the activation dtype) and reach the kernels as runtime data,
    so a new scaling or p never recompiles anything.
    """

    def put(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    return _DeviceParams(
        ranks=put([[r, o] for r, o in zip(params.ranks, params.offsets, strict=True)], torch.int32).reshape(-1, 2),
        scaling=put(list(params.scaling), torch.float32),
        s_scale=put([c / (1.0 - p) for c, p in zip(params.scaling, params.dropout_p, strict=True)], torch.float32),
        inv_keep=put([1.0 / (1.0 - p) for p in params.dropout_p], torch.float32),
        thresholds=put([keep_threshold(p) for p in params.dropout_p], torch.int32),
        zero_seed=put([0], torch.int64),
    )


def _per_adapter(value: float | Sequence[float], n: int, name: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * n
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    out = tuple(float(v) for v in value)
    if len(out) != n:
        raise LoRAFusionKernelsError(f"{name} has {len(out)} entries for {n} adapters; give one per adapter")
    return out


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    batch: MultiLoRABatch,
    dropout_p: tuple[float, ...],
) -> None:
    if len(lora_a) != len(lora_b):
        raise LoRAFusionKernelsError(f"got {len(lora_a)} lora_a tensors but {len(lora_b)} lora_b tensors")
    if len(lora_a) < batch.num_adapters:
        raise LoRAFusionKernelsError(
            f"the batch routes tokens to {batch.num_adapters} adapters but only {len(lora_a)} are given"
        )
    if not x.is_floating_point():
        raise LoRAFusionKernelsError(f"x must be a floating-point tensor, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise LoRAFusionKernelsError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if weight.dim() != 2:
        raise LoRAFusionKernelsError(f"weight must be [N, K], got {list(weight.shape)}")
    if runs_triton(x) and x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise LoRAFusionKernelsError(f"the Triton kernels take float16, bfloat16 or float32, got {x.dtype}")
    tensors = [x, weight, *lora_a, *lora_b, *([bias] if bias is not None else [])]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise LoRAFusionKernelsError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    n_out, k_in = weight.shape
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise LoRAFusionKernelsError(f"bias must be [{n_out}], got {list(bias.shape)}")
    if x.shape[-1] != k_in:
        raise LoRAFusionKernelsError(f"x has {x.shape[-1]} features but weight is [{n_out}, {k_in}]")
    tokens = x.numel() // k_in if k_in else 0
    if tokens != batch.total_tokens:
        raise LoRAFusionKernelsError(
            f"x holds {tokens} tokens but the segments add up to {batch.total_tokens}; "
            "segment_lengths must cover the flattened tokens exactly"
        )
    for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
        if a.dim() != 2 or a.shape[1] != k_in:
            raise LoRAFusionKernelsError(f"lora_a[{i}] must be [r, {k_in}], got {list(a.shape)}")
        if b.dim() != 2 or b.shape != (n_out, a.shape[0]):
            raise LoRAFusionKernelsError(f"lora_b[{i}] must be [{n_out}, {a.shape[0]}], got {list(b.shape)}")
    for p in dropout_p:
        keep_threshold(p)


def fused_multi_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    *,
    segment_lengths: Sequence[int] | torch.Tensor | None = None,
    segment_adapters: Sequence[int] | torch.Tensor | None = None,
    scaling: float | Sequence[float],
    dropout_p: float | Sequence[float] = 0.0,
    bias: torch.Tensor | None = None,
    seed: int | None = None,
    batch: MultiLoRABatch | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``y = x W^T + bias + scaling_a * dropout_{p_a}(x) A_a^T B_a^T``, adapter ``a`` chosen per segment.

    Args:
        x: ``[T, K]`` packed tokens (any leading dims are flattened; ``y`` keeps them).
        weight: ``[N, K]`` frozen weight shared by every adapter.
        lora_a: Per adapter ``A_i [r_i, K]`` (ranks may differ; rank 0 means "no adapter").
        lora_b: Per adapter ``B_i [N, r_i]``.
        segment_lengths: Tokens per segment (ignored when ``batch`` is given).
        segment_adapters: Adapter index per segment (ignored when ``batch`` is given).
        scaling: Per adapter (or one for all) LoRA scaling, e.g. PEFT's ``lora_alpha / r``; kept in fp32.
        dropout_p: Dropout probability in ``[0, 1)``, one for all or one per adapter.
        bias: ``[N]`` or None.
        seed: Dropout seed; None draws one from torch's generator (``torch.manual_seed`` reproduces it).
        batch: Metadata built once per microbatch with :meth:`MultiLoRABatch.from_segments`; reuse it
            across layers. Built here from the segment lists when None.
        deterministic: Sum ``dB``/``dS`` without atomics (run-to-run identical gradients, slower);
            None follows FusedLoRA's ``deterministic_mode()`` (``torch.use_deterministic_algorithms``
            or ``LORAFUSION_DETERMINISTIC=1``). A one-adapter batch passes it on to FusedLoRA.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        LoRAFusionKernelsError: Inconsistent shapes, token count or per-adapter lists, or p outside ``[0, 1)``.
    """
    if batch is None:
        if segment_lengths is None or segment_adapters is None:
            raise LoRAFusionKernelsError("give either batch= or both segment_lengths= and segment_adapters=")
        batch = MultiLoRABatch.from_segments(
            segment_lengths, segment_adapters, num_adapters=len(lora_a), device=x.device
        )
    else:
        batch = batch.to(x.device)
    n = len(lora_a)
    scales = _per_adapter(scaling, n, "scaling")
    ps = _per_adapter(dropout_p, n, "dropout_p")
    _check_inputs(x, weight, lora_a, lora_b, bias, batch, ps)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    only = batch.single_adapter()
    if batch.total_tokens == 0:
        y = functional.linear(x2, weight, bias)
    elif only is not None:
        y = _single_adapter(x2, weight, lora_a[only], lora_b[only], scales[only], ps[only], bias, seed, deterministic)
    elif runs_triton(x2):
        params = _AdapterParams(tuple(a.shape[0] for a in lora_a), scales, ps)
        a_cat = torch.cat([a.to(x.dtype) for a in lora_a], dim=0)
        b_cat = torch.cat([b.to(x.dtype) for b in lora_b], dim=1)
        if deterministic is None:
            deterministic = deterministic_mode()
        if torch.compiler.is_compiling():
            y = _compiled_forward(x2, weight, bias, a_cat, b_cat, batch, params, seed, deterministic)
        else:
            seed_t = _seed_for(seed, x2.device) if params.has_dropout else _device_params(params, x2.device).zero_seed
            y = _FusedMultiLoRA.apply(  # type: ignore[no-untyped-call]
                x2, weight, bias, a_cat, b_cat, seed_t, batch, params, deterministic
            )
    else:
        y = _multi_lora_torch(x2, weight, lora_a, lora_b, batch, scales, ps, bias, seed)
    return y.reshape(*lead, weight.shape[0])


def _seed_for(seed: int | None, device: torch.device) -> torch.Tensor:
    return draw_seed(device) if seed is None else seed_tensor(seed, device)


def _compiled_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    batch: MultiLoRABatch,
    params: _AdapterParams,
    seed: int | None,
    deterministic: bool,
) -> torch.Tensor:
    """The Triton path as ``torch.compile`` sees it: the ``lorafusion::fused_multi_lora_forward`` custom op.

    The batch reaches the op as its host segment lists, which Dynamo guards on (a batch with other
    segments recompiles once, then Dynamo makes the lengths dynamic); the op looks the batch's
    device tables up by those lists, built once per distinct batch.
    """
    # Without dropout the seed is never read: a traced zeros op, not the cached tensor of `_device_params`.
    no_seed = not params.has_dropout
    seed_t = torch.zeros(1, dtype=torch.int64, device=x.device) if no_seed else _seed_for(seed, x.device)
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
        deterministic,
    )
    return cast(torch.Tensor, y)


def _single_adapter(
    x: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    p: float,
    bias: torch.Tensor | None,
    seed: int | None,
    deterministic: bool | None,
) -> torch.Tensor:
    """One adapter owns every token: FusedLoRA (row ``t`` of x is token ``t``, so the mask is the same)."""
    if a.shape[0] == 0:
        return functional.linear(x, weight, bias)
    return fused_lora_linear(
        x, weight, a, b, scaling=scaling, dropout_p=p, bias=bias, seed=seed, deterministic=deterministic
    )


def _multi_lora_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    batch: MultiLoRABatch,
    scaling: tuple[float, ...],
    dropout_p: tuple[float, ...],
    bias: torch.Tensor | None,
    seed: int | None,
) -> torch.Tensor:
    """Plain-torch path (CPU without the interpreter): per segment, with the kernels' dropout mask.

    Autograd differentiates it directly (it keeps the masked inputs; memory is not a concern here).
    """
    if seed is None and any(p > 0.0 for p in dropout_p):
        seed = int(draw_seed("cpu").item())
    y = functional.linear(x, weight, bias)
    pieces = []
    for start, length, adapter in batch.nonempty_segments():
        xs = x[start : start + length]
        a, b, p = lora_a[adapter], lora_b[adapter], dropout_p[adapter]
        if a.shape[0] == 0:
            pieces.append(y.new_zeros(length, y.shape[1]))
            continue
        if p > 0.0:
            assert seed is not None
            keep = dropout_keep_mask(seed, length, x.shape[1], p, row_offset=start, device=x.device)
            xs = torch.where(keep, xs / (1.0 - p), torch.zeros_like(xs))
        delta = functional.linear(functional.linear(xs, a.to(x.dtype)), b.to(x.dtype)) * scaling[adapter]
        pieces.append(delta)
    return y + torch.cat(pieces, dim=0)


def _forward_core(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    batch: MultiLoRABatch,
    params: _AdapterParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, N], S' [T, BLOCK_R])`` of the Triton path; ``S'`` is what the backward needs besides ``x``."""
    x = x.contiguous()
    dev = _device_params(params, x.device)
    s = multi_lora_shrink(
        x,
        a_cat.contiguous(),
        batch,
        block_r=params.block_r,
        max_rank=params.max_rank,
        ranks=dev.ranks,
        thresholds=dev.thresholds,
        s_scale=dev.s_scale,
        seed=seed,
        has_dropout=params.has_dropout,
    )
    y = multi_lora_linear(x, weight, bias, s, b_cat.contiguous(), batch, ranks=dev.ranks, max_rank=params.max_rank)
    return y, s


def _backward_core(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    batch: MultiLoRABatch,
    params: _AdapterParams,
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, K], dA_cat [R_tot, K], dB_cat [N, R_tot])``; ``dx``/``dA_cat`` are empty ``[0]`` when not needed."""
    x, a_cat, b_cat = x.contiguous(), a_cat.contiguous(), b_cat.contiguous()
    dev = _device_params(params, x.device)
    dy = dy.contiguous()
    if deterministic:
        ds, db = _dys_dyb_by_segment(dy, b_cat, s, batch, params)
    else:
        ds, db = multi_lora_dys_dyb(dy, b_cat, s, batch, ranks=dev.ranks, scaling=dev.scaling, max_rank=params.max_rank)
    dropout: dict[str, Any] = {
        "max_rank": params.max_rank,
        "ranks": dev.ranks,
        "thresholds": dev.thresholds,
        "inv_keep": dev.inv_keep,
        "seed": seed,
        "has_dropout": params.has_dropout,
    }
    dx = multi_lora_dyw_dsa(dy, weight, ds, a_cat, batch, **dropout) if need_dx else dy.new_empty(0)
    da = multi_lora_dsx(ds, x, batch, r_tot=a_cat.shape[0], **dropout) if need_da else x.new_empty(0)
    return dx, da, db.to(b_cat.dtype)


@functools.lru_cache(maxsize=64)
def _batch_of(
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
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lorafusion::fused_multi_lora_forward``: :func:`_forward_core` with the batch given as its segment lists.

    ``deterministic`` is read by the backward only (its autograd context keeps it).
    """
    batch = _batch_of(tuple(segment_lengths), tuple(segment_adapters), num_adapters, x.device)
    return _forward_core(
        x, weight, bias, a_cat, b_cat, seed, batch, _AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p))
    )


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
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lorafusion::fused_multi_lora_backward``: :func:`_backward_core` with the batch given as its segment lists."""
    batch = _batch_of(tuple(segment_lengths), tuple(segment_adapters), num_adapters, x.device)
    params = _AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p))
    return _backward_core(dy, x, weight, a_cat, b_cat, s, seed, batch, params, need_dx, need_da, deterministic)


_SEGMENTS_SCHEMA = (
    "int[] segment_lengths, int[] segment_adapters, int num_adapters, int[] ranks, float[] scaling, float[] dropout_p"
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
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    block_r = rank_block(max(1, *ranks))
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
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = dy.new_empty((dy.shape[0], weight.shape[1])) if need_dx else dy.new_empty(0)
    da = x.new_empty(a_cat.shape) if need_da else x.new_empty(0)
    return dx, da, torch.empty_like(b_cat)


def _save_for_backward(
    ctx: Any,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor],
    s: torch.Tensor,
    segments: tuple[tuple[int, ...], tuple[int, ...], int],
    params: _AdapterParams,
    deterministic: bool,
) -> None:
    """Saves ``x``, ``S'`` and the seed (no mask, no ``x_hat``).

    Args:
        ctx: The autograd context.
        inputs: ``(x, W, bias, A_cat, B_cat, seed)``.
        s: ``S' [T, BLOCK_R]`` from the forward.
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
    x, weight, bias, a_cat, b_cat, seed, lengths, adapters, num_adapters, ranks, scaling, dropout_p, deterministic = (
        inputs
    )
    segments = (tuple(lengths), tuple(adapters), num_adapters)
    params = _AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p))
    _save_for_backward(ctx, (x, weight, bias, a_cat, b_cat, seed), output[1], segments, params, deterministic)


def _backward(ctx: Any, dy: torch.Tensor, *_unused: Any, opaque: bool = True) -> tuple[torch.Tensor | None, ...]:
    """Shared backward; ``opaque`` routes through the custom op (always, when AOTAutograd traces it)."""
    x, weight, a_cat, b_cat, s, seed = ctx.saved_tensors
    params: _AdapterParams = ctx.params
    need_dx, need_da = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[3])
    if opaque:
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
            need_dx,
            need_da,
            ctx.deterministic,
        )
    else:
        dx, da, db = _backward_core(
            dy, x, weight, a_cat, b_cat, s, seed, ctx.batch, params, need_dx, need_da, ctx.deterministic
        )
    dw = dy.t().mm(x) if ctx.needs_input_grad[1] else None
    dbias = dy.sum(dim=0, dtype=torch.float32).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    grads = (dx if need_dx else None, dw, dbias, da if need_da else None, db if ctx.needs_input_grad[4] else None)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


class _FusedMultiLoRA(torch.autograd.Function):
    """Autograd of the Triton path for eager calls; saves ``x``, ``S' = scaling * S`` and the seed.

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
        params: _AdapterParams,
        deterministic: bool,
    ) -> torch.Tensor:
        """``y [T, N]``."""
        y, s = _forward_core(x, weight, bias, a_cat, b_cat, seed, batch, params)
        segments = (batch.segment_lengths, batch.segment_adapters, batch.num_adapters)
        _save_for_backward(ctx, (x, weight, bias, a_cat, b_cat, seed), s, segments, params, deterministic)
        ctx.batch = batch
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(dx, dW, dbias, dA_cat, dB_cat, None, ...)`` by the chain rule of the module docstring."""
        return _backward(ctx, dy, opaque=False)


_multi_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _dys_dyb_by_segment(
    dy: torch.Tensor, b_cat: torch.Tensor, s: torch.Tensor, batch: MultiLoRABatch, params: _AdapterParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``dS``/``dB_cat``: plain matmuls per segment, summed in segment order (no atomics)."""
    ds = torch.zeros((dy.shape[0], s.shape[1]), dtype=torch.float32, device=dy.device)
    db = torch.zeros(b_cat.shape, dtype=torch.float32, device=dy.device)
    offsets = params.offsets
    for start, length, adapter in batch.nonempty_segments():
        r, roff, scale = params.ranks[adapter], offsets[adapter], params.scaling[adapter]
        if r == 0:
            continue
        rows = slice(start, start + length)
        ds[rows, :r] = (dy[rows] @ b_cat[:, roff : roff + r]).float() * scale
        db[:, roff : roff + r] += (dy[rows].t() @ s[rows, :r]).float()
    return ds, db


# --------------------------------------------------------------------------------------------------
# Runtime hook and PEFT routing
# --------------------------------------------------------------------------------------------------


@dataclass
class _Routing:
    batch: MultiLoRABatch
    adapter_names: tuple[str, ...]
    on_device: dict[torch.device, MultiLoRABatch]

    def batch_on(self, device: torch.device) -> MultiLoRABatch:
        if device not in self.on_device:
            self.on_device[device] = self.batch.to(device)
        return self.on_device[device]


_ACTIVE: contextvars.ContextVar[_Routing | None] = contextvars.ContextVar("lorafusion_multi_lora_batch", default=None)


@contextlib.contextmanager
def multi_lora_batch(batch: MultiLoRABatch, adapter_names: Sequence[str]) -> Iterator[MultiLoRABatch]:
    """Route every patched PEFT ``lora.Linear`` through FusedMultiLoRA for one microbatch's forward.

    Inside the block, each PEFT ``lora.Linear`` of a model patched with
    :func:`lorafusion_kernels.patch_peft_model` flattens its input ``[..., K]`` to ``[T, K]`` (``T``
    must equal ``batch.total_tokens``, else :class:`LoRAFusionKernelsError`) and treats it as the
    batch's segments: segment ``j`` uses the PEFT adapter named
    ``adapter_names[batch.segment_adapters[j]]`` with that layer's own ``lora_A``/``lora_B``
    weights, ``scaling`` and ``lora_dropout`` p (p applies only while the layer is in training mode).
    The name ``"__base__"``, or an adapter that a layer does not have, means "frozen layer only" for
    those tokens (as in PEFT's ``adapter_names=``). Works in training and eval mode, on CPU (plain
    torch) and CUDA fp16/bf16 (Triton). Autograd saves what the backward needs: the context is needed
    only while the forward runs, so ``loss.backward()`` may run after the block.

    Trainer usage (one microbatch, adapters of the run listed once in a fixed order)::

        batch = MultiLoRABatch.from_segments(lengths, adapter_ids, num_adapters=len(names), device="cuda")
        with lorafusion_kernels.multi_lora_batch(batch, names):
            logits = model(input_ids=packed_ids, position_ids=position_ids)  # [1, T] packed tokens
        loss.backward()

    Recomputed forwards (activation checkpointing) must see the same segments: pass
    ``context_fn=multi_lora_checkpoint_contexts`` to ``torch.utils.checkpoint.checkpoint``
    (``use_reentrant=False``), which replays the routing that was active at forward time; with HF
    models: ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
    "context_fn": multi_lora_checkpoint_contexts})``.

    Args:
        batch: The microbatch's segments, built once with :meth:`MultiLoRABatch.from_segments`.
        adapter_names: PEFT adapter name of each adapter index (at least ``batch.num_adapters`` names).

    Yields:
        ``batch``.

    Raises:
        LoRAFusionKernelsError: Fewer names than the batch's adapters.
    """
    names = tuple(adapter_names)
    if isinstance(adapter_names, str) or len(names) < batch.num_adapters:
        raise LoRAFusionKernelsError(
            f"adapter_names must list one PEFT adapter name per adapter index "
            f"({batch.num_adapters} needed), got {adapter_names!r}"
        )
    token = _ACTIVE.set(_Routing(batch, names, {batch.device: batch}))
    try:
        yield batch
    finally:
        _ACTIVE.reset(token)


def multi_lora_checkpoint_contexts() -> tuple[
    contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the recomputation sees the same segments.

    Called by the checkpoint at forward time, it captures the routing active then (if any) and
    re-enters it around the recomputation in the backward, when :func:`multi_lora_batch` has long
    exited (and another microbatch's routing may be active)::

        torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=multi_lora_checkpoint_contexts)

    Returns:
        ``(forward context, recompute context)``.
    """
    return contextlib.nullcontext(), _reenter(_ACTIVE.get())


@contextlib.contextmanager
def _reenter(routing: _Routing | None) -> Iterator[None]:
    token = _ACTIVE.set(routing)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _rows_to_batch(x: torch.Tensor, adapter_names: Sequence[str]) -> tuple[MultiLoRABatch, tuple[str, ...]]:
    """PEFT's per-sample ``adapter_names`` (one per row of ``x [B, ..., K]``) as consecutive segments."""
    rows = x.shape[0] if x.dim() >= 2 else 0
    if len(adapter_names) != rows:
        raise LoRAFusionKernelsError(
            f"Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(adapter_names)} and {rows} respectively."
        )
    names = tuple(dict.fromkeys(adapter_names))
    index = {name: i for i, name in enumerate(names)}
    per_row = x.numel() // (rows * x.shape[-1]) if x.shape[-1] else 0
    return _row_batch(tuple(index[n] for n in adapter_names), per_row, x.device, len(names)), names


@functools.lru_cache(maxsize=64)
def _row_batch(row_adapters: tuple[int, ...], per_row: int, device: torch.device, num_adapters: int) -> MultiLoRABatch:
    lengths: list[int] = []
    adapters: list[int] = []
    for a in row_adapters:
        if adapters and adapters[-1] == a:
            lengths[-1] += per_row
        else:
            lengths.append(per_row)
            adapters.append(a)
    return MultiLoRABatch.from_segments(lengths, adapters, num_adapters=num_adapters, device=device)


def peft_multi_lora_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The routed forward of a PEFT ``lora.Linear``, or None when no multi-adapter routing applies.

    The patched ``lora.Linear.forward`` calls this first, for every layer (fused or not), and returns
    its result when it is not None. It applies when :func:`multi_lora_batch` is active or PEFT passed
    ``adapter_names=`` (one name per row of ``x``; consecutive rows of one adapter form a segment).
    Eligible layers (plain ``nn.Linear`` base in ``x``'s dtype, no ``fan_in_fan_out``, no
    ``lora_bias``, ranks the kernels take) run :func:`fused_multi_lora_linear`; others, and calls
    with extra arguments, run a per-segment eager loop with PEFT's own modules (the extra arguments
    go to the base layer, as in PEFT's forward). DoRA and other LoRA variants, and merged
    adapters, are refused, as PEFT refuses them for mixed batches.

    Args:
        layer: A PEFT ``lora.Linear``.
        x: Its input ``[..., K]``.
        *args: Extra positional arguments of the forward (passed to the base layer).
        **kwargs: Extra keyword arguments; ``adapter_names`` is consumed here.

    Returns:
        ``[..., N]`` in ``x.dtype``, or None.

    Raises:
        LoRAFusionKernelsError: Token count differs from the batch, too few names, DoRA/variants, or
            merged adapters.
    """
    adapter_names = kwargs.pop("adapter_names", None)
    if adapter_names is not None:
        batch, names = _rows_to_batch(x, adapter_names)
    else:
        routing = _ACTIVE.get()
        if routing is None:
            return None
        batch, names = routing.batch_on(x.device), routing.adapter_names
    if layer.disable_adapters:
        frozen: torch.Tensor = layer.base_layer(x, *args, **kwargs)
        return frozen
    if layer.merged:
        raise LoRAFusionKernelsError("mixed-adapter batches need unmerged adapters: call `unmerge_adapter()` first")
    k_in = x.shape[-1]
    tokens = x.numel() // k_in if k_in else 0
    if tokens != batch.total_tokens:
        raise LoRAFusionKernelsError(
            f"{type(layer).__name__} got {tokens} tokens (input {list(x.shape)}) but the multi-LoRA batch "
            f"holds {batch.total_tokens}; every LoRA layer inside `multi_lora_batch` must see the packed tokens"
        )
    present = [_layer_adapter(layer, names[a]) for a in range(batch.num_adapters)]
    for name in filter(None, present):
        if layer.use_dora.get(name, False) or name in getattr(layer, "lora_variant", {}):
            raise LoRAFusionKernelsError(
                f"adapter {name!r} uses DoRA or another LoRA variant, which mixed-adapter batches do not support"
            )
    if _fusable(layer, x, present, args, kwargs):
        return _fused_layer_forward(layer, x, batch, present)
    return _eager_layer_forward(layer, x, batch, present, args, kwargs)


def _layer_adapter(layer: Any, name: str) -> str | None:
    """``name`` if this layer holds that adapter, else None (base only, as PEFT does)."""
    return name if name != BASE_ADAPTER and name in layer.lora_A else None


def _dropout_p(layer: Any, name: str) -> float:
    drop = layer.lora_dropout[name]
    return float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0


def _fusable(
    layer: Any, x: torch.Tensor, present: list[str | None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    base = layer.base_layer
    if args or kwargs or type(base) is not nn.Linear or getattr(layer, "fan_in_fan_out", False):
        return False
    if base.weight.dtype != x.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    if runs_triton(x) and not x.is_cuda and x.dtype == torch.bfloat16:
        return False
    for name in filter(None, present):
        if layer.lora_B[name].bias is not None:
            return False
        if not isinstance(layer.lora_dropout[name], nn.Dropout | nn.Identity):
            return False
        if runs_triton(x) and layer.r[name] > 128:
            return False
    return True


def _fused_layer_forward(layer: Any, x: torch.Tensor, batch: MultiLoRABatch, present: list[str | None]) -> torch.Tensor:
    k_in = x.shape[-1]
    base = layer.base_layer
    lora_a, lora_b, scaling, ps = [], [], [], []
    for name in present:
        if name is None:
            lora_a.append(x.new_zeros(0, k_in))
            lora_b.append(x.new_zeros(base.out_features, 0))
            scaling.append(0.0)
            ps.append(0.0)
        else:
            lora_a.append(layer.lora_A[name].weight.to(x.dtype))
            lora_b.append(layer.lora_B[name].weight.to(x.dtype))
            scaling.append(float(layer.scaling[name]))
            ps.append(_dropout_p(layer, name))
    return fused_multi_lora_linear(
        x, base.weight, lora_a, lora_b, scaling=scaling, dropout_p=ps, bias=base.bias, batch=batch
    )


def _eager_layer_forward(
    layer: Any,
    x: torch.Tensor,
    batch: MultiLoRABatch,
    present: list[str | None],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """PEFT's own modules, one segment at a time (what ``_mixed_batch_forward`` does per sample)."""
    result = layer.base_layer(x, *args, **kwargs)
    flat_x = x.reshape(-1, x.shape[-1])
    out_features = result.shape[-1]
    pieces = []
    for start, length, adapter in batch.nonempty_segments():
        name = present[adapter]
        if name is None:
            pieces.append(result.new_zeros(length, out_features))
            continue
        lora_a = layer.lora_A[name]
        xs = flat_x[start : start + length].to(lora_a.weight.dtype)
        delta = layer.lora_B[name](lora_a(layer.lora_dropout[name](xs))) * layer.scaling[name]
        pieces.append(delta.to(result.dtype))
    out: torch.Tensor = result + torch.cat(pieces, dim=0).reshape(result.shape)
    return out


@contextlib.contextmanager
def _mixed_batch_hooks(lora_model: Any, original: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
    """``LoraModel._enable_peft_forward_hooks`` that also admits ``adapter_names=`` in training mode.

    PEFT refuses per-sample adapters in training only because its ``_mixed_batch_forward`` is an
    inference path; the patched layers route them through FusedMultiLoRA (or a per-segment loop)
    with dropout and gradients, so the check is skipped while PEFT registers its per-layer hooks.
    """
    if kwargs.get("adapter_names") is None or not lora_model.training:
        with original(*args, **kwargs):
            yield
        return
    lora_model.training = False
    try:
        hooks = original(*args, **kwargs)
        hooks.__enter__()
    finally:
        lora_model.training = True
    try:
        yield
    finally:
        hooks.__exit__(None, None, None)


_GUARD_HOOKS = "_lorafusion_mixed_batch_guards"


def multi_lora_router(layer: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """Router for ``peft_integration``: claims the calls that carry mixed-adapter segments.

    Those are the calls made under :func:`multi_lora_batch` or with PEFT's ``adapter_names=``; any
    other call returns None, so the next router (single adapter) decides. The route takes the
    call's extra arguments (passed on to the base layer, as PEFT does): PEFT's own forward would
    apply the one active adapter to every segment.
    """
    from lorafusion_kernels.peft_integration import Route

    if kwargs.get("adapter_names") is None and _ACTIVE.get() is None:
        return None
    return Route(_routed_forward, extra_args=True)


def _routed_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`peft_multi_lora_forward` for a call that :func:`multi_lora_router` claimed (never None)."""
    out = peft_multi_lora_forward(layer, x, *args, **kwargs)
    assert out is not None, "multi_lora_router claimed a call without multi-adapter routing"
    return out


def _unpatched_guard(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook on the LoRA layers that ``patch_peft_model`` left alone.

    Inside :func:`multi_lora_batch` their output (PEFT's active adapter on every token) would be
    wrong, so it is replaced by the per-segment result, or refused for LoRA layer types other than
    ``lora.Linear``. This includes layers whose ``forward`` hooks (e.g. accelerate's) wrapped before
    patching: the forward hook still sees the call's arguments.
    """
    if kwargs.get("adapter_names") is not None or _ACTIVE.get() is None:
        return None
    from peft.tuners.lora.layer import Linear

    from lorafusion_kernels.peft_integration import is_patched

    if is_patched(module):
        return None

    if type(module) is not Linear:
        raise LoRAFusionKernelsError(
            f"{type(module).__name__} LoRA layers cannot route multi_lora_batch segments; "
            "target only linear layers with the adapters trained in mixed batches"
        )
    return peft_multi_lora_forward(module, *args, **kwargs)


def install_peft_mixed_batches(model: nn.Module) -> None:
    """Route mixed-adapter batches of a PEFT model: :func:`multi_lora_batch` and ``adapter_names=``.

    Called by ``patch_peft_model`` after it patched the layers: registers :func:`multi_lora_router`
    (asked before the single-adapter router), lets PEFT's ``adapter_names=`` through in training
    mode, and hooks the LoRA layers left unpatched (whatever the reason, a ``forward`` already
    wrapped by hooks included) so that they never compute a silent wrong result inside
    :func:`multi_lora_batch`. Calling it twice is harmless.

    Args:
        model: A ``PeftModel`` or a module holding PEFT LoRA layers.
    """
    from peft.tuners.lora.layer import LoraLayer

    from lorafusion_kernels.peft_integration import is_patched, register_router

    register_router(multi_lora_router)
    lora_model = _lora_model(model)
    if lora_model is not None and "_enable_peft_forward_hooks" not in vars(lora_model):
        original = lora_model._enable_peft_forward_hooks
        lora_model._enable_peft_forward_hooks = functools.partial(_mixed_batch_hooks, lora_model, original)
    for module in model.modules():
        if isinstance(module, LoraLayer) and not is_patched(module) and not hasattr(module, _GUARD_HOOKS):
            handle = module.register_forward_hook(_unpatched_guard, with_kwargs=True)
            setattr(module, _GUARD_HOOKS, handle)


def uninstall_peft_mixed_batches(model: nn.Module) -> None:
    """Undo :func:`install_peft_mixed_batches` on ``model`` (called by ``unpatch_peft_model``)."""
    lora_model = _lora_model(model)
    if lora_model is not None and "_enable_peft_forward_hooks" in vars(lora_model):
        del lora_model._enable_peft_forward_hooks
    for module in model.modules():
        handle = getattr(module, _GUARD_HOOKS, None)
        if handle is not None:
            handle.remove()
            delattr(module, _GUARD_HOOKS)


def _lora_model(model: nn.Module) -> Any:
    """The PEFT ``LoraModel`` of ``model`` (itself or its ``base_model``), or None."""
    try:
        from peft.tuners.lora import LoraModel
    except ImportError:
        return None
    for candidate in (model, getattr(model, "base_model", None)):
        if isinstance(candidate, LoraModel):
            return candidate
    return None
