"""FusedMultiLoRA forward kernels: per-adapter dropout + shrink, and the shared GEMM with routed LoRA.

Shapes: ``x [T, K]`` packed tokens, ``W [N, K]``, stacked adapters ``A_cat [R_tot, K]`` (adapter ``a``
owns rows ``roff_a .. roff_a + r_a``) and ``B_cat [N, R_tot]`` (columns likewise), ``S [T, BLOCK_R]``.
Token ``t`` of adapter ``a = a(t)``:

    S[t, :r_a] = (keep_a(t, :) * x[t, :]) A_a^T / (1 - p_a)               (shrink, one adapter per tile)
    y[t, :]    = x[t, :] W^T + bias + scaling_a * S[t, :r_a] B_a^T          (one GEMM, one accumulator)

``S = x_hat A_a^T`` is FusedLoRA's split point, rounded once to x's dtype; ``scaling_a`` is applied in
fp32 in the GEMM, never stored in ``S``, so in fp16 ``S`` overflows where PEFT's ``lora_A`` output does.

Sibling calls (``G`` layers that read one ``x``, e.g. q/k/v, as one call): ``W`` stacks the members'
weights by rows, member ``g`` owning columns ``n_g .. n_{g+1}`` of ``y``; each adapter's ``A`` stacks
its members' ``A_{a,g}`` (rank ``G r_a``: ``S[t, g r_a : (g+1) r_a]`` is member ``g``'s), and its ``B``
is its members' ``B_{a,g} [N_g, r_a]`` stacked by rows into ``[N, r_a]`` at flat offset ``N roff_a`` of
``B_flat`` (``roff_a`` = sum of the earlier adapters' ``r``). A column tile of member ``g`` reads only
``S[:, g r_a : (g+1) r_a]`` and ``B_{a,g}``: the rank-``r_a`` work of one layer, not ``G r_a``.

Routing tables come from :class:`lorafusion_kernels.metadata.MultiLoRABatch`; per-adapter
``(r_a, roff_a)`` come as an int32 ``[n, 2]`` table, ``scaling_a`` and ``1 / (1 - p_a)`` (fp32) and
``ceil(p_a * 2**16)`` (int32) as ``[n]`` vectors, so no value is rounded to the activation dtype and
none is a constexpr.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafusion_kernels._kernels import lora_xa, lora_xw_sb
from lorafusion_kernels._kernels._common import (
    cdiv,
    dot_k_loop,
    dot_precision,
    gemm_meta,
    grouped_tile,
    launch_config,
    launch_fitting,
    launch_warming_layout_variant,
    partial_stride,
    rank_block,
    reduce_split_output,
    split_output,
    split_reduction,
    tma_ok,
    wrapped_tile,
)
from lorafusion_kernels._kernels.dropout import load_kept_tile
from lorafusion_kernels._kernels.routing import (
    adapter_dropout,
    member_rank,
    member_span,
    segment_rows,
    segment_tile,
    uniform_rank,
)
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.tuning.config import KernelConfig, register_fallback

# Config names of the two kernels. They tile as FusedLoRA's "xa" and "xw_sb" (only the rank-r term is
# routed), so where a config file has no entry of their own for a shape they use FusedLoRA's.
SHRINK_KERNEL = "multi_xa"
LINEAR_KERNEL = "multi_xw_sb"
register_fallback(SHRINK_KERNEL, lora_xa.KERNEL)
register_fallback(LINEAR_KERNEL, lora_xw_sb.KERNEL)


@triton.jit
def _multi_lora_shrink_kernel(
    x_ptr,
    a_ptr,
    s_ptr,
    tiles_ptr,
    rank_ptr,
    thr_ptr,
    inv_keep_ptr,
    seed_ptr,
    K,
    k_per_split,
    stride_xm,
    stride_am,
    stride_ss,
    stride_sm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_segment_tiles, split)``: program ``(i, s)`` reduces columns ``[s * k_per_split, ...)``."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    adapter, roff, offs_m, m_mask, offs_r, r_mask = segment_tile(tiles_ptr, rank_ptr, pid, BLOCK_M, BLOCK_R)
    offs_k0 = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    a_rows = a_ptr + (roff + offs_r).to(tl.int64)[None, :] * stride_am
    seed_lo, seed_hi, thr = adapter_dropout(seed_ptr, thr_ptr, adapter, HAS_DROPOUT)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + offs_k0
        k_mask = offs_k < k_end
        xt = load_kept_tile(
            x_rows + offs_k[None, :], seed_lo, seed_hi, offs_m, k0, thr, HAS_DROPOUT, BLOCK_K,
            mask=m_mask[:, None] & k_mask[None, :],
        )  # fmt: skip
        at = tl.load(a_rows + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xt, at.to(xt.dtype), acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(inv_keep_ptr + adapter)
    s_ptrs = s_ptr + pid_s * stride_ss + offs_m.to(tl.int64)[:, None] * stride_sm + offs_r[None, :]
    tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _routed_sb(
    s_ptr,
    b_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    scaling_ptr,
    pid_m,
    offs_m,
    cols,
    stride_sm,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ONE_SEGMENT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The fp32 tile the GEMM starts from: ``scaling_a S[rows of a] B_a^T`` over the segments of row tile ``pid_m``.

    One small dot per segment, accumulated onto a zeroed tile in a loop (rows outside a segment load
    zeros), then each row times its adapter's ``scaling_a``: the segments' rows are disjoint, so one
    per-row factor after the loop scales each exactly once. ``ONE_SEGMENT`` (no tile straddles a segment
    boundary) compiles the loop out: one dot and one scalar factor make the tile. With the loop the
    forward GEMM ran up to 19% slower at rank 64 (H100, 2026-11-26). A first dot ahead of the loop (for
    any batch) was nearly as fast, but its operands took shared memory a second time and the dx GEMM's
    4-stage configs ran out of it. Only one ``[BLOCK_M, BLOCK_N]`` fp32 tile is live (a second one
    spilled registers on H100 and made the forward 7x slower). ``cols`` are valid (wrapped) columns.
    """
    offs_r = tl.arange(0, BLOCK_R)
    s_rows = s_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + offs_r[None, :]
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + offs_r[:, None]
    seg_lo = tl.load(seg_range_ptr + pid_m * 2)
    if ONE_SEGMENT:
        adapter, rows_in, st, bt = _segment_sb(s_rows, b_cols, seg_ptr, rank_ptr, seg_lo, offs_m, offs_r)
        acc = tl.dot(st, bt, input_precision=DOT_PRECISION) * tl.load(scaling_ptr + adapter)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_scaling = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in range(seg_lo, tl.load(seg_range_ptr + pid_m * 2 + 1)):
            adapter, rows_in, st, bt = _segment_sb(s_rows, b_cols, seg_ptr, rank_ptr, j, offs_m, offs_r)
            acc = tl.dot(st, bt, acc, input_precision=DOT_PRECISION)
            row_scaling = tl.where(rows_in, tl.load(scaling_ptr + adapter), row_scaling)
        acc = acc * row_scaling[:, None]
    return acc


@triton.jit
def _segment_sb(s_rows, b_cols, seg_ptr, rank_ptr, segment, offs_m, offs_r):
    """Segment ``segment`` on a tile: ``(adapter, its rows, S rows (others zero), B_a^T columns in S's dtype)``."""
    adapter, roff, rows_in, r_mask = segment_rows(seg_ptr, rank_ptr, segment, offs_m, offs_r)
    st = tl.load(s_rows, mask=rows_in[:, None] & r_mask[None, :], other=0.0)
    bt = tl.load(b_cols + roff, mask=r_mask[:, None], other=0.0)
    return adapter, rows_in, st, bt.to(st.dtype)


@triton.jit
def _routed_sb_siblings(
    acc,
    s_ptr,
    b_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    scaling_ptr,
    bounds_ptr,
    num_members,
    pid_m,
    offs_m,
    off_n,
    cols,
    N,
    stride_sm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UNIFORM_RANK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`_routed_sb` of a sibling call, added onto ``acc`` (which holds ``x W^T``).

    Per segment, one dot per member overlapping the column tile. ``BLOCK_R`` covers one member's rank
    ``r_a`` (not ``G r_a``); member ``g``'s dot reads ``S[rows, g r_a + j]`` and ``B_flat[N roff_a + n
    r_a + j]`` for its own columns ``n`` only. ``UNIFORM_RANK`` (see :func:`uniform_rank`) makes the row
    stride of ``B_flat`` a constant. ``scaling_a`` cannot multiply the dots' sum here, as ``acc``
    already holds ``x W^T``: each row is divided by its ``scaling_a`` before the dots and multiplied
    after (two fp32 roundings of ``x W^T``, relative ``2**-23``; a second ``[BLOCK_M, BLOCK_N]`` tile
    would spill registers). Rows of an adapter with ``scaling_a = 0`` are left alone and skip their
    dots.
    """
    offs_r = tl.arange(0, BLOCK_R)
    s_rows = s_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + offs_r[None, :]
    g_lo, g_hi = member_span(bounds_ptr, num_members, off_n, off_n + BLOCK_N)
    seg_lo = tl.load(seg_range_ptr + pid_m * 2)
    seg_hi = tl.load(seg_range_ptr + pid_m * 2 + 1)
    row_scaling = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in range(seg_lo, seg_hi):
        adapter, _, rows_in, _ = segment_rows(seg_ptr, rank_ptr, j, offs_m, offs_r)
        row_scaling = tl.where(rows_in, tl.load(scaling_ptr + adapter), row_scaling)
    scaled = row_scaling != 0.0
    row_scaling = tl.where(scaled, row_scaling, 1.0)
    acc = acc * (1.0 / row_scaling)[:, None]
    for j in range(seg_lo, seg_hi):
        adapter, roff, rows_in, r_mask = segment_rows(seg_ptr, rank_ptr, j, offs_m, offs_r)
        rows_in = rows_in & scaled
        r = member_rank(rank_ptr, adapter, UNIFORM_RANK)
        b_cols = b_ptr + roff.to(tl.int64) * N + cols.to(tl.int64)[None, :] * r + offs_r[:, None]
        for g in range(g_lo, g_hi):
            in_g = (cols >= tl.load(bounds_ptr + g)) & (cols < tl.load(bounds_ptr + g + 1))
            st = tl.load(s_rows + g * r, mask=rows_in[:, None] & r_mask[None, :], other=0.0)
            bt = tl.load(b_cols, mask=r_mask[:, None] & in_g[None, :], other=0.0)
            acc = tl.dot(st, bt.to(st.dtype), acc, input_precision=DOT_PRECISION)
    return acc * row_scaling[:, None]


@triton.jit(do_not_specialize=["T"])
def _multi_lora_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    scaling_ptr,
    bounds_ptr,
    num_members,
    T,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sm,
    stride_bn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SIBLINGS: tl.constexpr,
    UNIFORM_RANK: tl.constexpr,
    ONE_SEGMENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """1-D grid over ``[T, N]`` output tiles in grouped order; pointer loads through wrapped rows/columns."""
    pid_m, pid_n, offs_m, offs_n, rows, cols = wrapped_tile(T, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    if SIBLINGS:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = _routed_sb(
            s_ptr, b_ptr, seg_ptr, seg_range_ptr, rank_ptr, scaling_ptr, pid_m, offs_m, cols, stride_sm, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_R, ONE_SEGMENT, DOT_PRECISION,
        )  # fmt: skip
    acc = dot_k_loop(acc, x_ptrs, w_ptrs, K, 1, 1, BLOCK_K, DOT_PRECISION)
    if SIBLINGS:
        acc = _routed_sb_siblings(
            acc, s_ptr, b_ptr, seg_ptr, seg_range_ptr, rank_ptr, scaling_ptr, bounds_ptr, num_members, pid_m,
            offs_m, pid_n * BLOCK_N, cols, N, stride_sm, BLOCK_M, BLOCK_N, BLOCK_R, UNIFORM_RANK, DOT_PRECISION,
        )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < N))


@triton.jit
def _store_member_tile(
    tile, off_m, off_n, bounds_ptr, num_members, y0_desc, y1_desc, y2_desc, y3_desc, MEMBER_OUT: tl.constexpr
):
    """Store an output tile of the stacked columns into its member's own ``[T, N_g]`` output.

    Every member's width is a multiple of ``BLOCK_N`` (the host checks), so a tile lies in one member
    ``g`` and goes to columns ``off_n - n_g ..`` of ``y_g``; ``MEMBER_OUT`` descriptors are passed.
    """
    g, _ = member_span(bounds_ptr, num_members, off_n, off_n + 1)
    col = off_n - tl.load(bounds_ptr + g)
    if g == 0:
        y0_desc.store([off_m, col], tile)
    # Nested, not `and`: the constexpr test must drop the branch (its descriptor may be None).
    if MEMBER_OUT > 1:  # noqa: SIM102
        if g == 1:
            y1_desc.store([off_m, col], tile)
    if MEMBER_OUT > 2:  # noqa: SIM102
        if g == 2:
            y2_desc.store([off_m, col], tile)
    if MEMBER_OUT > 3:  # noqa: SIM102
        if g == 3:
            y3_desc.store([off_m, col], tile)


@triton.jit(do_not_specialize=["T"])
def _multi_lora_linear_tma_kernel(
    x_desc,
    w_desc,
    y_desc,
    y1_desc,
    y2_desc,
    y3_desc,
    bias_ptr,
    s_ptr,
    b_ptr,
    seg_ptr,
    seg_range_ptr,
    rank_ptr,
    scaling_ptr,
    bounds_ptr,
    num_members,
    T,
    N,
    K,
    stride_sm,
    stride_bn,
    HAS_BIAS: tl.constexpr,
    SIBLINGS: tl.constexpr,
    UNIFORM_RANK: tl.constexpr,
    ONE_SEGMENT: tl.constexpr,
    MEMBER_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """As :func:`_multi_lora_linear_kernel`, with x, W and y moved by TMA (sm_90+).

    Out-of-bounds boxes are zero-filled on load and clipped on store, so the GEMM needs no masks.
    ``MEMBER_OUT > 0`` (a sibling call): ``y_desc``, ``y1_desc``, ... are the members' own outputs
    (:func:`_store_member_tile`); otherwise ``y_desc`` is the one ``[T, N]`` output.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    cols = (off_n + tl.arange(0, BLOCK_N)) % N
    if SIBLINGS:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = _routed_sb(
            s_ptr, b_ptr, seg_ptr, seg_range_ptr, rank_ptr, scaling_ptr, pid_m, offs_m, cols, stride_sm, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_R, ONE_SEGMENT, DOT_PRECISION,
        )  # fmt: skip
    for k in range(tl.cdiv(K, BLOCK_K)):
        xt = x_desc.load([off_m, k * BLOCK_K])
        wt = w_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(xt, wt.T, acc, input_precision=DOT_PRECISION)
    if SIBLINGS:
        # After the K loop: ahead of it, the members' loop delayed the TMA pipeline (gate/up +25%).
        acc = _routed_sb_siblings(
            acc, s_ptr, b_ptr, seg_ptr, seg_range_ptr, rank_ptr, scaling_ptr, bounds_ptr, num_members, pid_m,
            offs_m, off_n, cols, N, stride_sm, BLOCK_M, BLOCK_N, BLOCK_R, UNIFORM_RANK, DOT_PRECISION,
        )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    tile = acc.to(s_ptr.dtype.element_ty)
    if MEMBER_OUT > 0:
        _store_member_tile(tile, off_m, off_n, bounds_ptr, num_members, y_desc, y1_desc, y2_desc, y3_desc, MEMBER_OUT)
    else:
        y_desc.store([off_m, off_n], tile)


def multi_lora_shrink(
    x: torch.Tensor,
    a_cat: torch.Tensor,
    batch: MultiLoRABatch,
    *,
    block_r: int,
    max_rank: int,
    ranks: torch.Tensor,
    thresholds: torch.Tensor,
    inv_keep: torch.Tensor,
    seed: torch.Tensor,
    has_dropout: bool,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``S[t, :r_a] = (keep_a * x[t]) A_a^T / (1 - p_a)`` for every token, one adapter per tile.

    Args:
        x: ``[T, K]`` packed activations, unit stride along K.
        a_cat: ``[R_tot, K]`` stacked adapter A matrices (any float dtype, cast to ``x.dtype`` in the
            kernel), unit stride along K.
        batch: Routing metadata of this microbatch (tables on ``x``'s device).
        block_r: Rank tile (power of two >= every ``r_a``, at least 16): the width of ``S``.
        max_rank: Largest ``r_a`` (the config lookup key).
        ranks: int32 ``[n, 2]``: ``(r_a, roff_a)``.
        thresholds: int32 ``[n]``: ``ceil(p_a * 2**16)``.
        inv_keep: fp32 ``[n]``: ``1 / (1 - p_a)``.
        seed: int64 ``[1]`` dropout seed (read only with dropout).
        has_dropout: Whether any adapter has ``p > 0`` (otherwise no RNG is compiled in).
        config: Launch config; looked up by shape when None.

    Returns:
        ``S [T, block_r]`` in ``x.dtype``; columns ``>= r_a`` of adapter ``a``'s rows are zero. A split
        of K writes fp32 partials that are summed in a fixed order (deterministic).
    """
    T, K = x.shape
    cfg = config or launch_config(SHRINK_KERNEL, x, m=T, n=max_rank, k=K, r=max_rank)
    tiles = batch.segment_tiles(cfg.block_m)
    split, k_per_split = split_reduction(cfg.split, x, tiles=tiles.num_tiles, length=K, block=cfg.block_k)
    s = split_output(split, (T, block_r), x.dtype, x.device)
    if tiles.num_tiles > 0:
        launch_fitting(
            _multi_lora_shrink_kernel,
            (tiles.num_tiles, split),
            x,
            a_cat,
            s,
            tiles.tiles,
            ranks,
            thresholds,
            inv_keep,
            seed,
            K,
            k_per_split,
            x.stride(0),
            a_cat.stride(0),
            partial_stride(s),
            s.stride(-2),
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k,
            BLOCK_R=block_r,
            HAS_DROPOUT=has_dropout,
            DOT_PRECISION=dot_precision(x.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return reduce_split_output(s, x.dtype)


def multi_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    b_cat: torch.Tensor,
    batch: MultiLoRABatch,
    *,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    max_rank: int,
    bounds: torch.Tensor | None = None,
    ranks_host: tuple[int, ...] = (),
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``y [T, N] = x W^T + bias + scaling_a S B_a^T``, the LoRA term routed per segment (and member).

    Args:
        x: ``[T, K]``, unit stride along K.
        weight: ``[N, K]`` frozen weight, unit stride along K.
        bias: ``[N]`` or None.
        s: ``S [T, BLOCK_R]`` from :func:`multi_lora_shrink`.
        b_cat: ``[N, R_tot]`` stacked adapter B matrices, unit stride along R; for a sibling call
            ``B_flat``, 1-D (module docstring). Any float dtype, cast to ``x.dtype`` in the kernel.
        batch: Routing metadata of this microbatch.
        ranks: int32 ``[n, 2]``: ``(r_a, roff_a)`` (per member for a sibling call).
        scaling: fp32 ``[n]``: ``scaling_a``.
        max_rank: Largest ``r_a`` (the config lookup key).
        bounds: int32 ``[G + 1]`` members' column bounds of a sibling call; None for one layer.
        ranks_host: The adapters' ranks ``r_a`` (a sibling call: equal nonzero ranks compile as a constant).
        config: Launch config; looked up by shape when None.

    Returns:
        ``y [T, N]`` in ``x.dtype``.
    """
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    cfg = config or launch_config(LINEAR_KERNEL, x, m=x.shape[0], n=weight.shape[0], k=x.shape[1], r=max_rank)
    _launch_linear(x, weight, bias, s, b_cat, batch, (y,), cfg, ranks, scaling, max_rank, bounds, ranks_host)
    return y


MAX_MEMBER_OUTPUTS = 4
"""Most members whose outputs :func:`multi_lora_linear_members` writes apart (one TMA descriptor each)."""


def member_outputs_fit(x: torch.Tensor, weight: torch.Tensor, members: tuple[int, ...], max_rank: int) -> bool:
    """Whether :func:`multi_lora_linear_members` can write this sibling call's outputs apart.

    It needs the TMA kernel (an sm_90 config with ``tma``, aligned operands), 2 to
    :data:`MAX_MEMBER_OUTPUTS` members and every member's width a multiple of the config's
    ``block_n`` (so no output tile straddles two members).
    """
    T, K = x.shape
    if T == 0 or not 1 < len(members) <= MAX_MEMBER_OUTPUTS:
        return False
    cfg = launch_config(LINEAR_KERNEL, x, m=T, n=weight.shape[0], k=K, r=max_rank)
    return cfg.tma and all(n % cfg.block_n == 0 for n in members) and tma_ok(x, weight)


def multi_lora_linear_members(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    b_flat: torch.Tensor,
    batch: MultiLoRABatch,
    *,
    members: tuple[int, ...],
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    max_rank: int,
    bounds: torch.Tensor,
    ranks_host: tuple[int, ...],
) -> tuple[torch.Tensor, ...]:
    """A sibling call's :func:`multi_lora_linear`, each member's ``y_g [T, N_g]`` its own contiguous tensor.

    The model's next operations (rotary embeddings on q/k, SiLU on gate, ...) then read dense
    tensors rather than column views with the row stride ``N``. Call only where
    :func:`member_outputs_fit` holds. Arguments as :func:`multi_lora_linear`; ``members`` are the
    ``N_g``.
    """
    T, K = x.shape
    cfg = launch_config(LINEAR_KERNEL, x, m=T, n=weight.shape[0], k=K, r=max_rank)
    outputs = tuple(torch.empty((T, n), dtype=x.dtype, device=x.device) for n in members)
    _launch_linear(x, weight, bias, s, b_flat, batch, outputs, cfg, ranks, scaling, max_rank, bounds, ranks_host)
    return outputs


def _launch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    b_cat: torch.Tensor,
    batch: MultiLoRABatch,
    outputs: tuple[torch.Tensor, ...],
    cfg: KernelConfig,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    max_rank: int,
    bounds: torch.Tensor | None,
    ranks_host: tuple[int, ...],
) -> None:
    """Launches the linear into ``outputs``: one ``[T, N]`` tensor, or each member's (TMA kernel only)."""
    T, K = x.shape
    N = weight.shape[0]
    if T == 0:
        return
    siblings = bounds is not None
    block_r = rank_block(max_rank) if siblings else s.shape[1]
    rows = batch.row_tiles(cfg.block_m)
    grid = (rows.num_tiles * cdiv(N, cfg.block_n),)
    meta = gemm_meta(cfg, block_r=block_r, dtype=x.dtype)
    y = outputs[0]
    lora = (bias.contiguous() if bias is not None else y, s, b_cat)  # the kernels read the bias at unit stride
    members = (bounds, bounds.numel() - 1) if bounds is not None else (ranks, 1)
    routing = (batch.segments, rows.seg_range, ranks, scaling, *members, T, N, K)
    flags = {
        "HAS_BIAS": bias is not None,
        "SIBLINGS": siblings,
        "UNIFORM_RANK": uniform_rank(ranks_host),
        "ONE_SEGMENT": rows.max_segments == 1 and not siblings,  # the sibling routing always loops
    }
    stride_bn = 0 if siblings else b_cat.stride(0)
    # What the compiled variant depends on besides ONE_SEGMENT (T is not specialised); siblings never flip it.
    key = None if siblings else (cfg, x.dtype, s.dtype, b_cat.dtype, N, K, bias is not None, flags["UNIFORM_RANK"])
    if len(outputs) > 1 or (cfg.tma and tma_ok(x, weight, y)):
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = [TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n]) for out in outputs]
        spare = [None] * (MAX_MEMBER_OUTPUTS - len(descs))
        tma_args = (
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
            *descs, *spare, *lora, *routing, s.stride(0), stride_bn,
        )  # fmt: skip
        tma_kwargs = {"MEMBER_OUT": len(outputs) if len(outputs) > 1 else 0, **flags, **meta}
        launch_warming_layout_variant(
            _multi_lora_linear_tma_kernel, grid, tma_args, tma_kwargs, flag="ONE_SEGMENT", key=key
        )
        return
    args = (x, weight, *lora, y, *routing, x.stride(0), weight.stride(0), s.stride(0), stride_bn, y.stride(0))
    launch_warming_layout_variant(_multi_lora_linear_kernel, grid, args, {**flags, **meta}, flag="ONE_SEGMENT", key=key)
