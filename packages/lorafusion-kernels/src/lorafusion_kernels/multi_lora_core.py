"""FusedMultiLoRA's Triton path without autograd: the forward and backward passes of one call.

Forward: the shrink ``S = dropout(x) A_a^T`` per token, then the frozen GEMM with the LoRA term
``scaling_a * S B_a^T`` in its epilogue. Backward: ``dS``/``dB`` from ``dy``, then ``dA`` and ``dx``
(the ``dA`` pass writes dx's LoRA term where ``K <= N``, :func:`dx_from_da_pass`). The maths are in
:mod:`lorafusion_kernels.multi_lora`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lorafusion_kernels._kernels._common import parameter_grads, zeroed_fp32
from lorafusion_kernels._kernels.multi_lora_bwd import (
    member_grads,
    multi_lora_dsx,
    multi_lora_dys_dyb,
    multi_lora_dyw_dsa,
)
from lorafusion_kernels._kernels.multi_lora_fwd import multi_lora_linear, multi_lora_shrink
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora_params import AdapterParams, device_params

__all__ = ["ROW_CHUNK", "backward_core", "dx_from_da_pass", "forward_core", "shrink", "side_by_side"]


def shrink(
    x: torch.Tensor, a_cat: torch.Tensor, seed: torch.Tensor, batch: MultiLoRABatch, params: AdapterParams
) -> torch.Tensor:
    """``S [T, BLOCK_R]``: every token's ``dropout(x) A_a^T`` (``x`` contiguous)."""
    dev = device_params(params, x.device)
    return multi_lora_shrink(
        x,
        a_cat.contiguous(),
        batch,
        block_r=params.block_r,
        max_rank=params.stacked_rank,
        ranks=dev.a_ranks,
        thresholds=dev.thresholds,
        inv_keep=dev.inv_keep,
        seed=seed,
        has_dropout=params.has_dropout,
    )


def forward_core(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    batch: MultiLoRABatch,
    params: AdapterParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, N], S [T, BLOCK_R])`` of the Triton path; ``S`` is what the backward needs besides ``x``."""
    x = x.contiguous()
    dev = device_params(params, x.device)
    s = shrink(x, a_cat, seed, batch, params)
    y = multi_lora_linear(
        x, weight, bias, s, b_cat.contiguous(), batch, ranks=dev.ranks, scaling=dev.scaling, max_rank=params.max_rank,
        bounds=dev.bounds, ranks_host=params.ranks,
    )  # fmt: skip
    return y, s


def backward_core(
    dy: torch.Tensor | tuple[torch.Tensor, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    batch: MultiLoRABatch,
    params: AdapterParams,
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, K], dA_cat [R_tot, K], dB_cat [N, R_tot])``; ``dx``/``dA_cat`` are empty ``[0]`` when not needed.

    ``dy`` is ``[T, N]``, or a sibling call's members' gradients ``[T, N_g]``, which the kernels read
    where they are.
    """
    x, a_cat, b_cat = x.contiguous(), a_cat.contiguous(), b_cat.contiguous()
    dev = device_params(params, x.device)
    dys = tuple(d.contiguous() for d in member_grads(dy))
    buffer = da_out = None
    if deterministic:
        ds, db = _dys_dyb_by_segment(side_by_side(dys), b_cat, s, batch, params)
    else:
        # One zeroed fp32 buffer [dB | dA | dS] takes every atomic sum: one fill, and for adapters of
        # one dtype one conversion of the [dB | dA] span (none for fp32 adapters).
        da_rows = a_cat.shape[0] if need_da else 0
        shapes = ((1, b_cat.numel()), (da_rows, x.shape[1]), (x.shape[0], s.shape[1]))
        buffer, (db, da_out, ds) = zeroed_fp32(*shapes, device=x.device)
        db = db.view(b_cat.shape)
        multi_lora_dys_dyb(
            dys, b_cat, s, batch, ranks=dev.ranks, scaling=dev.scaling, max_rank=params.max_rank,
            members=params.members, bounds=dev.bounds, ranks_host=params.ranks, accumulators=(ds, db),
        )  # fmt: skip
    dropout: dict[str, Any] = {
        "max_rank": params.stacked_rank,
        "ranks": dev.a_ranks,
        "thresholds": dev.thresholds,
        "inv_keep": dev.inv_keep,
        "seed": seed,
        "has_dropout": params.has_dropout,
    }
    da_args: dict[str, Any] = {
        "r_tot": a_cat.shape[0], "out_dtype": a_cat.dtype, "deterministic": deterministic, "out": da_out,
    }  # fmt: skip
    if need_dx and need_da and len(dys) == 1 and dx_from_da_pass(*weight.shape):
        dx = torch.empty_like(x)
        da = multi_lora_dsx(ds, x, batch, lora_dx=(a_cat, dx), **da_args, **dropout)
        dx.addmm_(dys[0], weight)
    else:
        dx = (
            multi_lora_dyw_dsa(dys, weight, ds, a_cat, batch, bounds=dev.bounds, **dropout)
            if need_dx
            else x.new_empty(0)
        )
        da = multi_lora_dsx(ds, x, batch, **da_args, **dropout) if need_da else x.new_empty(0)
    if buffer is None or da_out is None:  # deterministic: dA is in A's dtype already
        return dx, da, db.to(b_cat.dtype)
    da_cast, db = parameter_grads(buffer, db, da_out, a_cat.dtype, b_cat.dtype)
    return dx, (da_cast if need_da else da), db


def dx_from_da_pass(n: int, k: int) -> bool:
    """Whether, for a weight ``[n, k]``, the ``dA`` pass writes dx's LoRA term and cuBLAS adds ``dy W`` in place.

    That draws the dropout mask once instead of twice (the fused dx GEMM draws it again) and runs the
    big product at cuBLAS's speed; the LoRA term is rounded to dx's dtype once before the sum (the
    fused GEMM keeps it in fp32). Only where ``K <= N``: writing the ``[T, K]`` term costs more than
    the fused GEMM loses to cuBLAS when dx is the wide side (H100, 4 adapters, whole grid,
    2026-11-25: the down projections went from 1.22x to 1.24x the frozen layer on LLaMa-3.1-8B; o,
    qkv and gate_up gained 0-4%).
    """
    return k <= n


def side_by_side(dys: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``dy [T, N]`` from the members' gradients (itself when there is one)."""
    return dys[0] if len(dys) == 1 else torch.cat(dys, dim=1)


def _dys_dyb_by_segment(
    dy: torch.Tensor, b_cat: torch.Tensor, s: torch.Tensor, batch: MultiLoRABatch, params: AdapterParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``dS``/``dB``: plain matmuls per segment (and member), summed in segment order (no atomics)."""
    ds = torch.zeros((dy.shape[0], s.shape[1]), dtype=torch.float32, device=dy.device)
    db = torch.zeros(b_cat.shape, dtype=torch.float32, device=dy.device)
    offsets = params.offsets
    for start, length, adapter in batch.nonempty_segments():
        r, roff, scale = params.ranks[adapter], offsets[adapter], params.scaling[adapter]
        if r == 0:
            continue
        rows = slice(start, start + length)
        if not params.members:
            mine = slice(roff, roff + r)
            _segment_ds_db(dy[rows], b_cat[:, mine], s[rows, :r], scale, ds[rows, :r], db[:, mine])
            continue
        n = dy.shape[1]
        b_a = b_cat[n * roff : n * (roff + r)].view(n, r)
        db_a = db[n * roff : n * (roff + r)].view(n, r)
        for g, cols in enumerate(_member_slices(params.members)):
            member = slice(g * r, (g + 1) * r)
            _segment_ds_db(dy[rows, cols], b_a[cols], s[rows, member], scale, ds[rows, member], db_a[cols])
    return ds, db


ROW_CHUNK = 2048
"""Rows of ``dy`` copied to fp32 at a time by :func:`_segment_ds_db` (the copy is ``ROW_CHUNK x N x 4`` bytes)."""


def _segment_ds_db(
    dy: torch.Tensor, b: torch.Tensor, s: torch.Tensor, scale: float, ds_out: torch.Tensor, db_out: torch.Tensor
) -> None:
    """``ds_out = scale * dy b`` and ``db_out += scale * dy^T s`` for one segment, in fp32, row chunk by row chunk.

    ``dy [rows, n]``, ``b [n, r]`` (rounded to dy's dtype first, as the kernels do), ``s [rows, r]``;
    ``ds_out``/``db_out`` are fp32 views. Summing in fp32 as the kernels do keeps fp16's range: a
    half-precision ``dy^T s`` would overflow before a ``scale`` below 1 brings it back. The chunks
    are summed in a fixed order, so the result is reproducible.
    """
    b32 = b.to(dy.dtype).float()
    for lo in range(0, dy.shape[0], ROW_CHUNK):
        chunk = dy[lo : lo + ROW_CHUNK].float()
        ds_out[lo : lo + ROW_CHUNK] = chunk @ b32 * scale
        db_out += chunk.t() @ s[lo : lo + ROW_CHUNK].float() * scale


def _member_slices(members: Sequence[int]) -> list[slice]:
    """The output columns of each member of a sibling call."""
    out, start = [], 0
    for n in members:
        out.append(slice(start, start + n))
        start += n
    return out
