"""Backward, skinny pass: ``dA = dS^T x_hat = dS^T (keep * x) / (1 - p)``, the mask regenerated.

Shapes: ``dS [M, R]``, ``x [M, K]``, ``dA [R, K]``. Program ``(j, s)`` owns columns
``[j * BLOCK_N, ...)`` of dA and the ``s``-th slice of the rows; slices are summed in a fixed
order (an fp32 workspace ``[split, R, K]`` reduced by torch), so the result is deterministic.

The program accumulates ``dA^T [BLOCK_N, BLOCK_R] += x_hat^T dS``, transposed: with ``BLOCK_N``
(>= 64) as the dot's M extent Hopper runs a warpgroup MMA (``wgmma``), where ``dS^T x_hat`` (M
extent: the rank) can only use ``mma.sync`` and moves ``x_hat`` through one more register layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafusion_kernels._kernels._common import (
    SKINNY_HEURISTIC,
    cdiv,
    dot_precision,
    launch_config,
    launch_fitting,
    partial_stride,
    rank_block,
    reduce_split_output,
    split_output,
    split_reduction,
)
from lorafusion_kernels._kernels.dropout import dropout_key, load_kept_tile
from lorafusion_kernels.tuning.config import KernelConfig, register_heuristic

KERNEL = "dsx"


@triton.jit(do_not_specialize=["M", "m_per_split"])
def _lora_dsx_kernel(
    ds_ptr,
    x_ptr,
    out_ptr,
    seed_ptr,
    M,
    K,
    R,
    m_per_split,
    stride_dsm,
    stride_dsr,
    stride_xm,
    stride_xk,
    stride_os,
    stride_or,
    stride_ok,
    inv_keep,
    keep_threshold,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Grid ``(cdiv(K, BLOCK_N), split)``; the loop runs over the program's rows in ``BLOCK_M`` steps."""
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_c = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < K
    mask_r = offs_r < R
    m_begin = pid_s * m_per_split
    m_end = tl.minimum(m_begin + m_per_split, M)
    seed_lo, seed_hi = dropout_key(seed_ptr, HAS_DROPOUT)
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for m in range(m_begin, m_end, BLOCK_M):
        offs_m = m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m_end
        ds = tl.load(
            ds_ptr + offs_m.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :] * stride_dsr,
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
        x = load_kept_tile(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_c[None, :] * stride_xk,
            seed_lo, seed_hi, offs_m, pid_k * BLOCK_N, keep_threshold, HAS_DROPOUT, BLOCK_N,
            mask=mask_m[:, None] & mask_c[None, :],
        )  # fmt: skip
        acc = tl.dot(tl.trans(x), ds.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        acc = acc * inv_keep
    out_ptrs = out_ptr + pid_s * stride_os + offs_r[None, :] * stride_or + offs_c[:, None] * stride_ok
    if ATOMIC_OUT:
        tl.atomic_add(out_ptrs, acc, mask=mask_r[None, :] & mask_c[:, None])
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_r[None, :] & mask_c[:, None])


register_heuristic(KERNEL, SKINNY_HEURISTIC)


def lora_dsx(
    ds: torch.Tensor,
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    inv_keep: float,
    keep_threshold: int,
    seed: torch.Tensor,
    has_dropout: bool,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``dA = dS^T (keep * x) * inv_keep``.

    Args:
        ds: ``[M, R]`` in x's dtype or fp32 (cast to x's dtype in the kernel).
        x: ``[M, K]`` the saved (undropped) input.
        out_dtype: dtype of ``dA`` (that of ``A``).
        inv_keep: ``1 / (1 - p)``.
        keep_threshold: ``ceil(p * 2**16)``.
        seed: The forward's ``[1]`` int64 seed tensor.
        has_dropout: Whether ``p > 0``.
        out: A zeroed fp32 ``[R, K]`` to add dA into with atomics (then ``out_dtype`` is ignored and
            ``out`` is returned); None sums the row slices in a fixed order (deterministic).
        config: Launch config; looked up by shape when None.

    Returns:
        ``[R, K]`` in ``out_dtype``, or ``out``.
    """
    m, k = x.shape
    r = ds.shape[1]
    cfg = config or launch_config(KERNEL, x, m=m, n=r, k=k, r=r)
    tiles = cdiv(k, cfg.block_n)
    split, m_per_split = split_reduction(cfg.split, x, tiles=tiles, length=m, block=cfg.block_m)
    atomic = out is not None
    if out is None:
        out = split_output(split, (r, k), out_dtype, x.device)
    launch_fitting(
        _lora_dsx_kernel,
        (tiles, split),
        ds,
        x,
        out,
        seed,
        m,
        k,
        r,
        m_per_split,
        ds.stride(0),
        ds.stride(1),
        x.stride(0),
        x.stride(1),
        0 if atomic else partial_stride(out),
        out.stride(-2),
        out.stride(-1),
        inv_keep,
        keep_threshold,
        HAS_DROPOUT=has_dropout,
        ATOMIC_OUT=atomic,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_R=rank_block(r),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out if atomic else reduce_split_output(out, out_dtype)
