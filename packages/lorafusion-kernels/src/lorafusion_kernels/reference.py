"""The executable spec: plain-torch LoRA linear layers that every test compares against.

Run them on float64 copies of the inputs for the reference, or in the test dtype for the "eager"
error bound. Nothing here is fast; nothing here is fused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional

from lorafusion_kernels.dropout import dropout_keep_mask

__all__ = [
    "lora_linear_reference",
    "lora_linear_reference_seeded",
    "multi_lora_linear_reference",
    "peft_style_lora_linear",
    "per_segment_lora_linear",
]


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scaling: float,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x W^T + bias + scaling * ((keep * x) / (1 - p)) A^T B^T``, differentiable, in the inputs' dtype.

    Args:
        x: ``[..., K]``.
        weight: ``[N, K]``.
        lora_a: ``[r, K]``.
        lora_b: ``[N, r]``.
        scaling: LoRA scaling.
        dropout_p: Dropout probability of the LoRA branch.
        bias: ``[N]`` or None.
        keep_mask: ``[..., K]`` bool, required when ``dropout_p > 0`` (inject the op's mask to compare).

    Returns:
        ``[..., N]``.
    """
    x_hat = x
    if dropout_p > 0.0:
        if keep_mask is None:
            raise ValueError("keep_mask is required when dropout_p > 0")
        x_hat = x * keep_mask.to(x.dtype) / (1.0 - dropout_p)
    return functional.linear(x, weight, bias) + scaling * ((x_hat @ lora_a.T) @ lora_b.T)


def lora_linear_reference_seeded(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scaling: float,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """:func:`lora_linear_reference` with the mask that ``fused_lora_linear(..., seed=seed)`` draws."""
    keep = None
    if dropout_p > 0.0:
        k = x.shape[-1]
        m = x.numel() // k
        keep = dropout_keep_mask(seed, m, k, dropout_p, device=x.device).reshape(x.shape)
    return lora_linear_reference(
        x, weight, lora_a, lora_b, scaling=scaling, dropout_p=dropout_p, bias=bias, keep_mask=keep
    )


def peft_style_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scaling: float,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
    training: bool = True,
) -> torch.Tensor:
    """The eager baseline, as PEFT's ``lora.Linear.forward`` computes it: ``base(x) + B(A(dropout(x))) * scaling``.

    Uses ``torch.nn.functional.dropout`` (torch's RNG, a stored mask); the benchmarks' ``eager`` and
    ``compile`` providers call this function.
    """
    result = functional.linear(x, weight, bias)
    dropped = functional.dropout(x, p=dropout_p, training=training) if dropout_p > 0.0 else x
    return result + functional.linear(functional.linear(dropped, lora_a), lora_b) * scaling


def multi_lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    *,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    bias: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """FusedMultiLoRA's spec: each segment through :func:`lora_linear_reference` with its adapter.

    Segment ``j`` (rows ``start_j .. start_j + segment_lengths[j]`` of ``x [T, K]``) uses adapter
    ``a = segment_adapters[j]``: ``lora_a[a] [r_a, K]``, ``lora_b[a] [N, r_a]``, ``scaling[a]``,
    ``dropout_p[a]``, and the rows ``start_j ..`` of the mask that
    ``fused_multi_lora_linear(..., seed=seed)`` draws (the packed row index keys the RNG).

    Returns:
        ``[T, N]``, differentiable, in the inputs' dtype.
    """
    k = x.shape[-1]
    pieces = []
    start = 0
    for length, adapter in zip(segment_lengths, segment_adapters, strict=True):
        if length == 0:
            continue
        p = dropout_p[adapter]
        keep = dropout_keep_mask(seed, length, k, p, row_offset=start, device=x.device) if p > 0.0 else None
        pieces.append(
            lora_linear_reference(
                x[start : start + length],
                weight,
                lora_a[adapter],
                lora_b[adapter],
                scaling=scaling[adapter],
                dropout_p=p,
                bias=bias,
                keep_mask=keep,
            )
        )
        start += length
    return torch.cat(pieces, dim=0) if pieces else functional.linear(x, weight, bias)


def per_segment_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    *,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    bias: torch.Tensor | None = None,
    training: bool = True,
) -> torch.Tensor:
    """The eager multi-adapter baseline: one frozen GEMM, then a PEFT-style LoRA branch per segment.

    Like PEFT's ``_mixed_batch_forward`` with contiguous segments taken as views (no gather), and
    ``torch.nn.functional.dropout`` (torch's RNG, a stored mask). The benchmark's ``eager`` provider.
    """
    result = functional.linear(x, weight, bias)
    pieces = []
    start = 0
    for length, adapter in zip(segment_lengths, segment_adapters, strict=True):
        if length == 0:
            continue
        xs = x[start : start + length]
        p = dropout_p[adapter]
        dropped = functional.dropout(xs, p=p, training=training) if p > 0.0 else xs
        pieces.append(
            functional.linear(functional.linear(dropped, lora_a[adapter]), lora_b[adapter]) * scaling[adapter]
        )
        start += length
    return result + torch.cat(pieces, dim=0) if pieces else result
