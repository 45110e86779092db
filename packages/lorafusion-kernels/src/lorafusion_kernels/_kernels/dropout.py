"""Counter-based dropout RNG shared by every LoRA kernel (single and multi adapter).

The keep decision for element ``(row, col)`` of an input ``x [M, K]`` is a pure function of
``(seed, row, col, p)``, so a backward kernel regenerates exactly the forward mask and neither the
mask nor ``x_hat`` is ever stored. The scheme, mirrored bit for bit in plain torch by
:func:`lorafusion_kernels.dropout.dropout_keep_mask`:

- Philox4x32 with 7 rounds, key ``(seed_lo, seed_hi)`` (the two 32-bit halves of the int64 seed),
  counter ``(col // 8, row, 0, 0)``; its four 32-bit outputs, cut into eight 16-bit halves (low half
  first), serve columns ``8 * (col // 8) + t``, ``t = 0..7`` (one Philox call per eight elements:
  the random numbers, not the loads, were what the memory-bound passes waited for).
- ``keep = half_t >= ceil(p * 2**16)``: an integer comparison, so the mask does not depend on
  floating-point rounding of ``p`` on any device; ``P(keep) = 1 - p`` to within ``2**-16``.

Multi-adapter kernels use the same function with ``row`` the token's row in the packed batch and a
per-segment threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PHILOX_ROUNDS = tl.constexpr(7)
"""Philox rounds: 7 passes BigCrush (Salmon et al., SC'11) at 70% of the cost of the usual 10."""


@triton.jit
def _philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32 on uint32 tensors of one shape: counters ``c0..c3``, key ``(k0, k1)``."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        old_c0 = c0
        old_c2 = c2
        c0 = tl.umulhi(old_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(old_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = old_c2 * 0xCD9E8D57
        c3 = old_c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def load_seed(seed_ptr):
    """Load the int64 seed from ``seed_ptr`` (a 1-element device tensor) as two uint32 key halves."""
    seed = tl.load(seed_ptr)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return seed_lo, seed_hi


@triton.jit
def dropout_keep_tile(seed_lo, seed_hi, offs_m, k_start, keep_threshold, BLOCK_K: tl.constexpr):
    """The keep mask of one tile: ``[BLOCK_M, BLOCK_K]`` bool, True where the element survives dropout.

    Args:
        seed_lo: Low 32 bits of the seed (uint32), from :func:`load_seed`.
        seed_hi: High 32 bits of the seed (uint32).
        offs_m: ``[BLOCK_M]`` global row indices (any int dtype, non-negative).
        k_start: First global column of the tile; must be a multiple of 8.
        keep_threshold: ``ceil(p * 2**16)`` as int32 (see :func:`lorafusion_kernels.dropout.keep_threshold`).
        BLOCK_K: Tile width, a power of two >= 8.
    """
    cols8 = (k_start // 8 + tl.arange(0, BLOCK_K // 8)).to(tl.uint32)
    rows = offs_m.to(tl.uint32)
    c0 = cols8[None, :] + rows[:, None] * 0
    c1 = rows[:, None] + cols8[None, :] * 0
    zero = c0 * 0
    r0, r1, r2, r3 = _philox4x32(c0, c1, zero, zero, seed_lo, seed_hi)
    # Counter j's words in turn (interleaving twice lays out r0, r1, r2, r3), then each word's two
    # halves, low first: column 8j + t takes half t % 2 of word t // 2.
    words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    halves = tl.interleave(words & 0xFFFF, words >> 16)
    return halves.to(tl.int32) >= keep_threshold


@triton.jit
def dropout_key(seed_ptr, HAS_DROPOUT: tl.constexpr):
    """The Philox key of :func:`load_seed` with dropout; without, uint32 zeros and no load (never used then).

    Lets a kernel hand the key to :func:`load_kept_tile` whether or not it was compiled with dropout.
    """
    if HAS_DROPOUT:
        seed_lo, seed_hi = load_seed(seed_ptr)
    else:
        seed_lo = tl.full((), 0, tl.uint32)
        seed_hi = tl.full((), 0, tl.uint32)
    return seed_lo, seed_hi


@triton.jit
def load_kept_tile(
    ptrs, seed_lo, seed_hi, offs_m, k_start, keep_threshold, HAS_DROPOUT: tl.constexpr, BLOCK_K: tl.constexpr, mask
):
    """``keep * x`` on one ``[BLOCK_M, BLOCK_K]`` tile of an input ``x [M, K]``: the dropped input, unscaled.

    Called as ``load_kept_tile(ptrs, ..., mask=...)`` like ``tl.load(ptrs, mask=...)``: Triton evaluates
    keyword arguments first, so the mask and pointer arithmetic keep the order of a plain load.

    Args:
        ptrs: ``[BLOCK_M, BLOCK_K]`` pointers to the tile's elements.
        seed_lo: Philox key from :func:`dropout_key`.
        seed_hi: Second half of the key.
        offs_m: ``[BLOCK_M]`` rows of the tile in ``x`` (the mask's row index).
        k_start: Column of the tile's first element, a multiple of 8.
        keep_threshold: ``ceil(p * 2**16)``, a scalar or per row ``[BLOCK_M, 1]``.
        HAS_DROPOUT: False loads the tile unchanged (no random numbers).
        BLOCK_K: Tile width.
        mask: Which elements exist (the others load as 0).
    """
    x = tl.load(ptrs, mask=mask, other=0.0)
    if HAS_DROPOUT:
        keep = dropout_keep_tile(seed_lo, seed_hi, offs_m, k_start, keep_threshold, BLOCK_K)
        x = tl.where(keep, x, 0.0)
    return x


@triton.jit(do_not_specialize=["M", "row_offset"])
def _dropout_keep_mask_kernel(
    seed_ptr, mask_ptr, M, K, row_offset, keep_threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    seed_lo, seed_hi = load_seed(seed_ptr)
    keep = dropout_keep_tile(seed_lo, seed_hi, offs_m + row_offset, pid_k * BLOCK_K, keep_threshold, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    tl.store(mask_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], keep.to(tl.int8), mask=mask)


def dropout_keep_mask_triton(
    seed: torch.Tensor, m: int, k: int, keep_threshold: int, row_offset: int = 0
) -> torch.Tensor:
    """Materialise the kernels' keep mask ``[m, k]`` (bool) with the Triton RNG; for tests and debugging.

    Args:
        seed: 1-element int64 tensor on the target device.
        m: Rows.
        k: Columns.
        keep_threshold: ``ceil(p * 2**16)``.
        row_offset: Added to every row index (rows of a segment inside a packed batch).
    """
    out = torch.empty((m, k), dtype=torch.int8, device=seed.device)
    block_m, block_k = 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _dropout_keep_mask_kernel[grid](seed, out, m, k, row_offset, keep_threshold, BLOCK_M=block_m, BLOCK_K=block_k)
    return out.bool()
