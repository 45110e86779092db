"""FusedMultiLoRA: one fused LoRA linear for a packed microbatch that mixes several adapters.

The tokens ``x [T, K]`` are consecutive segments; segment ``j`` holds ``segment_lengths[j]`` tokens
of adapter ``a = segment_adapters[j]`` (an adapter may own several segments, some none). With
``W [N, K]`` shared by all adapters and ``A_a [r_a, K]``, ``B_a [N, r_a]``, for a token ``t`` of ``a``::

    x_hat[t] = keep_a(t, :) * x[t] / (1 - p_a)
    y[t]     = x[t] W^T + bias + scaling_a * (x_hat[t] A_a^T) B_a^T

Gradients (``S[t] = x_hat[t] A_a^T``, ``dS[t] = scaling_a * dy[t] B_a``)::

    dB_a  = scaling_a * sum_{t in a} dy[t]^T S[t]        dA_a = sum_{t in a} dS[t]^T x_hat[t]
    dx[t] = dy[t] W + keep_a(t, :) * (dS[t] A_a) / (1 - p_a)    dbias = sum_t dy[t]

The keep mask follows the FusedLoRA rule (``lorafusion_kernels.dropout``) with ``row = t``, the
token's row in the packed batch, and is regenerated in the backward (only ``x``, ``S`` and the seed
are saved; ``scaling_a`` is applied in fp32 inside the kernels, never stored in ``S``). The frozen
GEMM is tiled over all ``T`` rows exactly as the frozen layer; only the rank-r LoRA term is routed
per segment. A microbatch whose tokens all belong to one adapter takes the FusedLoRA path.

This module holds the public op, its input checks and the plain-torch path. The Triton path is
split by job: :mod:`~lorafusion_kernels.multi_lora_params` prepares a call on the host (per-adapter
values and their device tables, seeds, the stacked adapters), :mod:`~lorafusion_kernels.multi_lora_core`
runs the kernels forward and backward, and :mod:`~lorafusion_kernels.multi_lora_autograd` wires them
into autograd and ``torch.compile``. The runtime hook
:func:`~lorafusion_kernels.multi_lora_context.multi_lora_batch` lives in
:mod:`lorafusion_kernels.multi_lora_context`, the PEFT routing of mixed-adapter batches in
:mod:`lorafusion_kernels.multi_lora_routing`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional

from lorafusion_kernels._kernels._common import MAX_RANK, runs_triton
from lorafusion_kernels.dropout import check_seed, draw_seed, dropout_keep_mask
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.lora import check_deterministic, deterministic_mode, fused_lora_linear
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora_autograd import FusedMultiLoRAFunction, compiled_forward
from lorafusion_kernels.multi_lora_params import (
    AdapterParams,
    adapter_list,
    call_batch,
    check_call,
    eager_seed,
    owned_ranks,
    owning,
    stack_adapters,
)

__all__ = ["fused_multi_lora_linear"]


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    batch: MultiLoRABatch,
    dropout_p: tuple[float, ...],
) -> None:
    if len(lora_a) != len(lora_b):
        raise LoRAFusionKernelsError(f"got {len(lora_a)} lora_a tensors but {len(lora_b)} lora_b tensors")
    for name, tensors in (("lora_a", lora_a), ("lora_b", lora_b)):
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise LoRAFusionKernelsError(
                    f"{name}[{i}] must be a tensor, got {type(t).__name__} "
                    "(an adapter without weights takes a rank-0 tensor, [0, K] or [N, 0])"
                )
    check_call(x, weight, len(lora_a), [*lora_a, *lora_b], bias, batch, dropout_p)
    n_out, k_in = weight.shape
    for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
        if not a.is_floating_point() or not b.is_floating_point():
            raise LoRAFusionKernelsError(f"lora_a[{i}] and lora_b[{i}] must be floating point, got {a.dtype}/{b.dtype}")
        if a.dim() != 2 or a.shape[1] != k_in:
            raise LoRAFusionKernelsError(f"lora_a[{i}] must be [r, {k_in}], got {list(a.shape)}")
        if a.shape[0] > MAX_RANK:
            raise LoRAFusionKernelsError(
                f"lora_a[{i}] has rank {a.shape[0]}; the kernels take ranks 0 to {MAX_RANK} (on every device)"
            )
        if b.dim() != 2 or b.shape != (n_out, a.shape[0]):
            raise LoRAFusionKernelsError(f"lora_b[{i}] must be [{n_out}, {a.shape[0]}], got {list(b.shape)}")


def fused_multi_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    *,
    segment_lengths: Sequence[int] | torch.Tensor | None = None,
    segment_adapters: Sequence[int] | torch.Tensor | None = None,
    scaling: float | Sequence[float],
    dropout_p: float | Sequence[float] = 0.0,
    bias: torch.Tensor | None = None,
    seed: int | None = None,
    batch: MultiLoRABatch | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``y = x W^T + bias + scaling_a * dropout_{p_a}(x) A_a^T B_a^T``, adapter ``a`` chosen per segment.

    Args:
        x: ``[T, K]`` packed tokens (any leading dims are flattened; ``y`` keeps them), float16,
            bfloat16 or float32; float64 runs the plain torch path in float64 on every device.
        weight: ``[N, K]`` frozen weight shared by every adapter.
        lora_a: Per adapter ``A_i [r_i, K]`` (ranks may differ; rank 0 means "no adapter").
        lora_b: Per adapter ``B_i [N, r_i]``.
        segment_lengths: Tokens per segment (ignored when ``batch`` is given).
        segment_adapters: Adapter index per segment (ignored when ``batch`` is given).
        scaling: Per adapter (or one for all) LoRA scaling, e.g. PEFT's ``lora_alpha / r``; kept in fp32.
        dropout_p: Dropout probability in ``[0, 1)``, one for all or one per adapter.
        bias: ``[N]`` or None.
        seed: Dropout seed, an integer in ``[0, 2**63)`` (checked whatever ``dropout_p``); None draws
            one from torch's generator (``torch.manual_seed`` reproduces it).
        batch: Metadata built once per microbatch with :meth:`MultiLoRABatch.from_segments`; reuse it
            across layers. Built here from the segment lists when None.
        deterministic: Sum ``dB``/``dS``/``dA`` without atomics (run-to-run identical gradients, slower);
            None follows FusedLoRA's ``deterministic_mode()`` (``torch.use_deterministic_algorithms``
            or ``LORAFUSION_DETERMINISTIC=1``). A one-adapter batch passes it on to FusedLoRA.

    Returns:
        ``[..., N]`` in ``x.dtype``. An adapter that owns no token takes no part: its ``A``/``B``
        get no gradient (``.grad`` stays None), on every path. One that owns tokens gets one, on
        every path, an empty one for rank 0.

    Raises:
        LoRAFusionKernelsError: Inconsistent shapes, token count or per-adapter lists, an input dtype
            other than the four above, p outside ``[0, 1)`` or a bad seed.
    """
    lora_a, lora_b = adapter_list(lora_a, "lora_a"), adapter_list(lora_b, "lora_b")
    batch, scales, ps = call_batch(x, len(lora_a), segment_lengths, segment_adapters, batch, scaling, dropout_p)
    _check_inputs(x, weight, lora_a, lora_b, bias, batch, ps)
    check_deterministic(deterministic)
    if seed is not None:
        seed = check_seed(seed)  # at any p (a refused seed fails now, not once dropout is on); read once
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    only = batch.single_adapter()
    if batch.total_tokens == 0:
        y = frozen_linear(x2, weight, bias)
    elif only is not None:
        y = _single_adapter(x2, weight, lora_a[only], lora_b[only], scales[only], ps[only], bias, seed, deterministic)
    elif runs_triton(x2):
        params = AdapterParams(owned_ranks(batch, [a.shape[0] for a in lora_a]), scales, ps)
        a_cat, b_cat = stack_adapters(owning(batch, lora_a), dim=0), stack_adapters(owning(batch, lora_b), dim=1)
        y = run_triton(x2, weight, bias, a_cat, b_cat, batch, params, seed, deterministic)
    else:
        y = multi_lora_torch(x2, weight, [[a] for a in lora_a], [[b] for b in lora_b], batch, scales, ps, bias, seed)
    return y.reshape(*lead, weight.shape[0])


def unit_k_stride(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` with unit stride along ``K``, as the multi-adapter kernels read it.

    A transposed or column-strided view is copied (differentiably, so a trainable weight still gets
    its gradient); a weight that already has it, the usual ``nn.Linear`` weight, is returned as is.
    """
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def run_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    batch: MultiLoRABatch,
    params: AdapterParams,
    seed: int | None,
    deterministic: bool | None,
) -> torch.Tensor:
    """``y [T, N]`` of the Triton path, differentiable: the autograd Function, or the custom op when compiling."""
    weight = unit_k_stride(weight)
    if deterministic is None:
        deterministic = deterministic_mode()
    if torch.compiler.is_compiling():
        return compiled_forward(x, weight, bias, a_cat, b_cat, batch, params, seed, deterministic)
    y: torch.Tensor = FusedMultiLoRAFunction.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, a_cat, b_cat, eager_seed(seed, params, x.device), batch, params, deterministic
    )
    return y


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The frozen layer ``x W^T + bias`` in ``x``'s dtype, for a bias of any float dtype (as the kernels take it).

    ``functional.linear`` refuses a bias whose dtype differs from ``x``'s; the bias is cast (its
    gradient comes back in its own dtype).
    """
    return functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _single_adapter(
    x: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    p: float,
    bias: torch.Tensor | None,
    seed: int | None,
    deterministic: bool | None,
) -> torch.Tensor:
    """One adapter owns every token: FusedLoRA (row ``t`` of x is token ``t``, so the mask is the same).

    A rank-0 adapter is the frozen layer. It owns tokens, so where ``A`` or ``B`` is trainable it
    gets its (empty) gradient as on the other paths: its zero product joins the graph.
    """
    if a.shape[0] == 0:
        y = frozen_linear(x, weight, bias)
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            y = y + functional.linear(functional.linear(x, a.to(x.dtype)), b.to(x.dtype))
        return y
    return fused_lora_linear(
        x, weight, a, b, scaling=scaling, dropout_p=p, bias=bias, seed=seed, deterministic=deterministic
    )


def multi_lora_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: Sequence[Sequence[torch.Tensor]],
    lora_b: Sequence[Sequence[torch.Tensor]],
    batch: MultiLoRABatch,
    scaling: tuple[float, ...],
    dropout_p: tuple[float, ...],
    bias: torch.Tensor | None,
    seed: int | None,
) -> torch.Tensor:
    """Plain-torch path (tensors no Triton kernel serves): per segment, with the kernels' dropout mask.

    ``lora_a[i]``/``lora_b[i]`` list adapter ``i``'s weights per member (one member for one layer;
    a sibling call's members share each token's mask, as in the kernels). The LoRA term is computed
    in fp32 (or x's wider dtype) and rounded to x's dtype before it is added to the frozen layer's
    output, so no half-precision intermediate of it overflows (the kernels round once, after the
    sum). Autograd differentiates it directly (it keeps the masked inputs; memory is not a concern
    here).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    if any(p > 0.0 for p in dropout_p):  # the seed is read only with dropout, as on the kernels' path
        seed = int(draw_seed("cpu").item()) if seed is None else check_seed(seed)
    y = frozen_linear(x, weight, bias)
    pieces = []
    for start, length, adapter in batch.nonempty_segments():
        xs = x[start : start + length]
        members_a, members_b, p = lora_a[adapter], lora_b[adapter], dropout_p[adapter]
        if p > 0.0:
            assert seed is not None
            keep = dropout_keep_mask(seed, length, x.shape[1], p, row_offset=start, device=x.device)
            xs = torch.where(keep, xs / (1.0 - p), torch.zeros_like(xs))
        # A rank-0 adapter ("no adapter") adds zeros through its A and B: it owns tokens, so it gets its
        # (empty) gradient, as on the kernels' path.
        deltas = [
            functional.linear(functional.linear(xs.to(compute), a.to(compute)), b.to(compute))
            for a, b in zip(members_a, members_b, strict=True)
        ]
        pieces.append(((torch.cat(deltas, dim=1) if len(deltas) > 1 else deltas[0]) * scaling[adapter]).to(x.dtype))
    return y + torch.cat(pieces, dim=0)
