"""The dropout mask of the fused kernels, in plain torch, and the host-side seed and threshold helpers.

:func:`dropout_keep_mask` reproduces bit for bit the mask that the Triton kernels draw (see
``lorafusion_kernels._kernels.dropout`` for the scheme: Philox4x32-7 keyed by the int64 seed,
counter ``(col // 8, row)``, 16 random bits per element, integer threshold ``ceil(p * 2**16)``).
Tests inject it into the float64 reference, and the plain-torch CPU path uses it, so every device
draws the same mask for the same seed.
"""

from __future__ import annotations

import math

import torch

from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.integers import integer_or_none

__all__ = ["PHILOX_ROUNDS", "check_seed", "draw_seed", "dropout_keep_mask", "keep_threshold", "seed_tensor"]

PHILOX_ROUNDS = 7
"""Rounds of Philox4x32; must equal the kernels' ``PHILOX_ROUNDS``."""

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_SEED_HIGH = 1 << 62


def keep_threshold(p: float) -> int:
    """The integer threshold ``ceil(p * 2**16)``: an element is kept when its 16 random bits reach it.

    Raises:
        LoRAFusionKernelsError: if ``p`` is not in ``[0, 1)``.
    """
    if not 0.0 <= p < 1.0:
        raise LoRAFusionKernelsError(f"dropout probability must be in [0, 1), got {p}")
    return math.ceil(p * (1 << 16))


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """Draw a fresh seed from torch's generator for ``device`` (so ``torch.manual_seed`` reproduces it).

    Returns:
        ``[1]`` int64 tensor on ``device``, in ``[0, 2**62)``; drawn on the device, no host sync.
    """
    return torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64, device=device)


def check_seed(seed: object) -> int:
    """``seed`` as a Python int: an integer (Python, NumPy, or a one-element integer tensor) in ``[0, 2**63)``.

    Raises:
        LoRAFusionKernelsError: a float, a bool or another non-integer, a negative seed, or one that
            does not fit in 63 bits (the kernels read an int64).
    """
    value = integer_or_none(seed)
    if value is None or not 0 <= value < (1 << 63):
        raise LoRAFusionKernelsError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return value


def seed_tensor(seed: int, device: torch.device | str) -> torch.Tensor:
    """Wrap an explicit integer seed as the ``[1]`` int64 tensor the kernels read.

    Raises:
        LoRAFusionKernelsError: if ``seed`` is not an integer in ``[0, 2**63)`` (:func:`check_seed`).
    """
    return torch.tensor([check_seed(seed)], dtype=torch.int64, device=device)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a uint32 constant ``a`` and uint32 values ``b`` held in int64.

    ``b`` is split in 16-bit halves so every partial product stays below ``2**49`` (no int64 overflow).
    """
    b_hi = b >> 16
    b_lo = b & 0xFFFF
    p = a * b_hi
    q = a * b_lo
    hi = (p + (q >> 16)) >> 16
    lo = (((p & 0xFFFF) << 16) + q) & _MASK32
    return hi, lo


def _philox4x32(c0: torch.Tensor, c1: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Philox4x32-7 of counters ``(c0, c1, 0, 0)`` under the 64-bit ``seed``; uint32 values in int64 tensors."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def dropout_keep_mask(
    seed: int,
    rows: int,
    cols: int,
    p: float,
    *,
    row_offset: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The fused kernels' dropout keep mask for an input ``x [rows, cols]``, computed in plain torch.

    Args:
        seed: The int64 seed the op used (``fused_lora_linear(..., seed=seed)``).
        rows: ``M``, the number of token rows.
        cols: ``K``, the input features.
        p: Dropout probability in ``[0, 1)``.
        row_offset: Global index of the first row (a segment inside a packed multi-adapter batch).
        device: Where to compute the mask.

    Returns:
        ``[rows, cols]`` bool tensor, True where the element is kept (and scaled by ``1 / (1 - p)``).
    """
    threshold = keep_threshold(p)
    seed = check_seed(seed)
    groups = (cols + 7) // 8
    row_ids = torch.arange(row_offset, row_offset + rows, dtype=torch.int64, device=device)
    col_ids = torch.arange(groups, dtype=torch.int64, device=device)
    c0 = col_ids[None, :].expand(rows, groups).contiguous()
    c1 = row_ids[:, None].expand(rows, groups).contiguous()
    outputs = _philox4x32(c0, c1, seed)
    words = torch.stack(outputs, dim=-1)  # [rows, groups, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).reshape(rows, groups * 8)[:, :cols]
    return halves >= threshold
