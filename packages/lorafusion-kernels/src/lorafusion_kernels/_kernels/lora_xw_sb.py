"""Forward, fused GEMM: ``y = x W^T + S' B^T + bias`` with one fp32 accumulator.

Shapes: ``x [M, K]``, ``W [N, K]``, ``S' [M, R]`` (already scaled), ``B [N, R]``, ``bias [N]``,
``y [M, N]``. Each output tile starts its accumulator with the rank-R product ``S' B^T`` and then
runs the K loop of ``x W^T`` on top, so the LoRA term costs no pass over ``[M, N]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafusion_kernels._kernels._common import dot_precision, grouped_tile, launch_config, rank_block, tma_ok
from lorafusion_kernels.tuning.config import KernelConfig, ShapeKey, register_heuristic

KERNEL = "xw_sb"


@triton.jit
def _lora_xw_sb_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    R,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sm,
    stride_sr,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """1-D grid over ``[M, N]`` output tiles in grouped order."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/columns wrap onto valid ones: the loads need no M/N masks (their results are
    # never stored), which keeps the inner loop free of predicates.
    rows = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    cols = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    s = tl.load(s_ptr + rows[:, None] * stride_sm + offs_r[None, :] * stride_sr, mask=mask_r[None, :], other=0.0)
    b = tl.load(b_ptr + cols[None, :] * stride_bn + offs_r[:, None] * stride_br, mask=mask_r[:, None], other=0.0)
    acc = tl.dot(s, b.to(s.dtype), input_precision=DOT_PRECISION)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    for k in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@triton.jit
def _lora_xw_sb_tma_kernel(
    x_desc,
    w_desc,
    y_desc,
    s_ptr,
    b_ptr,
    bias_ptr,
    M,
    N,
    K,
    R,
    stride_sm,
    stride_sr,
    stride_bn,
    stride_br,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """As :func:`_lora_xw_sb_kernel`, with x, W and y moved by TMA.

    Out-of-bounds parts of a box are zero-filled on load and clipped on store, so no masks.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    s = tl.load(
        s_ptr + offs_m[:, None] * stride_sm + offs_r[None, :] * stride_sr,
        mask=(offs_m[:, None] < M) & mask_r[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
        mask=(offs_n[None, :] < N) & mask_r[:, None],
        other=0.0,
    )
    acc = tl.dot(s, b.to(s.dtype), input_precision=DOT_PRECISION)
    for k in range(tl.cdiv(K, BLOCK_K)):
        x = x_desc.load([off_m, k * BLOCK_K])
        w = w_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_desc.store([off_m, off_n], acc.to(s.dtype))


def _heuristic(key: ShapeKey, capability: tuple[int, int]) -> KernelConfig:
    if capability == (0, 0):
        return KernelConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1)
    if capability >= (9, 0):
        return KernelConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return KernelConfig(block_m=128, block_n=128, block_k=32, group_m=8, num_warps=4, num_stages=4)


register_heuristic(KERNEL, _heuristic)


def lora_xw_sb(
    x: torch.Tensor,
    weight: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``y = x W^T + S' B^T + bias``.

    Args:
        x: ``[M, K]``.
        weight: ``[N, K]`` frozen base weight, same dtype as ``x``.
        s: ``[M, R]`` scaled LoRA activation from :func:`lora_xa`, ``x.dtype``.
        lora_b: ``[N, R]`` LoRA B (any float dtype; cast in the kernel).
        bias: ``[N]`` or None.
        config: Launch config; looked up by shape when None.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    m, k = x.shape
    n = weight.shape[0]
    r = s.shape[1]
    cfg = config or launch_config(KERNEL, x, m=m, n=n, k=k, r=r)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    if cfg.tma and s.dtype == x.dtype and tma_ok(x, weight, y):
        from triton.tools.tensor_descriptor import TensorDescriptor

        _lora_xw_sb_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n]),
            s,
            lora_b,
            bias if bias is not None else y,
            m,
            n,
            k,
            r,
            s.stride(0),
            s.stride(1),
            lora_b.stride(0),
            lora_b.stride(1),
            HAS_BIAS=bias is not None,
            DOT_PRECISION=dot_precision(x.dtype),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            BLOCK_R=rank_block(r),
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return y
    _lora_xw_sb_kernel[grid](
        x,
        weight,
        s,
        lora_b,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        r,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        s.stride(0),
        s.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        y.stride(1),
        HAS_BIAS=bias is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_R=rank_block(r),
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
