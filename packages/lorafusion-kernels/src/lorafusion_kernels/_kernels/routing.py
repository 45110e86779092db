"""Reading a multi-adapter microbatch's routing tables inside the FusedMultiLoRA kernels.

The tables (:class:`lorafusion_kernels.metadata.MultiLoRABatch`, and the per-call adapter tables of
:mod:`lorafusion_kernels.multi_lora`) are int32 rows: a segment tile or a run of one adapter's rows
is ``(row0, row1, adapter)``, a segment ``(start, length, adapter)``, an adapter's rank entry
``(r_a, roff_a)``: its rank and its first row in the stacked ``A_cat`` (first column in ``B_cat``).
Sibling calls (several layers that read one input, e.g. q/k/v, as one call) add the members'
column bounds ``[G + 1]``: member ``g`` owns output columns ``bounds[g] .. bounds[g + 1]``. The
helpers inline into the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lorafusion_kernels._kernels.dropout import load_seed


@triton.jit
def adapter_rank(rank_ptr, adapter):
    """``(r_a, roff_a)`` of ``adapter``."""
    r = tl.load(rank_ptr + adapter * 2)
    roff = tl.load(rank_ptr + adapter * 2 + 1)
    return r, roff


@triton.jit
def segment_tile(tiles_ptr, rank_ptr, tile, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Segment tile ``tile`` (one adapter's rows): its adapter, rows and rank columns.

    Returns:
        ``(adapter, roff, offs_m, m_mask, offs_r, r_mask)``: ``offs_m [BLOCK_M]`` rows from the
        tile's first, ``m_mask`` those inside it, ``offs_r [BLOCK_R]`` and ``r_mask = offs_r < r_a``.
    """
    row0 = tl.load(tiles_ptr + tile * 3)
    row1 = tl.load(tiles_ptr + tile * 3 + 1)
    adapter = tl.load(tiles_ptr + tile * 3 + 2)
    r, roff = adapter_rank(rank_ptr, adapter)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row1
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < r
    return adapter, roff, offs_m, m_mask, offs_r, r_mask


@triton.jit
def segment_run(runs_ptr, run):
    """Run ``run`` of a :class:`~lorafusion_kernels.metadata.SegmentRuns` table: ``(row0, row1, adapter)``."""
    row0 = tl.load(runs_ptr + run * 3)
    row1 = tl.load(runs_ptr + run * 3 + 1)
    adapter = tl.load(runs_ptr + run * 3 + 2)
    return row0, row1, adapter


@triton.jit
def segment_rows(seg_ptr, rank_ptr, segment, offs_m, offs_r):
    """Segment ``segment`` seen from a row tile: ``(adapter, roff, rows_in, r_mask)``.

    ``rows_in [BLOCK_M]`` marks the rows of ``offs_m`` inside the segment, ``r_mask`` the adapter's
    rank columns of ``offs_r``.
    """
    start = tl.load(seg_ptr + segment * 3)
    length = tl.load(seg_ptr + segment * 3 + 1)
    adapter = tl.load(seg_ptr + segment * 3 + 2)
    r, roff = adapter_rank(rank_ptr, adapter)
    rows_in = (offs_m >= start) & (offs_m < start + length)
    r_mask = offs_r < r
    return adapter, roff, rows_in, r_mask


def uniform_rank(ranks: tuple[int, ...]) -> int:
    """The rank every adapter with a nonzero rank shares, or 0 when they differ (host side).

    Passed as a constexpr, it makes a sibling call's ``B_flat`` row stride ``r_a`` a compile-time
    constant: the loads and atomics of ``B``/``dB`` rows vectorize (with ``r_a`` read at run time
    they did not, and the dy pass ran 1.5-2x slower). The dy pass's rank masks use it too
    (:func:`rank_columns`).
    """
    nonzero = {r for r in ranks if r > 0}
    return nonzero.pop() if len(nonzero) == 1 else 0


@triton.jit
def member_rank(rank_ptr, adapter, UNIFORM_RANK: tl.constexpr):
    """``r_a``: the constant ``UNIFORM_RANK`` where it applies (rank-0 adapters mask every rank column)."""
    if UNIFORM_RANK > 0:
        r = UNIFORM_RANK
    else:
        r, _ = adapter_rank(rank_ptr, adapter)
    return r


@triton.jit
def rank_columns(offs_r, r, UNIFORM_RANK: tl.constexpr):
    """``offs_r < r``: the rank columns of an adapter of rank ``r``.

    With ``UNIFORM_RANK`` (:func:`uniform_rank`) the bound is ``UNIFORM_RANK`` or 0 (a rank-0
    adapter), so the compiler sees the mask constant along the columns and keeps the loads and
    atomics along them vectorised; a bound read at run time makes them one element each.
    """
    return offs_r < (tl.where(r > 0, UNIFORM_RANK, 0) if UNIFORM_RANK > 0 else r)


@triton.jit
def member_span(bounds_ptr, num_members, lo, hi):
    """``(g_lo, g_hi)``: the sibling members ``g_lo <= g < g_hi`` whose columns overlap ``[lo, hi)``."""
    g_lo = tl.full((), 0, tl.int32)
    g_hi = tl.full((), 0, tl.int32)
    for g in range(num_members):
        g_lo += (tl.load(bounds_ptr + g + 1) <= lo).to(tl.int32)
        g_hi += (tl.load(bounds_ptr + g) < hi).to(tl.int32)
    return g_lo, g_hi


@triton.jit
def adapter_dropout(seed_ptr, thr_ptr, adapter, HAS_DROPOUT: tl.constexpr):
    """``(seed_lo, seed_hi, threshold)`` for ``adapter``'s tiles; zeros and no loads without dropout."""
    if HAS_DROPOUT:
        seed_lo, seed_hi = load_seed(seed_ptr)
        thr = tl.load(thr_ptr + adapter)
    else:
        seed_lo = tl.full((), 0, tl.uint32)
        seed_hi = tl.full((), 0, tl.uint32)
        thr = tl.full((), 0, tl.int32)
    return seed_lo, seed_hi, thr
