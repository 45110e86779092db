"""Forward, first pass: ``S = scale * (keep * x) A^T``, the dropout and the LoRA down-projection in one read of x.

Shapes: ``x [M, K]``, ``A [R, K]``, ``S [M, R]``. FusedLoRA passes ``scale = 1 / (1 - p)``, so
``S = x_hat A^T``, the split point of the paper's graph: it is tiny, it feeds the fused GEMM
``x W^T + scaling * S B^T`` and it is the only LoRA activation saved for backward
(``dB = scaling * dy^T S``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafusion_kernels._kernels._common import (
    capability_heuristic,
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

KERNEL = "xa"


@triton.jit(do_not_specialize=["M"])
def _lora_xa_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    seed_ptr,
    M,
    K,
    R,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_ar,
    stride_ak,
    stride_os,
    stride_om,
    stride_or,
    scale,
    keep_threshold,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M), split)``: program ``(i, s)`` reduces columns ``[s * k_per_split, ...)``."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_r = offs_r < R
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    seed_lo, seed_hi = dropout_key(seed_ptr, HAS_DROPOUT)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = load_kept_tile(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            seed_lo, seed_hi, offs_m, k, keep_threshold, HAS_DROPOUT, BLOCK_K,
            mask=mask_m[:, None] & mask_k[None, :],
        )  # fmt: skip
        a = tl.load(
            a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
            mask=mask_k[:, None] & mask_r[None, :],
            other=0.0,
        )
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=DOT_PRECISION)
    acc = acc * scale
    tl.store(
        out_ptr + pid_s * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_r[None, :] * stride_or,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_r[None, :],
    )


register_heuristic(
    KERNEL,
    capability_heuristic(
        interpreter=KernelConfig(block_m=32, block_n=16, block_k=32, split=1, num_warps=4, num_stages=1),
        gpu=KernelConfig(block_m=64, block_n=16, block_k=128, split=0, num_warps=4, num_stages=4),
    ),
)


def lora_xa(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    *,
    scale: float,
    keep_threshold: int,
    seed: torch.Tensor,
    has_dropout: bool,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``S = scale * (keep * x) A^T``.

    Args:
        x: ``[M, K]`` activations (fp16, bf16 or fp32).
        lora_a: ``[R, K]`` LoRA A (any float dtype; cast to ``x.dtype`` in the kernel).
        scale: ``1 / (1 - p)`` as a runtime fp32 scalar.
        keep_threshold: ``ceil(p * 2**16)``.
        seed: ``[1]`` int64 seed tensor on ``x``'s device (read only with dropout).
        has_dropout: Whether ``p > 0`` (compiles the RNG in; False draws no random numbers).
        config: Launch config; looked up by shape when None.

    Returns:
        ``[M, R]`` in ``x.dtype``.
    """
    m, k = x.shape
    r = lora_a.shape[0]
    cfg = config or launch_config(KERNEL, x, m=m, n=r, k=k, r=r)
    tiles = cdiv(m, cfg.block_m)
    split, k_per_split = split_reduction(cfg.split, x, tiles=tiles, length=k, block=cfg.block_k)
    out = split_output(split, (m, r), x.dtype, x.device)
    launch_fitting(
        _lora_xa_kernel,
        (tiles, split),
        x,
        lora_a,
        out,
        seed,
        m,
        k,
        r,
        k_per_split,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        partial_stride(out),
        out.stride(-2),
        out.stride(-1),
        scale,
        keep_threshold,
        HAS_DROPOUT=has_dropout,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        BLOCK_R=rank_block(r),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return reduce_split_output(out, x.dtype)
