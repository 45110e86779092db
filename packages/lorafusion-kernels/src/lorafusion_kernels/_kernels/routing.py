"""Reading a multi-adapter microbatch's routing tables inside the FusedMultiLoRA kernels.

The tables (:class:`lorafusion_kernels.metadata.MultiLoRABatch`, and the per-call adapter tables of
:mod:`lorafusion_kernels.multi_lora`) are int32 rows: a segment tile is ``(row0, row1, adapter)``,
a segment ``(start, length, adapter)``, an adapter's rank entry ``(r_a, roff_a)``: its rank and its
first row in the stacked ``A_cat`` (first column in ``B_cat``). The helpers inline into the kernels.
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
