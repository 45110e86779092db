"""Forward, fused GEMM: ``y = x W^T + scaling * S B^T + bias`` with one fp32 accumulator.

Shapes: ``x [M, K]``, ``W [N, K]``, ``S [M, R]`` (``x_hat A^T``, unscaled), ``B [N, R]``, ``bias [N]``,
``y [M, N]``. Each output tile starts its accumulator with the rank-R product ``S B^T``, scales it in
fp32 and then runs the K loop of ``x W^T`` on top, so the LoRA term costs no pass over ``[M, N]``.
``scaling`` is applied here rather than stored in ``S``, so ``S`` has PEFT's range in fp16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafusion_kernels._kernels._common import (
    GEMM_HEURISTIC,
    cdiv,
    dot_k_loop,
    gemm_meta,
    grouped_tile,
    launch_config,
    launch_fitting,
    rank_block,
    tma_ok,
    wrapped_tile,
)
from lorafusion_kernels.tuning.config import KernelConfig, register_heuristic

KERNEL = "xw_sb"


@triton.jit(do_not_specialize=["M"])
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
    scaling,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """1-D grid over ``[M, N]`` output tiles in grouped order; loads through wrapped rows/columns."""
    _, _, offs_m, offs_n, rows, cols = wrapped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    rows = rows.to(tl.int64)  # row offsets of x in 64 bits: [M, K] may hold 2**31 elements or more
    s = tl.load(s_ptr + rows[:, None] * stride_sm + offs_r[None, :] * stride_sr, mask=mask_r[None, :], other=0.0)
    b = tl.load(b_ptr + cols[None, :] * stride_bn + offs_r[:, None] * stride_br, mask=mask_r[:, None], other=0.0)
    acc = tl.dot(s, b.to(s.dtype), input_precision=DOT_PRECISION) * scaling
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = dot_k_loop(acc, x_ptrs, w_ptrs, K, stride_xk, stride_wk, BLOCK_K, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@triton.jit(do_not_specialize=["M"])
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
    scaling,
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
        s_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + offs_r[None, :] * stride_sr,
        mask=(offs_m[:, None] < M) & mask_r[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
        mask=(offs_n[None, :] < N) & mask_r[:, None],
        other=0.0,
    )
    acc = tl.dot(s, b.to(s.dtype), input_precision=DOT_PRECISION) * scaling
    for k in range(tl.cdiv(K, BLOCK_K)):
        x = x_desc.load([off_m, k * BLOCK_K])
        w = w_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_desc.store([off_m, off_n], acc.to(s.dtype))


register_heuristic(KERNEL, GEMM_HEURISTIC)


def lora_xw_sb(
    x: torch.Tensor,
    weight: torch.Tensor,
    s: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    scaling: float,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``y = x W^T + scaling * S B^T + bias``.

    Args:
        x: ``[M, K]``.
        weight: ``[N, K]`` frozen base weight, same dtype as ``x``.
        s: ``[M, R]`` LoRA activation ``x_hat A^T`` from :func:`lora_xa`, ``x.dtype``.
        lora_b: ``[N, R]`` LoRA B (any float dtype; cast in the kernel).
        bias: ``[N]`` or None.
        scaling: The LoRA scaling (fp32 runtime scalar).
        config: Launch config; looked up by shape when None.

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    m, k = x.shape
    n = weight.shape[0]
    r = s.shape[1]
    cfg = config or launch_config(KERNEL, x, m=m, n=n, k=k, r=r)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    meta = gemm_meta(cfg, block_r=rank_block(r), dtype=x.dtype)
    lora = (s, lora_b, bias.contiguous() if bias is not None else y)  # the kernels read the bias at unit stride
    sizes = (m, n, k, r)
    if cfg.tma and s.dtype == x.dtype and tma_ok(x, weight, y):
        from triton.tools.tensor_descriptor import TensorDescriptor

        launch_fitting(
            _lora_xw_sb_tma_kernel, grid,
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n]),
            *lora, *sizes, *s.stride(), *lora_b.stride(), scaling, HAS_BIAS=bias is not None, **meta,
        )  # fmt: skip
        return y
    launch_fitting(
        _lora_xw_sb_kernel, grid,
        x, weight, *lora, y, *sizes, *x.stride(), *weight.stride(), *s.stride(), *lora_b.stride(), *y.stride(),
        scaling, HAS_BIAS=bias is not None, **meta,
    )  # fmt: skip
    return y
