"""Backward, skinny pass: ``dS = scaling * dy B`` and ``dB = dy^T S'`` from one read of dy.

Shapes: ``dy [M, N]``, ``B [N, R]``, ``S' [M, R]`` (the saved, scaled activation), ``dS [M, R]``,
``dB [N, R]``. ``dS`` is the gradient with respect to the unscaled ``S = x_hat A^T``.

Default mode: program ``(i, s)`` owns row block i and every ``split``-th column tile of dy; it sums
``dS`` for its rows in registers and adds each tile's ``dy^T S'`` into an fp32 ``dB`` with atomics
(and ``dS`` too when ``split > 1``). Deterministic mode (no atomics, fixed summation order): one
launch for ``dS`` (``split = 1``) and a second launch of the same kernel on ``dy^T`` for ``dB``;
dy is then read twice.
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
    rank_block,
    resolve_split,
    zeroed_fp32,
)
from lorafusion_kernels.tuning.config import KernelConfig, register_heuristic

KERNEL = "dys_dyb"


@triton.jit(do_not_specialize=["M"])
def _lora_dys_dyb_kernel(
    dy_ptr,
    b_ptr,
    s_ptr,
    ds_ptr,
    db_ptr,
    M,
    N,
    R,
    stride_dym,
    stride_dyn,
    stride_bn,
    stride_br,
    stride_sm,
    stride_sr,
    stride_dsm,
    stride_dsr,
    stride_dbn,
    stride_dbr,
    ds_scale,
    COMPUTE_DB: tl.constexpr,
    DS_ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M), split)``; ``dS`` rows of one block, ``dB`` partials by atomics."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_r = offs_r < R
    if COMPUTE_DB:
        s = tl.load(
            s_ptr + offs_m[:, None] * stride_sm + offs_r[None, :] * stride_sr,
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
    ds_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for t in range(pid_s, tl.cdiv(N, BLOCK_N), num_splits):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        dy = tl.load(
            dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
            mask=mask_m[:, None] & mask_n[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        )
        ds_acc = tl.dot(dy, b.to(dy.dtype), ds_acc, input_precision=DOT_PRECISION)
        if COMPUTE_DB:
            db = tl.dot(tl.trans(dy), s, input_precision=DOT_PRECISION)
            tl.atomic_add(
                db_ptr + offs_n[:, None] * stride_dbn + offs_r[None, :] * stride_dbr,
                db,
                mask=mask_n[:, None] & mask_r[None, :],
            )
    ds_acc = ds_acc * ds_scale
    ds_ptrs = ds_ptr + offs_m[:, None] * stride_dsm + offs_r[None, :] * stride_dsr
    if DS_ATOMIC:
        tl.atomic_add(ds_ptrs, ds_acc, mask=mask_m[:, None] & mask_r[None, :])
    else:
        tl.store(ds_ptrs, ds_acc.to(ds_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])


register_heuristic(KERNEL, SKINNY_HEURISTIC)


def _launch(
    dy: torch.Tensor,
    dy_strides: tuple[int, int],
    rows: int,
    cols: int,
    right: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    db: torch.Tensor,
    *,
    ds_scale: float,
    compute_db: bool,
    split: int,
    cfg: KernelConfig,
) -> None:
    r = right.shape[1]
    _lora_dys_dyb_kernel[(cdiv(rows, cfg.block_m), split)](
        dy,
        right,
        s,
        out,
        db,
        rows,
        cols,
        r,
        dy_strides[0],
        dy_strides[1],
        right.stride(0),
        right.stride(1),
        s.stride(0),
        s.stride(1),
        out.stride(0),
        out.stride(1),
        db.stride(0),
        db.stride(1),
        ds_scale,
        COMPUTE_DB=compute_db,
        DS_ATOMIC=split > 1,
        DOT_PRECISION=dot_precision(dy.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_R=rank_block(r),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def lora_dys_dyb(
    dy: torch.Tensor,
    lora_b: torch.Tensor,
    s: torch.Tensor,
    *,
    scaling: float,
    deterministic: bool = False,
    accumulators: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dS = scaling * dy B`` and ``dB = dy^T S'``.

    Args:
        dy: ``[M, N]`` output gradient.
        lora_b: ``[N, R]``.
        s: ``[M, R]`` saved ``S'`` (``dy.dtype``).
        scaling: The LoRA scaling (fp32 runtime scalar).
        deterministic: No atomics: two launches (dy read twice), bitwise reproducible.
        accumulators: Zeroed fp32 ``(dS [M, R], dB [N, R])`` to add into with atomics (see
            :func:`~lorafusion_kernels._kernels._common.zeroed_fp32`, which lets the caller share
            one fill with its other accumulators); None allocates them. Ignored in deterministic mode.
        config: Launch config; looked up by shape when None.

    Returns:
        ``(dS [M, R], dB [N, R])``: in deterministic mode ``dS`` in ``dy.dtype`` and ``dB`` in
        ``lora_b.dtype``; otherwise the fp32 accumulators.
    """
    m, n = dy.shape
    r = lora_b.shape[1]
    cfg = config or launch_config(KERNEL, dy, m=m, n=n, k=n, r=r)
    if deterministic:
        ds = torch.empty((m, r), dtype=dy.dtype, device=dy.device)
        db = torch.empty((n, r), dtype=lora_b.dtype, device=dy.device)
        _launch(dy, (dy.stride(0), dy.stride(1)), m, n, lora_b, s, ds, ds,
                ds_scale=scaling, compute_db=False, split=1, cfg=cfg)  # fmt: skip
        # dB = dy^T S': the same kernel on the transposed view of dy, with S' as the right operand.
        _launch(dy, (dy.stride(1), dy.stride(0)), n, m, s, s, db, db,
                ds_scale=1.0, compute_db=False, split=1, cfg=cfg)  # fmt: skip
        return ds, db
    split = resolve_split(cfg.split, dy, tiles=cdiv(m, cfg.block_m), steps=cdiv(n, cfg.block_n))
    if accumulators is None:
        _, (ds_out, db32) = zeroed_fp32((m, r), (n, r), device=dy.device)
    else:
        ds_out, db32 = accumulators
    _launch(dy, (dy.stride(0), dy.stride(1)), m, n, lora_b, s, ds_out, db32,
            ds_scale=scaling, compute_db=True, split=split, cfg=cfg)  # fmt: skip
    return ds_out, db32
