"""Sibling LoRA layers in one FusedMultiLoRA call: several projections of one input (q/k/v, gate/up).

A decoder layer feeds one ``x [T, K]`` to several linear layers (its "members"), each with its own
frozen ``W_g [N_g, K]`` and, per adapter ``a``, its own ``A_{a,g} [r_a, K]`` and ``B_{a,g} [N_g, r_a]``.
One call computes all of them::

    x_hat[t] = keep_a(t, :) * x[t] / (1 - p_a)                  (ONE mask per token for all members)
    y_g[t]   = x[t] W_g^T + bias_g + scaling_a * (x_hat[t] A_{a,g}^T) B_{a,g}^T

with the members' weights stacked by rows into ``W [N, K]`` (``N = sum N_g``), so the frozen GEMM,
the dropout mask and the shrink run once instead of ``G`` times and the backward's ``dx`` is one GEMM
over all members. The LoRA kernels stay member-aware: a column tile of member ``g`` multiplies only
``S[:, g r_a : (g+1) r_a]`` by ``B_{a,g}`` (rank ``r_a``, never the stacked ``G r_a``), and ``dB_{a,g}``
comes from member ``g``'s columns of ``dy`` only (``_kernels.multi_lora_fwd``/``multi_lora_bwd``).

Dropout: members share each token's mask, as one LoRA layer on a fused ``qkv`` projection does.
Separate PEFT layers draw one mask each; each member's marginal is the same ``dropout(p)``, the
masks are correlated. With ``p = 0`` a sibling call equals the members' separate calls (to rounding).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from lorafusion_kernels._kernels._common import MAX_RANK, runs_triton
from lorafusion_kernels._kernels.multi_lora_fwd import member_outputs_fit, multi_lora_linear_members
from lorafusion_kernels.dropout import check_seed
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.first_order import first_order_only
from lorafusion_kernels.lora import check_deterministic, deterministic_mode
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora import frozen_linear, multi_lora_torch, run_triton
from lorafusion_kernels.multi_lora_autograd import autograd_backward, save_for_backward
from lorafusion_kernels.multi_lora_core import shrink
from lorafusion_kernels.multi_lora_params import (
    AdapterParams,
    call_batch,
    check_call,
    device_params,
    eager_seed,
    owned_ranks,
    owning,
    stack_adapters,
)

__all__ = ["fused_multi_lora_siblings"]


def fused_multi_lora_siblings(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[Sequence[torch.Tensor]],
    lora_b: Sequence[Sequence[torch.Tensor]],
    *,
    out_features: Sequence[int],
    segment_lengths: Sequence[int] | torch.Tensor | None = None,
    segment_adapters: Sequence[int] | torch.Tensor | None = None,
    scaling: float | Sequence[float],
    dropout_p: float | Sequence[float] = 0.0,
    bias: torch.Tensor | None = None,
    seed: int | None = None,
    batch: MultiLoRABatch | None = None,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """Every member's ``y_g = x W_g^T + bias_g + scaling_a * dropout_{p_a}(x) A_{a,g}^T B_{a,g}^T`` in one call.

    Args:
        x: ``[T, K]`` packed tokens (any leading dims are flattened; outputs keep them).
        weight: ``[N, K]``: the members' frozen weights stacked by rows (``N = sum(out_features)``).
            Keep them stacked in one buffer (and the layers' weights as its row views): stacking
            them per call would copy every frozen weight.
        lora_a: Per adapter, per member ``A_{a,g} [r_a, K]`` (one rank per adapter; rank 0 means
            "no adapter"). ``G r_a`` must not exceed 128.
        lora_b: Per adapter, per member ``B_{a,g} [N_g, r_a]``.
        out_features: ``N_g`` of each member, in the rows' order of ``weight``.
        segment_lengths: Tokens per segment (ignored when ``batch`` is given).
        segment_adapters: Adapter index per segment (ignored when ``batch`` is given).
        scaling: Per adapter (or one for all) LoRA scaling, the same for every member; kept in fp32.
        dropout_p: Dropout probability in ``[0, 1)``, one for all or one per adapter.
        bias: ``[N]`` (the members' biases concatenated) or None.
        seed: Dropout seed, an integer in ``[0, 2**63)`` (checked whatever ``dropout_p``); None draws
            one from torch's generator.
        batch: Metadata built once per microbatch with :meth:`MultiLoRABatch.from_segments`.
        deterministic: As in :func:`~lorafusion_kernels.fused_multi_lora_linear`.

    Returns:
        One ``[..., N_g]`` tensor per member, in ``x.dtype``. On sm_90 with the TMA kernel and member
        widths that are multiples of its column tile (q/k/v and gate/up of the usual models), each is
        its own contiguous tensor; otherwise they are column views of one ``[..., N]`` output.

    Raises:
        LoRAFusionKernelsError: Inconsistent shapes, token count, per-adapter lists or ranks, p
            outside ``[0, 1)`` or a bad seed.
    """
    members = _member_widths(out_features)
    _check_nesting(lora_a, "lora_a", len(members))
    _check_nesting(lora_b, "lora_b", len(members))
    batch, scales, ps = call_batch(x, len(lora_a), segment_lengths, segment_adapters, batch, scaling, dropout_p)
    check_deterministic(deterministic)
    if seed is not None:
        seed = check_seed(seed)  # at any p (a refused seed fails now, not once dropout is on); read once
    ranks = _check_siblings(x, weight, lora_a, lora_b, members, bias, batch, ps)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if batch.total_tokens == 0:
        y = frozen_linear(x2, weight, bias)
    elif runs_triton(x2):
        params = AdapterParams(owned_ranks(batch, ranks), scales, ps, members)
        a_cat = stack_adapters([a for per_member in owning(batch, lora_a) for a in per_member], dim=0)
        b_flat = stack_adapters([b.reshape(-1) for per_member in owning(batch, lora_b) for b in per_member], dim=0)
        if not torch.compiler.is_compiling() and member_outputs_fit(x2, weight, members, params.max_rank):
            det = deterministic_mode() if deterministic is None else deterministic
            seed_t = eager_seed(seed, params, x2.device)
            ys = _FusedSiblingMembers.apply(  # type: ignore[no-untyped-call]
                x2, weight, bias, a_cat, b_flat, seed_t, batch, params, det
            )
            return tuple(y.reshape(*lead, n) for y, n in zip(ys, members, strict=True))
        y = run_triton(x2, weight, bias, a_cat, b_flat, batch, params, seed, deterministic)
    else:
        y = multi_lora_torch(x2, weight, lora_a, lora_b, batch, scales, ps, bias, seed)
    return tuple(torch.split(y.reshape(*lead, weight.shape[0]), list(members), dim=-1))


def _member_widths(out_features: Sequence[int]) -> tuple[int, ...]:
    """``out_features`` as a tuple of positive ints, one per member; a lone int or a float is refused, never truncated.

    Raises:
        LoRAFusionKernelsError: Naming the value and what to pass.
    """
    if isinstance(out_features, torch.Tensor):
        out_features = out_features.tolist()
    if isinstance(out_features, str | bytes | Mapping | Set) or not isinstance(out_features, Iterable):
        raise LoRAFusionKernelsError(
            f"out_features must list each member's width in the rows' order of weight (e.g. [q, k, v] widths), "
            f"got {type(out_features).__name__} {out_features!r}; one layer alone is fused_multi_lora_linear"
        )
    widths = list(out_features)
    for n in widths:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise LoRAFusionKernelsError(
                f"out_features must hold each member's width as an integer, got {n!r} in {widths!r}"
            )
    if not widths or any(n <= 0 for n in widths):
        raise LoRAFusionKernelsError(f"out_features must list each member's positive width, got {widths}")
    return tuple(int(n) for n in widths)


def _check_nesting(lora: Sequence[Sequence[torch.Tensor]], name: str, members: int) -> None:
    """Refuse ``lora_a``/``lora_b`` that are not one list per adapter holding one tensor per member.

    A flat list (one tensor per member, or per adapter) or an adapter's members stacked into one
    tensor would otherwise be read as other adapters or other members.

    Raises:
        LoRAFusionKernelsError: Naming the entry and the layout to pass.
    """
    layout = f"{name} must be a list with, per adapter, a list of its {members} members' tensors ([[q, k, v], ...])"
    if not isinstance(lora, list | tuple):
        got = "one tensor" if isinstance(lora, torch.Tensor) else type(lora).__name__
        raise LoRAFusionKernelsError(f"{layout}, got {got}")
    for i, per_member in enumerate(lora):
        if not isinstance(per_member, list | tuple):
            got = (
                f"a tensor {list(per_member.shape)}"
                if isinstance(per_member, torch.Tensor)
                else type(per_member).__name__
            )
            raise LoRAFusionKernelsError(
                f"{layout}; {name}[{i}] is {got}, not a list: give adapter {i} a list of one tensor per member "
                "(not one tensor, nor its members stacked into one)"
            )
        for g, t in enumerate(per_member):
            if not isinstance(t, torch.Tensor):
                raise LoRAFusionKernelsError(f"{name}[{i}][{g}] must be a tensor, got {type(t).__name__}")


def _check_siblings(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[Sequence[torch.Tensor]],
    lora_b: Sequence[Sequence[torch.Tensor]],
    members: tuple[int, ...],
    bias: torch.Tensor | None,
    batch: MultiLoRABatch,
    dropout_p: tuple[float, ...],
) -> tuple[int, ...]:
    """Validates a sibling call and returns each adapter's rank."""
    if len(lora_a) != len(lora_b):
        raise LoRAFusionKernelsError(f"got {len(lora_a)} lora_a entries but {len(lora_b)} lora_b entries")
    lora = [t for per in (*lora_a, *lora_b) for t in per]
    check_call(x, weight, len(lora_a), lora, bias, batch, dropout_p)
    if weight.shape[0] != sum(members):
        raise LoRAFusionKernelsError(
            f"weight must stack the members' rows, [{sum(members)}, K] for out_features {list(members)}, "
            f"got {list(weight.shape)}"
        )
    k_in = weight.shape[1]
    ranks = []
    for i, (per_a, per_b) in enumerate(zip(lora_a, lora_b, strict=True)):
        if len(per_a) != len(members) or len(per_b) != len(members):
            raise LoRAFusionKernelsError(
                f"adapter {i} has {len(per_a)} A and {len(per_b)} B matrices for {len(members)} members; give one each"
            )
        r = per_a[0].shape[0] if per_a[0].dim() == 2 else -1
        for g, (a, b) in enumerate(zip(per_a, per_b, strict=True)):
            if a.dim() != 2 or tuple(a.shape) != (r, k_in):
                raise LoRAFusionKernelsError(
                    f"lora_a[{i}][{g}] must be [{r}, {k_in}] (one rank per adapter in all members), got {list(a.shape)}"
                )
            if tuple(b.shape) != (members[g], r):
                raise LoRAFusionKernelsError(f"lora_b[{i}][{g}] must be [{members[g]}, {r}], got {list(b.shape)}")
        if runs_triton(x) and len(members) * r > MAX_RANK:
            raise LoRAFusionKernelsError(
                f"adapter {i}: {len(members)} members of rank {r} stack to rank {len(members) * r} > {MAX_RANK}; "
                "call the members separately (fused_multi_lora_linear)"
            )
        ranks.append(r)
    return tuple(ranks)


class _FusedSiblingMembers(torch.autograd.Function):
    """Autograd of an eager sibling call whose members' outputs are separate tensors.

    Forward: the shrink and :func:`multi_lora_linear_members` (each member's output contiguous, so the
    model's next operations read dense tensors). Backward: that of :func:`fused_multi_lora_linear`,
    its kernels reading each member's output gradient where it is (no ``[T, N]`` copy).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_cat: torch.Tensor,
        b_flat: torch.Tensor,
        seed: torch.Tensor,
        batch: MultiLoRABatch,
        params: AdapterParams,
        deterministic: bool,
    ) -> tuple[torch.Tensor, ...]:
        """``(y_1 [T, N_1], ..., y_G [T, N_G])``."""
        x = x.contiguous()
        dev = device_params(params, x.device)
        s = shrink(x, a_cat, seed, batch, params)
        assert dev.bounds is not None
        ys = multi_lora_linear_members(
            x, weight, bias, s, b_flat.contiguous(), batch, members=params.members, ranks=dev.ranks,
            scaling=dev.scaling, max_rank=params.max_rank, bounds=dev.bounds, ranks_host=params.ranks,
        )  # fmt: skip
        segments = (batch.segment_lengths, batch.segment_adapters, batch.num_adapters)
        save_for_backward(ctx, (x, weight, bias, a_cat, b_flat, seed), s, segments, params, deterministic)
        ctx.batch = batch
        return ys

    @staticmethod
    @first_order_only  # the backward is not itself differentiable: create_graph=True raises
    @once_differentiable
    def backward(ctx: Any, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """:func:`fused_multi_lora_linear`'s gradients, ``dy`` given as the members' gradients."""
        return autograd_backward(ctx, dys, opaque=False)
