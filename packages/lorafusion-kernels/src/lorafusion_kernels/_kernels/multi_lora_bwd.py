"""FusedMultiLoRA backward kernels: ``dS``/``dB`` from one read of ``dy``, per-adapter ``dA``, fused ``dx``.

Notation as in ``multi_lora_fwd``; ``dy [T, N]``, token ``t`` of adapter ``a = a(t)``,
``x_hat[t] = keep_a(t, :) * x[t] / (1 - p_a)`` (the mask regenerated from the seed, never stored),
the saved ``S = x_hat A_a^T``. Chain rule of ``y = x W^T + bias + scaling_a S B_a^T``:

    dS[t, :r_a] = scaling_a * dy[t] B_a                        (dy kernel, one adapter per tile)
    dB_a        = scaling_a * sum_{t in a} dy[t]^T S[t, :r_a]  (same kernel, same dy tile)
    dA_a        = sum_{t in a} dS[t, :r_a]^T x_hat[t]    (runs of a's rows, added by atomics)
    dx[t]       = dy[t] W + keep_a(t, :) * (dS[t, :r_a] A_a) / (1 - p_a)   (one GEMM; or the dA
                  pass writes the second term, lora_dx, and cuBLAS adds dy W in place)

A sibling call (``multi_lora_fwd``'s docstring: members ``g`` owning columns ``n_g .. n_{g+1}``,
``S[t, g r_a : (g+1) r_a]`` and ``B_{a,g}`` in ``B_flat``) splits the first two per member:
``dS[t, g r_a : (g+1) r_a] = scaling_a * dy[t, n_g : n_{g+1}] B_{a,g}`` and
``dB_{a,g} = scaling_a sum_{t in a} dy[t, n_g : n_{g+1}]^T S[t, g r_a : (g+1) r_a]``; ``dA`` and ``dx`` see the
stacked ``A`` of rank ``G r_a`` and need nothing else.

Only the tiles of adapter ``a`` ever touch ``dA_a``/``dB_a`` (the columns/rows ``roff_a .. roff_a + r_a``
of the stacked buffers), so nothing leaks between adapters. Configs are looked up as "multi_dys_dyb",
"multi_dsx" (the ``dA`` pass; "multi_dsx_dx" when it also writes dx's LoRA term, whose best tiles
differ) and "multi_dyw_dsa", which fall back to FusedLoRA's "dys_dyb", "dsx" and "dyw_dsa" for the
same shape (same tiling).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorafusion_kernels._kernels import lora_dsx, lora_dys_dyb, lora_dyw_dsa
from lorafusion_kernels._kernels._common import (
    cdiv,
    dot_k_loop,
    dot_precision,
    gemm_meta,
    grouped_tile,
    launch_config,
    launch_fitting,
    launch_warming_layout_variant,
    rank_block,
    sm_count,
    tma_ok,
    wrapped_tile,
    zeroed_fp32,
)
from lorafusion_kernels._kernels.dropout import dropout_keep_tile, load_seed
from lorafusion_kernels._kernels.lora_dys_dyb import dys_dyb_rows, rows_per_group
from lorafusion_kernels._kernels.multi_lora_fwd import MAX_MEMBER_OUTPUTS
from lorafusion_kernels._kernels.routing import (
    adapter_dropout,
    adapter_rank,
    member_rank,
    rank_columns,
    segment_rows,
    segment_run,
    uniform_rank,
)
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.tuning.config import KernelConfig, register_fallback

DY_KERNEL = "multi_dys_dyb"
DA_KERNEL = "multi_dsx"
DA_DX_KERNEL = "multi_dsx_dx"
DX_KERNEL = "multi_dyw_dsa"
register_fallback(DY_KERNEL, lora_dys_dyb.KERNEL)
register_fallback(DA_KERNEL, lora_dsx.KERNEL)
register_fallback(DA_DX_KERNEL, lora_dsx.KERNEL)
register_fallback(DX_KERNEL, lora_dyw_dsa.KERNEL)


@triton.jit
def _member_dy(member, dy_ptr, dy1_ptr, dy2_ptr, dy3_ptr, stride0, stride1, stride2, stride3, MEMBER_DY: tl.constexpr):
    """``(pointer, row stride)`` of member ``member``'s own output gradient (``MEMBER_DY`` of them passed)."""
    ptr = dy_ptr
    stride = stride0
    # Nested, not `and`: the constexpr test must drop the branch (its pointer may be None).
    if MEMBER_DY > 1:  # noqa: SIM102
        if member == 1:
            ptr = dy1_ptr
            stride = stride1
    if MEMBER_DY > 2:  # noqa: SIM102
        if member == 2:
            ptr = dy2_ptr
            stride = stride2
    if MEMBER_DY > 3:  # noqa: SIM102
        if member == 3:
            ptr = dy3_ptr
            stride = stride3
    return ptr, stride


@triton.jit
def _multi_lora_dy_kernel(
    dy_ptr,
    dy1_ptr,
    dy2_ptr,
    dy3_ptr,
    b_ptr,
    s_ptr,
    ds_ptr,
    db_ptr,
    runs_ptr,
    rank_ptr,
    scaling_ptr,
    bounds_ptr,
    N,
    stride_dym,
    stride_dy1m,
    stride_dy2m,
    stride_dy3m,
    stride_bn,
    stride_sm,
    stride_dsm,
    stride_dbn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SIBLINGS: tl.constexpr,
    UNIFORM_RANK: tl.constexpr,
    MEMBER_DY: tl.constexpr,
    MEMBER_ALIGN: tl.constexpr,
    ATOMIC_DS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(runs, column blocks, G)``: program ``(c, j, g)`` reads column block ``j`` of run ``c``'s rows.

    A run is consecutive rows of one adapter (:meth:`MultiLoRABatch.segment_runs`). The program
    loads ``B_a``'s rows of its column block once, sums ``dB_a``'s rows ``[BLOCK_N, r_a]`` in
    registers over the run and adds them to the fp32 ``dB`` once; each row block's share of ``dS``
    goes to the fp32 ``dS`` by atomics (``ATOMIC_DS``; a plain store when one column block covers
    the columns). FusedLoRA's ``lora_dys_dyb`` says why this loop order.

    One layer has ``G = 1`` and column blocks over all ``N`` columns. In a sibling call program ``g``
    covers only member ``g``'s columns ``bounds[g] .. bounds[g + 1]`` (blocks past them do nothing), with
    ``B_{a,g}`` (``B_flat[N roff_a + n r_a + j]``) and ``S[:, g r_a + j]``, and writes
    ``dS[:, g r_a + j]``: the work and the tiles of one layer of rank ``r_a`` (``BLOCK_R`` covers
    ``r_a``, not ``G r_a``). With ``MEMBER_DY > 0`` each member's ``dy`` is its own ``[T, N_g]``
    tensor (``dy_ptr``, ``dy1_ptr``, ...). ``MEMBER_ALIGN`` divides every member bound (16 where every
    member's width is a multiple of 16, else 1): with it the compiler sees the mask ``n < bounds[g + 1]``
    constant over 16 columns and keeps the loads of ``dy`` along them vectorised.
    """
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0, row1, adapter = segment_run(runs_ptr, pid_c)
    r, roff = adapter_rank(rank_ptr, adapter)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = rank_columns(offs_r, r, UNIFORM_RANK)  # the adapter's own rank: a rank-0 adapter masks every column
    if SIBLINGS:
        member = tl.program_id(2)
        r = member_rank(rank_ptr, adapter, UNIFORM_RANK)
        n_lo = tl.multiple_of(tl.load(bounds_ptr + member), MEMBER_ALIGN)
        n_hi = tl.multiple_of(tl.load(bounds_ptr + member + 1), MEMBER_ALIGN)
        s_col = member * r
        # B_{a,g} and dB_{a,g}: row n of adapter a's [N, r_a] block at N roff_a + n r_a.
        b_cols = b_ptr + roff.to(tl.int64) * N
        db_cols = db_ptr + roff.to(tl.int64) * N
        stride_bn = r
        stride_dbn = r
    else:
        n_lo = 0
        n_hi = N
        s_col = 0
        b_cols = b_ptr + roff
        db_cols = db_ptr + roff
    member_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the member's own dy
    offs_n = n_lo + member_cols
    nr_mask = (offs_n < n_hi)[:, None] & r_mask[None, :]
    bt = tl.load(b_cols + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :], mask=nr_mask, other=0.0)
    scale = tl.load(scaling_ptr + adapter)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    if MEMBER_DY > 0:
        # Stacked column n of member g is column n - n_lo of its own gradient.
        dy_g, stride_g = _member_dy(
            member, dy_ptr, dy1_ptr, dy2_ptr, dy3_ptr, stride_dym, stride_dy1m, stride_dy2m, stride_dy3m, MEMBER_DY
        )
        dy_ptrs = dy_g + offs_m.to(tl.int64)[:, None] * stride_g + member_cols[None, :]
        stride_rows = stride_g
    else:
        dy_ptrs = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :]
        stride_rows = stride_dym
    s_ptrs = s_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + (s_col + offs_r)[None, :]
    # S columns past r_a are zeros (the shrink writes them), so one layer reads whole rows even with
    # mixed ranks; a rank read at run time in the mask left this load unvectorised and out of the
    # pipeline (1.5-2.3x the time, H200). A sibling member's columns end at r_a.
    s_cols = r_mask if SIBLINGS else offs_r < BLOCK_R
    ds_ptrs = ds_ptr + offs_m.to(tl.int64)[:, None] * stride_dsm + (s_col + offs_r)[None, :]
    # A sibling member narrower than the widest leaves the blocks past its columns no work.
    steps = tl.where(n_lo + pid_n * BLOCK_N < n_hi, tl.cdiv(row1 - row0, BLOCK_M), 0)
    db_acc = dys_dyb_rows(
        dy_ptrs, s_ptrs, ds_ptrs, offs_m, row1, steps, offs_n < n_hi, s_cols, r_mask, bt, scale, stride_rows,
        stride_sm, stride_dsm, BLOCK_M, BLOCK_N, BLOCK_R, ATOMIC_DS, DOT_PRECISION,
    )  # fmt: skip
    db_ptrs = db_cols + offs_n.to(tl.int64)[:, None] * stride_dbn + offs_r[None, :]
    tl.atomic_add(db_ptrs, db_acc * scale, mask=nr_mask, sem="relaxed")


@triton.jit(do_not_specialize=["stride_os"])
def _multi_lora_da_kernel(
    ds_ptr,
    x_ptr,
    out_ptr,
    a_ptr,
    dx_ptr,
    runs_ptr,
    rank_ptr,
    thr_ptr,
    inv_keep_ptr,
    seed_ptr,
    K,
    stride_dsm,
    stride_xm,
    stride_os,
    stride_om,
    stride_am,
    stride_dxm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_OUT: tl.constexpr,
    LORA_DX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BLOCK_K), runs)``: program ``(j, c)`` sums the rows of run ``c`` (one adapter's).

    The sum goes to column block ``j`` of the run's adapter's rows: added to the fp32 ``out`` with
    atomics (``ATOMIC_OUT``), or written to partial ``out[c]`` (summed later in a fixed order). A run
    is consecutive rows, so the loop steps its pointers with no table read per step (reading each
    tile's rows from a table inside the loop made this pass 16-27% slower on H100, 2026-11-25).

    ``LORA_DX``: also write ``dx``'s LoRA term ``keep * (dS A_a) / (1 - p_a)`` for the same rows and
    columns (``dx`` in x's dtype), from the same mask draw; ``dy W`` is added onto it afterwards.

    The sum is accumulated transposed, ``dA^T [BLOCK_K, BLOCK_R] += x_hat^T dS``: the dot's M extent
    is then ``BLOCK_K``, not the rank, and Hopper runs it as a warpgroup MMA (``wgmma``, at least 64
    rows) instead of ``mma.sync``: 11-14% less time on H100 at 8,192 tokens (2026-11-26).
    """
    pid_k = tl.program_id(0)
    pid_c = tl.program_id(1)
    row0, row1, adapter = segment_run(runs_ptr, pid_c)
    r, roff = adapter_rank(rank_ptr, adapter)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < r
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    seed_lo, seed_hi, thr = adapter_dropout(seed_ptr, thr_ptr, adapter, HAS_DROPOUT)
    inv_keep = tl.load(inv_keep_ptr + adapter)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    ds_ptrs = ds_ptr + offs_m.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    if LORA_DX:
        a_tile = tl.load(
            a_ptr + (roff + offs_r).to(tl.int64)[:, None] * stride_am + offs_k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(x_ptr.dtype.element_ty)
        dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_k[None, :]
    acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    for _ in range(tl.cdiv(row1 - row0, BLOCK_M)):
        mk_mask = (offs_m < row1)[:, None] & k_mask[None, :]
        # Whole rows: dS columns past the rank are zeros (no rank mask, which left the load unvectorised).
        dst = tl.load(ds_ptrs, mask=(offs_m < row1)[:, None], other=0.0).to(x_ptr.dtype.element_ty)
        xt = tl.load(x_ptrs, mask=mk_mask, other=0.0)
        if LORA_DX:
            lora = tl.dot(dst, a_tile, input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = dropout_keep_tile(seed_lo, seed_hi, offs_m, pid_k * BLOCK_K, thr, BLOCK_K)
            xt = tl.where(keep, xt, 0.0)
            if LORA_DX:
                lora = tl.where(keep, lora * inv_keep, 0.0)
        if LORA_DX:
            tl.store(dx_ptrs, lora.to(dx_ptr.dtype.element_ty), mask=mk_mask)
            dx_ptrs += BLOCK_M * stride_dxm
        acc = tl.dot(tl.trans(xt), dst, acc, input_precision=DOT_PRECISION)
        offs_m += BLOCK_M
        ds_ptrs += BLOCK_M * stride_dsm
        x_ptrs += BLOCK_M * stride_xm
    if HAS_DROPOUT:
        acc = acc * inv_keep
    out_ptrs = out_ptr + pid_c * stride_os + (roff + offs_r).to(tl.int64)[None, :] * stride_om + offs_k[:, None]
    out_mask = r_mask[None, :] & k_mask[:, None]
    if ATOMIC_OUT:
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")
    else:
        tl.store(out_ptrs, acc, mask=out_mask)


@triton.jit
def _segment_dsa(ds_rows, a_ptr, seg_ptr, rank_ptr, segment, offs_m, offs_k, k_mask, stride_am, BLOCK_R: tl.constexpr):
    """Segment ``segment``'s operands on a tile: ``(adapter, rows_in, dS rows (others zero), A_a columns)``."""
    offs_r = tl.arange(0, BLOCK_R)
    adapter, roff, rows_in, r_mask = segment_rows(seg_ptr, rank_ptr, segment, offs_m, offs_r)
    dst = tl.load(ds_rows, mask=rows_in[:, None], other=0.0)  # dS columns past the rank are zeros
    at = tl.load(
        a_ptr + (roff + offs_r).to(tl.int64)[:, None] * stride_am + offs_k[None, :],
        mask=r_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    return adapter, rows_in, dst, at


@triton.jit
def _routed_dsa(
    ds_ptr,
    a_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    thr_ptr,
    inv_keep_ptr,
    seed_ptr,
    pid_m,
    offs_m,
    k_start,
    K,
    stride_dsm,
    stride_am,
    HAS_DROPOUT: tl.constexpr,
    ONE_SEGMENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``keep_a * (dS A_a) / (1 - p_a)`` on row tile ``pid_m`` (fp32 ``[BLOCK_M, BLOCK_N]``), routed per segment.

    ``dS`` (fp32) and ``A`` (the adapters' dtype) enter the dot in ``DTYPE``, the activations' dtype.

    The dropout mask is drawn once for the whole tile with per-row thresholds (rows of different
    segments may have different p). The caller starts its GEMM accumulator from this tile, so only
    one ``[BLOCK_M, BLOCK_N]`` fp32 tile is ever live. As in ``multi_lora_fwd._routed_sb``,
    ``ONE_SEGMENT`` compiles the loop over segments out (and one threshold serves the whole tile).
    """
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = k_start + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    ds_rows = ds_ptr + offs_m.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :]
    seg_lo = tl.load(seg_range_ptr + pid_m * 2)
    if ONE_SEGMENT:
        adapter, _, dst, at = _segment_dsa(
            ds_rows, a_ptr, seg_ptr, rank_ptr, seg_lo, offs_m, offs_k, k_mask, stride_am, BLOCK_R
        )
        lora = tl.dot(dst.to(DTYPE), at.to(DTYPE), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            seed_lo, seed_hi = load_seed(seed_ptr)
            keep = dropout_keep_tile(seed_lo, seed_hi, offs_m, k_start, tl.load(thr_ptr + adapter), BLOCK_N)
            lora = tl.where(keep, lora * tl.load(inv_keep_ptr + adapter), 0.0)
    else:
        lora = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_thr = tl.zeros((BLOCK_M,), dtype=tl.int32)
        row_inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in range(seg_lo, tl.load(seg_range_ptr + pid_m * 2 + 1)):
            adapter, rows_in, dst, at = _segment_dsa(
                ds_rows, a_ptr, seg_ptr, rank_ptr, j, offs_m, offs_k, k_mask, stride_am, BLOCK_R
            )
            lora = tl.dot(dst.to(DTYPE), at.to(DTYPE), lora, input_precision=DOT_PRECISION)
            row_thr = tl.where(rows_in, tl.load(thr_ptr + adapter), row_thr)
            row_inv = tl.where(rows_in, tl.load(inv_keep_ptr + adapter), row_inv)
        if HAS_DROPOUT:
            seed_lo, seed_hi = load_seed(seed_ptr)
            keep = dropout_keep_tile(seed_lo, seed_hi, offs_m, k_start, row_thr[:, None], BLOCK_N)
            lora = tl.where(keep, lora * row_inv[:, None], 0.0)
    return lora


@triton.jit
def _member_dyw_tma(
    acc, dy_desc, w_desc, g, bounds_ptr, off_m, off_k, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """``acc + dy_g W_g``: member ``g``'s own gradient ``[T, N_g]`` times its rows of ``W``.

    Past ``N_g`` the gradient's box is zero-filled, so the rows of ``W`` read there (the next
    member's) add nothing.
    """
    n_lo = tl.load(bounds_ptr + g)
    n_hi = tl.load(bounds_ptr + g + 1)
    for n in range(tl.cdiv(n_hi - n_lo, BLOCK_K)):
        dyt = dy_desc.load([off_m, n * BLOCK_K])
        wt = w_desc.load([n_lo + n * BLOCK_K, off_k])
        acc = tl.dot(dyt, wt, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["T"])
def _multi_lora_dx_kernel(
    dy_ptr,
    w_ptr,
    ds_ptr,
    a_ptr,
    dx_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    thr_ptr,
    inv_keep_ptr,
    seed_ptr,
    T,
    N,
    K,
    stride_dym,
    stride_wn,
    stride_dsm,
    stride_am,
    stride_dxm,
    HAS_DROPOUT: tl.constexpr,
    ONE_SEGMENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """1-D grid over ``[T, K]`` tiles of dx (``BLOCK_N`` wide) in grouped order, N looped in ``BLOCK_K`` steps.

    Block names as in FusedLoRA's ``dyw_dsa``; pointer loads through wrapped rows/columns (any GPU).
    """
    pid_m, pid_k, offs_m, offs_k, rows, cols = wrapped_tile(T, K, BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + offs_n[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    acc = _routed_dsa(
        ds_ptr, a_ptr, seg_ptr, seg_range_ptr, rank_ptr, thr_ptr, inv_keep_ptr, seed_ptr, pid_m, offs_m,
        pid_k * BLOCK_N, K, stride_dsm, stride_am, HAS_DROPOUT, ONE_SEGMENT, BLOCK_M, BLOCK_N, BLOCK_R,
        DOT_PRECISION, dy_ptr.dtype.element_ty,
    )  # fmt: skip
    acc = dot_k_loop(acc, dy_ptrs, w_ptrs, N, 1, stride_wn, BLOCK_K, DOT_PRECISION)
    dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_k[None, :]
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_k[None, :] < K))


@triton.jit(do_not_specialize=["T"])
def _multi_lora_dx_tma_kernel(
    dy_desc,
    dy1_desc,
    dy2_desc,
    dy3_desc,
    w_desc,
    dx_desc,
    ds_ptr,
    a_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    thr_ptr,
    inv_keep_ptr,
    seed_ptr,
    bounds_ptr,
    T,
    N,
    K,
    stride_dsm,
    stride_am,
    HAS_DROPOUT: tl.constexpr,
    ONE_SEGMENT: tl.constexpr,
    MEMBER_DY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """As :func:`_multi_lora_dx_kernel`, with dy, W and dx moved by TMA (sm_90+).

    ``MEMBER_DY > 0``: a sibling call's members' gradients, each its own ``[T, N_g]`` tensor
    (``dy_desc``, ``dy1_desc``, ...; ``bounds_ptr`` their column bounds), reduced one after the other.
    """
    pid_m, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(T, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_k = pid_k * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    acc = _routed_dsa(
        ds_ptr, a_ptr, seg_ptr, seg_range_ptr, rank_ptr, thr_ptr, inv_keep_ptr, seed_ptr, pid_m, offs_m,
        off_k, K, stride_dsm, stride_am, HAS_DROPOUT, ONE_SEGMENT, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION,
        dy_desc.dtype,
    )  # fmt: skip
    if MEMBER_DY > 0:
        acc = _member_dyw_tma(acc, dy_desc, w_desc, 0, bounds_ptr, off_m, off_k, BLOCK_K, DOT_PRECISION)
        if MEMBER_DY > 1:
            acc = _member_dyw_tma(acc, dy1_desc, w_desc, 1, bounds_ptr, off_m, off_k, BLOCK_K, DOT_PRECISION)
        if MEMBER_DY > 2:
            acc = _member_dyw_tma(acc, dy2_desc, w_desc, 2, bounds_ptr, off_m, off_k, BLOCK_K, DOT_PRECISION)
        if MEMBER_DY > 3:
            acc = _member_dyw_tma(acc, dy3_desc, w_desc, 3, bounds_ptr, off_m, off_k, BLOCK_K, DOT_PRECISION)
    else:
        for n in range(tl.cdiv(N, BLOCK_K)):
            dyt = dy_desc.load([off_m, n * BLOCK_K])
            wt = w_desc.load([n * BLOCK_K, off_k])
            acc = tl.dot(dyt, wt, acc, input_precision=DOT_PRECISION)
    dx_desc.store([off_m, off_k], acc.to(dx_desc.dtype))


def member_grads(dy: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``dy`` as the tuple the backward kernels take: ``(dy,)``, or a sibling call's members' gradients."""
    return (dy,) if isinstance(dy, torch.Tensor) else tuple(dy)


def _grad_operands(dys: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor | None], list[int], int]:
    """The kernels' four gradient pointers (unused: None), their row strides, and ``MEMBER_DY``."""
    spare = MAX_MEMBER_OUTPUTS - len(dys)
    return [*dys, *[None] * spare], [d.stride(0) for d in dys] + [0] * spare, len(dys) if len(dys) > 1 else 0


def member_alignment(members: Sequence[int]) -> int:
    """16 where every sibling member's width is a multiple of 16 (then so is every member bound), else 1."""
    return 16 if all(n % 16 == 0 for n in members) else 1


def multi_lora_dys_dyb(
    dy: torch.Tensor | Sequence[torch.Tensor],
    b_cat: torch.Tensor,
    s: torch.Tensor,
    batch: MultiLoRABatch,
    *,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    max_rank: int,
    members: tuple[int, ...] = (),
    bounds: torch.Tensor | None = None,
    ranks_host: tuple[int, ...] = (),
    accumulators: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dS`` and ``dB_cat`` from one read of ``dy``; each program owns a run of one adapter's rows and a column block.

    ``dB_cat`` is summed over runs and ``dS`` over column blocks with fp32 atomics, so the summation
    order varies from run to run; the public op offers a deterministic alternative.

    Args:
        dy: ``[T, N]`` upstream gradient, unit stride along N; or a sibling call's members'
            gradients ``[T, N_g]`` (at most :data:`MAX_MEMBER_OUTPUTS`), each with unit stride along ``N_g``.
        b_cat: ``[N, R_tot]`` stacked B, or a sibling call's 1-D ``B_flat`` (any float dtype, cast to
            ``dy.dtype`` in the kernel).
        s: ``S [T, BLOCK_R]`` saved from the forward.
        batch: Routing metadata of this microbatch.
        ranks: int32 ``[n, 2]``: ``(r_a, roff_a)`` (per member for a sibling call).
        scaling: fp32 ``[n]``.
        max_rank: Largest ``r_a`` (the config lookup key).
        members: Output features of a sibling call's members; empty for one layer.
        bounds: int32 ``[G + 1]``: the members' column bounds (a sibling call only).
        ranks_host: The adapters' ranks ``r_a`` (equal nonzero ranks compile as a constant: :func:`rank_columns`).
        accumulators: Zeroed fp32 ``(dS [T, BLOCK_R], dB)`` (``dB`` shaped as ``b_cat``), contiguous,
            to add into (see :func:`~lorafusion_kernels._kernels._common.zeroed_fp32`, which lets the
            caller share one fill with its other accumulators); None allocates them.
        config: Launch config; looked up by shape when None. ``block_m`` rows by ``block_n`` columns
            per step; runs sized as FusedLoRA's row groups (``split``, 0: sized to the GPU).

    Returns:
        ``(dS fp32 [T, BLOCK_R], dB fp32)``, ``dB`` shaped as ``b_cat``. ``dS`` columns past a token's
        (stacked) rank are zeros: readers load whole rows.
    """
    dys = member_grads(dy)
    first = dys[0]
    T, N = first.shape[0], sum(d.shape[1] for d in dys)
    siblings = bool(members)
    if accumulators is None:
        _, (ds, db) = zeroed_fp32((T, s.shape[1]), (1, b_cat.numel()), device=first.device)
        db = db.view(b_cat.shape)
    else:
        ds, db = accumulators
    cfg = config or launch_config(DY_KERNEL, first, m=T, n=N, k=N, r=max_rank)
    group = max(1, len(members))
    col_blocks = cdiv(max(members) if siblings else N, cfg.block_n)
    run_rows = rows_per_group(cfg.split, first, rows=T, block_m=cfg.block_m, col_blocks=col_blocks * group)
    runs = batch.segment_runs(run_rows)
    grads, grad_strides, member_dy = _grad_operands(dys)
    if runs.num_runs > 0:
        launch_fitting(
            _multi_lora_dy_kernel,
            (runs.num_runs, col_blocks, group),
            *grads,
            b_cat,
            s,
            ds,
            db,
            runs.runs,
            ranks,
            scaling,
            bounds if bounds is not None else ranks,
            N,
            *grad_strides,
            0 if siblings else b_cat.stride(0),
            s.stride(0),
            ds.stride(0),
            0 if siblings else db.stride(0),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_R=rank_block(max_rank) if siblings else s.shape[1],
            SIBLINGS=siblings,
            UNIFORM_RANK=uniform_rank(ranks_host),
            MEMBER_DY=member_dy,
            MEMBER_ALIGN=member_alignment(members),
            ATOMIC_DS=col_blocks > 1,
            DOT_PRECISION=dot_precision(first.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return ds, db


def multi_lora_dsx(
    ds: torch.Tensor,
    x: torch.Tensor,
    batch: MultiLoRABatch,
    *,
    r_tot: int,
    max_rank: int,
    ranks: torch.Tensor,
    thresholds: torch.Tensor,
    inv_keep: torch.Tensor,
    seed: torch.Tensor,
    has_dropout: bool,
    out_dtype: torch.dtype | None = None,
    deterministic: bool = False,
    lora_dx: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``dA_cat [R_tot, K]``: adapter ``a``'s rows summed over its own tokens only.

    Each adapter's rows are cut into runs of one length (chosen for about two programs per SM over
    all column blocks), so an adapter with most of the tokens does not leave the other programs
    idle. Config fields as FusedLoRA's ``dsx``: ``block_m`` rows per step, ``block_n`` columns of
    ``dA`` per program (``split`` is not used).

    Args:
        ds: fp32 ``[T, BLOCK_R]`` from :func:`multi_lora_dys_dyb`.
        x: ``[T, K]`` the forward input (the dropout mask is regenerated from ``seed``).
        batch: Routing metadata of this microbatch.
        r_tot: Rows of ``dA_cat`` (sum of ranks).
        max_rank: Largest ``r_a`` (the config lookup key).
        ranks: int32 ``[n, 2]``: ``(r_a, roff_a)``.
        thresholds: int32 ``[n]``.
        inv_keep: fp32 ``[n]``.
        seed: int64 ``[1]``.
        has_dropout: Whether any adapter has ``p > 0``.
        out_dtype: dtype of ``dA_cat`` (that of the stacked A); None means ``x.dtype``.
        deterministic: Sum the runs in a fixed order (fp32 partials per run) instead of adding
            them with atomics, whose order varies from run to run.
        lora_dx: ``(A_cat, dx)``: also write ``dx [T, K]`` (x's dtype, unit stride along K) with the
            LoRA term of the input gradient, ``keep_a * (dS A_a) / (1 - p_a)``, every element, from
            the mask this pass draws anyway; ``dx.addmm_(dy, W)`` then completes the gradient.
        out: A zeroed, contiguous fp32 ``[R_tot, K]`` to add ``dA_cat`` into (not deterministic; then
            ``out_dtype`` is ignored and ``out`` is returned); None allocates one.
        config: Launch config; looked up by shape when None.

    Returns:
        ``dA_cat`` in ``out_dtype``, or ``out``; an adapter without tokens gets zeros.
    """
    T, K = x.shape
    out_dtype = out_dtype or x.dtype
    # Writing dx's LoRA term ([T, K] more bytes out) changes the best tiles: a kernel name of its own.
    # Deterministic sums take DA_KERNEL's tiles either way, so dA's bits do not depend on whether the
    # call also writes dx (a layer whose input needs no gradient rounds as one whose input does).
    kernel = DA_DX_KERNEL if lora_dx is not None and not deterministic else DA_KERNEL
    cfg = config or launch_config(kernel, x, m=T, n=max_rank, k=K, r=max_rank)
    col_tiles = cdiv(K, cfg.block_n)
    runs = batch.segment_runs(_run_tiles(x, cdiv(T, cfg.block_m), col_tiles) * cfg.block_m)
    if deterministic and out is not None:
        raise LoRAFusionKernelsError("multi_lora_dsx: out= takes atomic sums; pass deterministic=False or no out")
    given = out is not None
    if out is None:
        shape = (runs.num_runs, r_tot, K) if deterministic else (r_tot, K)
        out = torch.zeros(shape, dtype=torch.float32, device=x.device)
    a_cat, dx = lora_dx if lora_dx is not None else (None, None)
    if runs.num_runs > 0 and r_tot > 0:
        launch_fitting(
            _multi_lora_da_kernel,
            (col_tiles, runs.num_runs),
            ds,
            x,
            out,
            a_cat,
            dx,
            runs.runs,
            ranks,
            thresholds,
            inv_keep,
            seed,
            K,
            ds.stride(0),
            x.stride(0),
            out.stride(0) if deterministic else 0,
            out.stride(-2),
            a_cat.stride(0) if a_cat is not None else 0,
            dx.stride(0) if dx is not None else 0,
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_n,
            BLOCK_R=ds.shape[1],
            HAS_DROPOUT=has_dropout,
            ATOMIC_OUT=not deterministic,
            LORA_DX=dx is not None,
            DOT_PRECISION=dot_precision(x.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    elif dx is not None:
        dx.zero_()
    if deterministic:
        out = out.sum(dim=0)
    return out if given or out_dtype == torch.float32 else out.to(out_dtype)


def _run_tiles(t: torch.Tensor, row_tiles: int, col_tiles: int) -> int:
    """Row tiles per run of the ``dA`` pass: about two programs per SM (the interpreter: 2 tiles)."""
    if not t.is_cuda:
        return 2
    return max(1, cdiv(row_tiles * col_tiles, 2 * sm_count(t)))


def multi_lora_dyw_dsa(
    dy: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    ds: torch.Tensor,
    a_cat: torch.Tensor,
    batch: MultiLoRABatch,
    *,
    max_rank: int,
    ranks: torch.Tensor,
    thresholds: torch.Tensor,
    inv_keep: torch.Tensor,
    seed: torch.Tensor,
    has_dropout: bool,
    bounds: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``dx [T, K] = dy W + keep_a * (dS A_a) / (1 - p_a)`` in one GEMM, the LoRA term routed per segment.

    Config fields as FusedLoRA's ``dyw_dsa``: ``block_n`` columns of dx per tile, ``block_k`` the
    reduction step over N. Gradients per member take the TMA kernel whatever the config says.

    Args:
        dy: ``[T, N]``, unit stride along N; or a sibling call's members' gradients ``[T, N_g]``
            (see :func:`multi_lora_dys_dyb`), with ``bounds``.
        weight: ``[N, K]`` frozen weight, unit stride along K.
        ds: fp32 ``[T, BLOCK_R]``.
        a_cat: ``[R_tot, K]`` stacked A (any float dtype, cast to ``dy.dtype`` in the kernel).
        batch: Routing metadata of this microbatch.
        max_rank: Largest ``r_a`` (the config lookup key).
        ranks: int32 ``[n, 2]``.
        thresholds: int32 ``[n]``.
        inv_keep: fp32 ``[n]``.
        seed: int64 ``[1]``.
        has_dropout: Whether any adapter has ``p > 0``.
        bounds: int32 ``[G + 1]``: the members' column bounds when ``dy`` is per member.
        config: Launch config; looked up by shape when None.

    Returns:
        ``dx`` in ``dy.dtype``.
    """
    dys = member_grads(dy)
    first = dys[0]
    T, N = first.shape[0], weight.shape[0]
    K = weight.shape[1]
    block_r = ds.shape[1]
    dx = torch.empty((T, K), dtype=first.dtype, device=first.device)
    if T == 0:
        return dx
    cfg = config or launch_config(DX_KERNEL, first, m=T, n=N, k=K, r=max_rank)
    rows = batch.row_tiles(cfg.block_m)
    grid = (rows.num_tiles * cdiv(K, cfg.block_n),)
    meta = gemm_meta(cfg, block_r=block_r, dtype=first.dtype)
    routing = (batch.segments, rows.seg_range, ranks, thresholds, inv_keep, seed)
    flags = {"HAS_DROPOUT": has_dropout, "ONE_SEGMENT": rows.max_segments == 1}
    # Everything the compiled variant depends on besides ONE_SEGMENT (and T, which is not specialised).
    key = (cfg, first.dtype, ds.dtype, a_cat.dtype, N, K, has_dropout)
    # Members' gradients are reduced where they are by the TMA kernel only (one reduction loop per
    # member: in the pointer kernel that ran 3x slower, measured on H100); else side by side.
    members_apart = len(dys) > 1 and tma_ok(*dys, weight, dx)
    if not members_apart and len(dys) > 1:
        dys = (torch.cat(dys, dim=1),)
    if members_apart or (cfg.tma and tma_ok(dys[0], weight, dx)):
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = [TensorDescriptor.from_tensor(d, [cfg.block_m, cfg.block_k]) for d in dys]
        tma_args = (
            *descs, *[None] * (MAX_MEMBER_OUTPUTS - len(descs)),
            TensorDescriptor.from_tensor(weight, [cfg.block_k, cfg.block_n]),
            TensorDescriptor.from_tensor(dx, [cfg.block_m, cfg.block_n]),
            ds, a_cat, *routing, bounds if members_apart else ranks, T, N, K, ds.stride(0), a_cat.stride(0),
        )  # fmt: skip
        member_dy = len(dys) if members_apart else 0
        launch_warming_layout_variant(
            _multi_lora_dx_tma_kernel, grid, tma_args, {**flags, "MEMBER_DY": member_dy, **meta},
            flag="ONE_SEGMENT", key=(*key, member_dy),
        )  # fmt: skip
        return dx
    args = (
        dys[0], weight, ds, a_cat, dx, *routing, T, N, K,
        dys[0].stride(0), weight.stride(0), ds.stride(0), a_cat.stride(0), dx.stride(0),
    )  # fmt: skip
    launch_warming_layout_variant(_multi_lora_dx_kernel, grid, args, {**flags, **meta}, flag="ONE_SEGMENT", key=key)
    return dx
