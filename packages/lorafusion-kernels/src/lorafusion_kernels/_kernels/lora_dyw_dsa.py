"""Backward, fused GEMM: ``dx = dy W + keep * (dS A) / (1 - p)`` with one fp32 accumulator.

Shapes: ``dy [M, N]``, ``W [N, K]``, ``dS [M, R]``, ``A [R, K]``, ``dx [M, K]``. Each output tile
first computes the rank-R product ``dS A``, applies the dropout mask regenerated from
``(seed, row, col)`` (no stored mask) and ``1 / (1 - p)``, then runs the N loop of ``dy W`` on top.

Folding ``dA = dS^T x_hat`` into this prologue (same mask, x tile loaded once more, fp32 atomics
into dA) was measured on H100 (2026-11-22): 0.413 ms against 0.447 ms for ``dyw_dsa`` + ``dsx`` at
M = 8192, N = K = 4096, but 1.59 ms against 1.54 ms at K = 14336 and 2% slower over the benchmark
grid (the dA atomics grow with K), so ``dA`` stays a separate pass.
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
from lorafusion_kernels._kernels.dropout import dropout_keep_tile, load_seed
from lorafusion_kernels.tuning.config import KernelConfig, register_heuristic

KERNEL = "dyw_dsa"


@triton.jit
def _lora_start(ds, a, offs_m, c_start, seed_ptr, inv_keep, keep_threshold, HAS_DROPOUT: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The accumulator's start ``keep * (dS A) / (1 - p)`` for one ``[BLOCK_M, BLOCK_N]`` tile (ds in dy's dtype)."""
    acc = tl.dot(ds, a.to(ds.dtype), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        seed_lo, seed_hi = load_seed(seed_ptr)
        keep = dropout_keep_tile(seed_lo, seed_hi, offs_m, c_start, keep_threshold, BLOCK_N)
        acc = tl.where(keep, acc * inv_keep, 0.0)
    return acc


@triton.jit(do_not_specialize=["M"])
def _lora_dyw_dsa_kernel(
    dy_ptr,
    w_ptr,
    ds_ptr,
    a_ptr,
    dx_ptr,
    seed_ptr,
    M,
    N,
    K,
    R,
    stride_dym,
    stride_dyn,
    stride_wn,
    stride_wk,
    stride_dsm,
    stride_dsr,
    stride_ar,
    stride_ak,
    stride_dxm,
    stride_dxk,
    inv_keep,
    keep_threshold,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """1-D grid over ``[M, K]`` output tiles (``BLOCK_N`` wide); the loop runs over N in ``BLOCK_K`` steps."""
    _, pid_c, offs_m, offs_c, rows, cols = wrapped_tile(M, K, BLOCK_M, BLOCK_N, GROUP_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    rows = rows.to(tl.int64)  # row offsets of dy and dS in 64 bits: [M, N] may hold 2**31 elements or more
    ds = tl.load(ds_ptr + rows[:, None] * stride_dsm + offs_r[None, :] * stride_dsr, mask=mask_r[None, :], other=0.0)
    ds = ds.to(dy_ptr.dtype.element_ty)
    a = tl.load(a_ptr + offs_r[:, None] * stride_ar + cols[None, :] * stride_ak, mask=mask_r[:, None], other=0.0)
    acc = _lora_start(
        ds, a, offs_m, pid_c * BLOCK_N, seed_ptr, inv_keep, keep_threshold, HAS_DROPOUT, DOT_PRECISION, BLOCK_N
    )
    offs_k = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + rows[:, None] * stride_dym + offs_k[None, :] * stride_dyn
    w_ptrs = w_ptr + offs_k[:, None] * stride_wn + cols[None, :] * stride_wk
    acc = dot_k_loop(acc, dy_ptrs, w_ptrs, N, stride_dyn, stride_wn, BLOCK_K, DOT_PRECISION)
    tl.store(
        dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_c[None, :] * stride_dxk,
        acc.to(dx_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_c[None, :] < K),
    )


@triton.jit(do_not_specialize=["M"])
def _lora_dyw_dsa_tma_kernel(
    dy_desc,
    w_desc,
    dx_desc,
    ds_ptr,
    a_ptr,
    seed_ptr,
    M,
    N,
    K,
    R,
    stride_dsm,
    stride_dsr,
    stride_ar,
    stride_ak,
    inv_keep,
    keep_threshold,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """As :func:`_lora_dyw_dsa_kernel`, with dy, W and dx moved by TMA."""
    pid_m, pid_c = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_c = pid_c * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_c = off_c + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    ds = tl.load(
        ds_ptr + offs_m.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :] * stride_dsr,
        mask=(offs_m[:, None] < M) & mask_r[None, :],
        other=0.0,
    ).to(dx_desc.dtype)
    a = tl.load(
        a_ptr + offs_r[:, None] * stride_ar + offs_c[None, :] * stride_ak,
        mask=mask_r[:, None] & (offs_c[None, :] < K),
        other=0.0,
    )
    acc = _lora_start(ds, a, offs_m, off_c, seed_ptr, inv_keep, keep_threshold, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)
    for n in range(tl.cdiv(N, BLOCK_K)):
        dy = dy_desc.load([off_m, n * BLOCK_K])
        w = w_desc.load([n * BLOCK_K, off_c])
        acc = tl.dot(dy, w, acc, input_precision=DOT_PRECISION)
    dx_desc.store([off_m, off_c], acc.to(ds.dtype))


register_heuristic(KERNEL, GEMM_HEURISTIC)


def lora_dyw_dsa(
    dy: torch.Tensor,
    weight: torch.Tensor,
    ds: torch.Tensor,
    lora_a: torch.Tensor,
    *,
    inv_keep: float,
    keep_threshold: int,
    seed: torch.Tensor,
    has_dropout: bool,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``dx = dy W + keep * (dS A) * inv_keep``.

    Args:
        dy: ``[M, N]``.
        weight: ``[N, K]`` frozen base weight.
        ds: ``[M, R]`` from :func:`lora_dys_dyb`, in dy's dtype or fp32 (cast in the kernel).
        lora_a: ``[R, K]``.
        inv_keep: ``1 / (1 - p)``.
        keep_threshold: ``ceil(p * 2**16)``.
        seed: The forward's ``[1]`` int64 seed tensor.
        has_dropout: Whether ``p > 0``.
        config: Launch config; looked up by shape when None.

    Returns:
        ``[M, K]`` in ``dy.dtype``.
    """
    m, n = dy.shape
    k = weight.shape[1]
    r = ds.shape[1]
    cfg = config or launch_config(KERNEL, dy, m=m, n=n, k=k, r=r)
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    grid = (cdiv(m, cfg.block_m) * cdiv(k, cfg.block_n),)
    meta = gemm_meta(cfg, block_r=rank_block(r), dtype=dy.dtype)
    sizes = (m, n, k, r)
    dropout = (inv_keep, keep_threshold)
    if cfg.tma and tma_ok(dy, weight, dx):
        from triton.tools.tensor_descriptor import TensorDescriptor

        launch_fitting(
            _lora_dyw_dsa_tma_kernel, grid,
            TensorDescriptor.from_tensor(dy, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_k, cfg.block_n]),
            TensorDescriptor.from_tensor(dx, [cfg.block_m, cfg.block_n]),
            ds, lora_a, seed, *sizes, *ds.stride(), *lora_a.stride(), *dropout, HAS_DROPOUT=has_dropout, **meta,
        )  # fmt: skip
        return dx
    launch_fitting(
        _lora_dyw_dsa_kernel, grid,
        dy, weight, ds, lora_a, dx, seed, *sizes,
        *dy.stride(), *weight.stride(), *ds.stride(), *lora_a.stride(), *dx.stride(), *dropout,
        HAS_DROPOUT=has_dropout, **meta,
    )  # fmt: skip
    return dx
