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

The runtime hook :func:`~lorafusion_kernels.multi_lora_routing.multi_lora_batch` and the PEFT
routing of mixed-adapter batches live in :mod:`lorafusion_kernels.multi_lora_routing`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional

from lorafusion_kernels._kernels._common import (
    MAX_RANK,
    parameter_grads,
    rank_block,
    runs_triton,
    unaliased,
    zeroed_fp32,
)
from lorafusion_kernels._kernels.multi_lora_bwd import (
    member_grads,
    multi_lora_dsx,
    multi_lora_dys_dyb,
    multi_lora_dyw_dsa,
)
from lorafusion_kernels._kernels.multi_lora_fwd import multi_lora_linear, multi_lora_shrink
from lorafusion_kernels.dropout import check_seed, draw_seed, dropout_keep_mask, keep_threshold, seed_tensor
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.first_order import first_order_only
from lorafusion_kernels.lora import (
    check_activation_dtype,
    check_deterministic,
    check_finite,
    deterministic_mode,
    fused_lora_linear,
)
from lorafusion_kernels.metadata import MultiLoRABatch

__all__ = ["fused_multi_lora_linear"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class _AdapterParams:
    """Host-side per-adapter values of one call (they differ per layer, so never live in the batch).

    ``members`` are the output features of a sibling call's members (``multi_lora_siblings``), empty
    for one layer; ``ranks`` are then each adapter's rank in every member.
    """

    ranks: tuple[int, ...]
    scaling: tuple[float, ...]
    dropout_p: tuple[float, ...]
    members: tuple[int, ...] = ()

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for r in self.ranks:
            out.append(acc)
            acc += r
        return tuple(out)

    @property
    def has_dropout(self) -> bool:
        return any(p > 0.0 for p in self.dropout_p)

    @property
    def max_rank(self) -> int:
        return max(1, *self.ranks)

    @property
    def group(self) -> int:
        """Members ``G`` sharing each adapter's ``S`` (1 for one layer)."""
        return max(1, len(self.members))

    @property
    def stacked_rank(self) -> int:
        """Largest rank of an adapter's stacked ``A`` (``G r_a``): the width of ``S`` and ``dS``."""
        return self.group * self.max_rank

    @property
    def block_r(self) -> int:
        return rank_block(self.stacked_rank)


@dataclass(frozen=True)
class _DeviceParams:
    ranks: torch.Tensor
    """int32 ``[n, 2]``: ``(r_a, roff_a)``."""
    a_ranks: torch.Tensor
    """int32 ``[n, 2]``: rows of each adapter in the stacked ``A``, ``(G r_a, G roff_a)`` (``ranks`` when G = 1)."""
    bounds: torch.Tensor | None
    """int32 ``[G + 1]``: the members' column bounds of a sibling call; None for one layer."""
    scaling: torch.Tensor
    """fp32 ``[n]``."""
    inv_keep: torch.Tensor
    """fp32 ``[n]``: ``1 / (1 - p_a)``."""
    thresholds: torch.Tensor
    """int32 ``[n]``: ``ceil(p_a * 2**16)``."""
    zero_seed: torch.Tensor
    """int64 ``[1]``, passed where no dropout runs (the kernels never read it then)."""


@functools.lru_cache(maxsize=256)
def _device_params(params: _AdapterParams, device: torch.device) -> _DeviceParams:
    """The per-adapter tables on ``device``; cached, so layers with equal values share one copy.

    Values stay fp32 (never rounded to the activation dtype) and reach the kernels as runtime data,
    so a new scaling or p never recompiles anything.
    """

    def put(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    ranks = put([[r, o] for r, o in zip(params.ranks, params.offsets, strict=True)], torch.int32).reshape(-1, 2)
    g = params.group
    bounds = [0]
    for n in params.members:
        bounds.append(bounds[-1] + n)
    return _DeviceParams(
        ranks=ranks,
        a_ranks=ranks if g == 1 else ranks * g,
        bounds=put(bounds, torch.int32) if params.members else None,
        scaling=put(list(params.scaling), torch.float32),
        inv_keep=put([1.0 / (1.0 - p) for p in params.dropout_p], torch.float32),
        thresholds=put([keep_threshold(p) for p in params.dropout_p], torch.int32),
        zero_seed=put([0], torch.int64),
    )


def adapter_list(tensors: Sequence[torch.Tensor], name: str) -> Sequence[torch.Tensor]:
    """``tensors`` as a list or tuple, one per adapter index; a lone tensor or a non-sequence is refused."""
    if isinstance(tensors, list | tuple):
        return tensors
    got = "one tensor" if isinstance(tensors, torch.Tensor) else type(tensors).__name__
    raise LoRAFusionKernelsError(
        f"{name} must be a list or tuple with one tensor per adapter index, got {got}: "
        f"pass [{name}] for one adapter (or fused_lora_linear)"
    )


def _per_adapter(value: float | Sequence[float], n: int, name: str) -> tuple[float, ...]:
    # A tensor, or a NumPy array or scalar (hasattr is not traced by torch.compile, which never gets one).
    if isinstance(value, torch.Tensor) or (not torch.compiler.is_compiling() and hasattr(value, "tolist")):
        value = value.tolist()
    if value is None or isinstance(value, (int, float, str)):
        check_finite(value, name)
        return (float(value),) * n
    if isinstance(value, Mapping | Set):
        raise LoRAFusionKernelsError(
            f"{name} must be one number or a sequence with one entry per adapter index, in order; "
            f"got a {type(value).__name__}, whose iteration order is not the adapters' (pass [..] in index order)"
        )
    values = list(value)  # once: a generator would be empty the second time
    for v in values:
        check_finite(v, name)
    if len(values) != n:
        raise LoRAFusionKernelsError(f"{name} has {len(values)} entries for {n} adapters; give one per adapter")
    return tuple(float(v) for v in values)


def check_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    adapters: int,
    lora: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    batch: MultiLoRABatch,
    dropout_p: tuple[float, ...],
) -> None:
    """The checks every multi-adapter call shares: dtypes, one device, ``x``/``W``/bias shapes, token count, p.

    Args:
        x: The call's input.
        weight: ``[N, K]``.
        adapters: How many adapters the call gives.
        lora: Every LoRA tensor of the call (for the device check).
        bias: ``[N]`` or None.
        batch: The call's routing.
        dropout_p: Per adapter.
    """
    if x.dim() == 0:
        raise LoRAFusionKernelsError("x must be [..., K] (at least 1-D), got a 0-d tensor")
    if adapters < batch.num_adapters:
        raise LoRAFusionKernelsError(
            f"the batch routes tokens to {batch.num_adapters} adapters but only {adapters} are given"
        )
    check_activation_dtype(x)
    if weight.dtype != x.dtype:
        raise LoRAFusionKernelsError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if weight.dim() != 2:
        raise LoRAFusionKernelsError(f"weight must be [N, K], got {list(weight.shape)}")
    tensors = [x, weight, *lora, *([bias] if bias is not None else [])]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise LoRAFusionKernelsError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    n_out, k_in = weight.shape
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise LoRAFusionKernelsError(f"bias must be [{n_out}], got {list(bias.shape)}")
    if bias is not None and not bias.is_floating_point():
        raise LoRAFusionKernelsError(f"bias must be floating point, got {bias.dtype}")
    if x.shape[-1] != k_in:
        raise LoRAFusionKernelsError(f"x has {x.shape[-1]} features but weight is [{n_out}, {k_in}]")
    if k_in == 0:
        raise LoRAFusionKernelsError(f"in_features must be at least 1, got weight [{n_out}, 0]")
    tokens = x.numel() // k_in if k_in else 0
    if tokens != batch.total_tokens:
        raise LoRAFusionKernelsError(
            f"x holds {tokens} tokens but the segments add up to {batch.total_tokens}; "
            "segment_lengths must cover the flattened tokens exactly"
        )
    for a, p in enumerate(dropout_p):
        if not 0.0 <= p < 1.0:
            raise LoRAFusionKernelsError(f"dropout_p must be in [0, 1), got {p} for adapter index {a}")


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
        params = _AdapterParams(owned_ranks(batch, [a.shape[0] for a in lora_a]), scales, ps)
        a_cat, b_cat = _stack(owning(batch, lora_a), dim=0), _stack(owning(batch, lora_b), dim=1)
        y = run_triton(x2, weight, bias, a_cat, b_cat, batch, params, seed, deterministic)
    else:
        y = multi_lora_torch(x2, weight, [[a] for a in lora_a], [[b] for b in lora_b], batch, scales, ps, bias, seed)
    return y.reshape(*lead, weight.shape[0])


def call_batch(
    x: torch.Tensor,
    num_adapters: int,
    segment_lengths: Sequence[int] | torch.Tensor | None,
    segment_adapters: Sequence[int] | torch.Tensor | None,
    batch: MultiLoRABatch | None,
    scaling: float | Sequence[float],
    dropout_p: float | Sequence[float],
) -> tuple[MultiLoRABatch, tuple[float, ...], tuple[float, ...]]:
    """A call's batch on ``x``'s device (built from the segment lists when None), scalings and ps per adapter."""
    if batch is None:
        if segment_lengths is None or segment_adapters is None:
            raise LoRAFusionKernelsError("give either batch= or both segment_lengths= and segment_adapters=")
        indices = segment_adapters.tolist() if isinstance(segment_adapters, torch.Tensor) else list(segment_adapters)
        if num_adapters == 0:
            raise LoRAFusionKernelsError("lora_a and lora_b are empty: give one A and one B per adapter")
        if indices and max(indices) >= num_adapters:
            raise LoRAFusionKernelsError(
                f"segment_adapters = {indices} refers to adapter {max(indices, default=0)}, but lora_a and lora_b "
                f"hold {num_adapters} adapters (indices 0 to {num_adapters - 1}): give one A and one B per adapter"
            )
        batch = MultiLoRABatch.from_segments(
            segment_lengths, segment_adapters, num_adapters=num_adapters, device=x.device
        )
    elif segment_lengths is not None or segment_adapters is not None:
        raise LoRAFusionKernelsError("give either batch= or segment_lengths= and segment_adapters=, not both")
    else:
        batch = batch.to(x.device)
    return batch, _per_adapter(scaling, num_adapters, "scaling"), _per_adapter(dropout_p, num_adapters, "dropout_p")


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
    params: _AdapterParams,
    seed: int | None,
    deterministic: bool | None,
) -> torch.Tensor:
    """``y [T, N]`` of the Triton path, differentiable: the autograd Function, or the custom op when compiling."""
    weight = unit_k_stride(weight)
    if deterministic is None:
        deterministic = deterministic_mode()
    if torch.compiler.is_compiling():
        return _compiled_forward(x, weight, bias, a_cat, b_cat, batch, params, seed, deterministic)
    y: torch.Tensor = _FusedMultiLoRA.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, a_cat, b_cat, eager_seed(seed, params, x.device), batch, params, deterministic
    )
    return y


def eager_seed(seed: int | None, params: _AdapterParams, device: torch.device) -> torch.Tensor:
    """The seed tensor of an eager call: drawn (or ``seed`` wrapped) with dropout, a cached zero without."""
    return _seed_for(seed, device) if params.has_dropout else _device_params(params, device).zero_seed


def _seed_for(seed: int | None, device: torch.device) -> torch.Tensor:
    return draw_seed(device) if seed is None else seed_tensor(seed, device)


def _compiled_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    batch: MultiLoRABatch,
    params: _AdapterParams,
    seed: int | None,
    deterministic: bool,
) -> torch.Tensor:
    """The Triton path as ``torch.compile`` sees it: the ``lorafusion::fused_multi_lora_forward`` custom op.

    The batch reaches the op as its host segment lists, which Dynamo guards on (a batch with other
    segments recompiles once, then Dynamo makes the lengths dynamic); the op looks the batch's
    device tables up by those lists, built once per distinct batch.
    """
    # Without dropout the seed is never read: a traced zeros op, not the cached tensor of `_device_params`.
    no_seed = not params.has_dropout
    seed_t = torch.zeros(1, dtype=torch.int64, device=x.device) if no_seed else _seed_for(seed, x.device)
    y, _ = torch.ops.lorafusion.fused_multi_lora_forward(
        x,
        weight,
        bias,
        a_cat,
        b_cat,
        seed_t,
        list(batch.segment_lengths),
        list(batch.segment_adapters),
        batch.num_adapters,
        list(params.ranks),
        list(params.scaling),
        list(params.dropout_p),
        list(params.members),
        deterministic,
    )
    return cast(torch.Tensor, y)


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


def shrink(
    x: torch.Tensor, a_cat: torch.Tensor, seed: torch.Tensor, batch: MultiLoRABatch, params: _AdapterParams
) -> torch.Tensor:
    """``S [T, BLOCK_R]``: every token's ``dropout(x) A_a^T`` (``x`` contiguous)."""
    dev = _device_params(params, x.device)
    return multi_lora_shrink(
        x,
        a_cat.contiguous(),
        batch,
        block_r=params.block_r,
        max_rank=params.stacked_rank,
        ranks=dev.a_ranks,
        thresholds=dev.thresholds,
        inv_keep=dev.inv_keep,
        seed=seed,
        has_dropout=params.has_dropout,
    )


def _forward_core(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    batch: MultiLoRABatch,
    params: _AdapterParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, N], S [T, BLOCK_R])`` of the Triton path; ``S`` is what the backward needs besides ``x``."""
    x = x.contiguous()
    dev = _device_params(params, x.device)
    s = shrink(x, a_cat, seed, batch, params)
    y = multi_lora_linear(
        x, weight, bias, s, b_cat.contiguous(), batch, ranks=dev.ranks, scaling=dev.scaling, max_rank=params.max_rank,
        bounds=dev.bounds, ranks_host=params.ranks,
    )  # fmt: skip
    return y, s


def _backward_core(
    dy: torch.Tensor | tuple[torch.Tensor, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    batch: MultiLoRABatch,
    params: _AdapterParams,
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [T, K], dA_cat [R_tot, K], dB_cat [N, R_tot])``; ``dx``/``dA_cat`` are empty ``[0]`` when not needed.

    ``dy`` is ``[T, N]``, or a sibling call's members' gradients ``[T, N_g]``, which the kernels read
    where they are.
    """
    x, a_cat, b_cat = x.contiguous(), a_cat.contiguous(), b_cat.contiguous()
    dev = _device_params(params, x.device)
    dys = tuple(d.contiguous() for d in member_grads(dy))
    buffer = da_out = None
    if deterministic:
        ds, db = _dys_dyb_by_segment(_side_by_side(dys), b_cat, s, batch, params)
    else:
        # One zeroed fp32 buffer [dB | dA | dS] takes every atomic sum: one fill, and for adapters of
        # one dtype one conversion of the [dB | dA] span (none for fp32 adapters).
        da_rows = a_cat.shape[0] if need_da else 0
        shapes = ((1, b_cat.numel()), (da_rows, x.shape[1]), (x.shape[0], s.shape[1]))
        buffer, (db, da_out, ds) = zeroed_fp32(*shapes, device=x.device)
        db = db.view(b_cat.shape)
        multi_lora_dys_dyb(
            dys, b_cat, s, batch, ranks=dev.ranks, scaling=dev.scaling, max_rank=params.max_rank,
            members=params.members, bounds=dev.bounds, ranks_host=params.ranks, accumulators=(ds, db),
        )  # fmt: skip
    dropout: dict[str, Any] = {
        "max_rank": params.stacked_rank,
        "ranks": dev.a_ranks,
        "thresholds": dev.thresholds,
        "inv_keep": dev.inv_keep,
        "seed": seed,
        "has_dropout": params.has_dropout,
    }
    da_args: dict[str, Any] = {
        "r_tot": a_cat.shape[0], "out_dtype": a_cat.dtype, "deterministic": deterministic, "out": da_out,
    }  # fmt: skip
    if need_dx and need_da and len(dys) == 1 and _dx_from_da_pass(*weight.shape):
        dx = torch.empty_like(x)
        da = multi_lora_dsx(ds, x, batch, lora_dx=(a_cat, dx), **da_args, **dropout)
        dx.addmm_(dys[0], weight)
    else:
        dx = (
            multi_lora_dyw_dsa(dys, weight, ds, a_cat, batch, bounds=dev.bounds, **dropout)
            if need_dx
            else x.new_empty(0)
        )
        da = multi_lora_dsx(ds, x, batch, **da_args, **dropout) if need_da else x.new_empty(0)
    if buffer is None or da_out is None:  # deterministic: dA is in A's dtype already
        return dx, da, db.to(b_cat.dtype)
    da_cast, db = parameter_grads(buffer, db, da_out, a_cat.dtype, b_cat.dtype)
    return dx, (da_cast if need_da else da), db


def _dx_from_da_pass(n: int, k: int) -> bool:
    """Whether, for a weight ``[n, k]``, the ``dA`` pass writes dx's LoRA term and cuBLAS adds ``dy W`` in place.

    That draws the dropout mask once instead of twice (the fused dx GEMM draws it again) and runs the
    big product at cuBLAS's speed; the LoRA term is rounded to dx's dtype once before the sum (the
    fused GEMM keeps it in fp32). Only where ``K <= N``: writing the ``[T, K]`` term costs more than
    the fused GEMM loses to cuBLAS when dx is the wide side (H100, 4 adapters, whole grid,
    2026-11-25: the down projections went from 1.22x to 1.24x the frozen layer on LLaMa-3.1-8B; o,
    qkv and gate_up gained 0-4%).
    """
    return k <= n


def _side_by_side(dys: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``dy [T, N]`` from the members' gradients (itself when there is one)."""
    return dys[0] if len(dys) == 1 else torch.cat(dys, dim=1)


def owning(batch: MultiLoRABatch, values: Sequence[_T]) -> list[_T]:
    """The ``values`` of the adapters that own tokens of ``batch``, in adapter order.

    Only their weights are stacked, so an adapter without tokens stays out of the autograd graph and
    its ``.grad`` stays None, as on the torch path and in PEFT (not zeros, which an optimizer would
    step on).
    """
    return [v for v, owns in zip(values, _owns_tokens(batch, len(values)), strict=True) if owns]


def owned_ranks(batch: MultiLoRABatch, ranks: Sequence[int]) -> tuple[int, ...]:
    """``ranks`` with 0 ("no adapter") for the adapters that own no token: the stacked layout of :func:`owning`."""
    return tuple(r if owns else 0 for r, owns in zip(ranks, _owns_tokens(batch, len(ranks)), strict=True))


def _owns_tokens(batch: MultiLoRABatch, count: int) -> list[bool]:
    """For adapters ``0 .. count - 1`` of a call: whether each owns tokens (those past the batch's own none)."""
    return [a < batch.num_adapters and batch.adapter_tokens[a] > 0 for a in range(count)]


def _stack(tensors: Sequence[torch.Tensor], *, dim: int) -> torch.Tensor:
    """``tensors`` concatenated along ``dim`` in the dtype that holds each exactly (fp32 if any is fp32).

    Stacked in the adapters' own dtype (fp32 under PEFT's default autocast), the kernels cast tiles
    to x's dtype as they load them, and the gradients come back without conversions.
    """
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.cat([t if t.dtype == dtype else t.to(dtype) for t in tensors], dim=dim)


@functools.lru_cache(maxsize=64)
def _batch_of(
    segment_lengths: tuple[int, ...], segment_adapters: tuple[int, ...], num_adapters: int, device: torch.device
) -> MultiLoRABatch:
    """The batch a custom-op call describes by its segment lists; cached, so every layer reuses its tables."""
    return MultiLoRABatch(segment_lengths, segment_adapters, num_adapters, device)


def _op_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lorafusion::fused_multi_lora_forward``: :func:`_forward_core` with the batch given as its segment lists.

    ``deterministic`` is read by the backward only (its autograd context keeps it).
    """
    batch = _batch_of(tuple(segment_lengths), tuple(segment_adapters), num_adapters, x.device)
    params = _AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p), tuple(members))
    return _forward_core(x, weight, bias, a_cat, b_cat, seed, batch, params)


def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lorafusion::fused_multi_lora_backward``: :func:`_backward_core` with the batch given as its segment lists.

    Its outputs may not share storage, so dA comes out :func:`unaliased` from dB.
    """
    batch = _batch_of(tuple(segment_lengths), tuple(segment_adapters), num_adapters, x.device)
    params = _AdapterParams(tuple(ranks), tuple(scaling), tuple(dropout_p), tuple(members))
    dx, da, db = _backward_core(dy, x, weight, a_cat, b_cat, s, seed, batch, params, need_dx, need_da, deterministic)
    return dx, unaliased(da, db), db


_SEGMENTS_SCHEMA = (
    "int[] segment_lengths, int[] segment_adapters, int num_adapters, int[] ranks, float[] scaling, float[] dropout_p, "
    "int[] members"
)

_multi_forward_op = torch.library.custom_op(
    "lorafusion::fused_multi_lora_forward",
    _op_forward,
    mutates_args=(),
    schema=f"(Tensor x, Tensor weight, Tensor? bias, Tensor a_cat, Tensor b_cat, Tensor seed, {_SEGMENTS_SCHEMA}, "
    "bool deterministic) -> (Tensor, Tensor)",
)


@_multi_forward_op.register_fake
def _op_forward_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    block_r = rank_block(max(1, len(members)) * max(1, *ranks))
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((x.shape[0], block_r))


_multi_backward_op = torch.library.custom_op(
    "lorafusion::fused_multi_lora_backward",
    _op_backward,
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor weight, Tensor a_cat, Tensor b_cat, Tensor s, Tensor seed, "
    f"{_SEGMENTS_SCHEMA}, bool need_dx, bool need_da, bool deterministic) -> (Tensor, Tensor, Tensor)",
)


@_multi_backward_op.register_fake
def _op_backward_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    segment_lengths: Sequence[int],
    segment_adapters: Sequence[int],
    num_adapters: int,
    ranks: Sequence[int],
    scaling: Sequence[float],
    dropout_p: Sequence[float],
    members: Sequence[int],
    need_dx: bool,
    need_da: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = dy.new_empty((dy.shape[0], weight.shape[1])) if need_dx else dy.new_empty(0)
    da = torch.empty_like(a_cat) if need_da else x.new_empty(0)
    return dx, da, torch.empty_like(b_cat)


def _save_for_backward(
    ctx: Any,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor],
    s: torch.Tensor,
    segments: tuple[tuple[int, ...], tuple[int, ...], int],
    params: _AdapterParams,
    deterministic: bool,
) -> None:
    """Saves ``x``, ``S`` and the seed (no mask, no ``x_hat``).

    Args:
        ctx: The autograd context.
        inputs: ``(x, W, bias, A_cat, B_cat, seed)``.
        s: ``S [T, BLOCK_R]`` from the forward.
        segments: ``(segment_lengths, segment_adapters, num_adapters)`` of the batch.
        params: Per-adapter ranks, scaling and p.
        deterministic: Whether the backward avoids atomics.
    """
    x, weight, bias, a_cat, b_cat, seed = inputs
    ctx.save_for_backward(x, weight, a_cat, b_cat, s, seed)
    ctx.segments = segments
    ctx.params = params
    ctx.deterministic = deterministic
    ctx.has_bias = bias is not None


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``setup_context`` of ``lorafusion::fused_multi_lora_forward`` (inputs in its schema's order).

    It also runs on fake tensors while AOTAutograd traces, so it builds no batch (no device tables).
    """
    x, weight, bias, a_cat, b_cat, seed, lengths, adapters, num_adapters, *per_adapter, det = inputs
    segments = (tuple(lengths), tuple(adapters), num_adapters)
    params = _AdapterParams(*(tuple(values) for values in per_adapter))
    _save_for_backward(ctx, (x, weight, bias, a_cat, b_cat, seed), output[1], segments, params, det)


def _backward(
    ctx: Any, dy: torch.Tensor | tuple[torch.Tensor, ...], *_unused: Any, opaque: bool = True
) -> tuple[torch.Tensor | None, ...]:
    """Shared backward; ``opaque`` routes through the custom op (always, when AOTAutograd traces it).

    ``dy`` is ``[T, N]``, or (eager sibling calls, not opaque) the members' gradients ``[T, N_g]``.
    """
    x, weight, a_cat, b_cat, s, seed = ctx.saved_tensors
    params: _AdapterParams = ctx.params
    need_dx, need_da = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[3])
    if opaque:
        assert isinstance(dy, torch.Tensor)
        lengths, adapters, num_adapters = ctx.segments
        dx, da, db = torch.ops.lorafusion.fused_multi_lora_backward(
            dy,
            x,
            weight,
            a_cat,
            b_cat,
            s,
            seed,
            list(lengths),
            list(adapters),
            num_adapters,
            list(params.ranks),
            list(params.scaling),
            list(params.dropout_p),
            list(params.members),
            need_dx,
            need_da,
            ctx.deterministic,
        )
    else:
        dx, da, db = _backward_core(
            dy, x, weight, a_cat, b_cat, s, seed, ctx.batch, params, need_dx, need_da, ctx.deterministic
        )
    full = _side_by_side(member_grads(dy)) if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None
    dw = full.t().mm(x) if full is not None and ctx.needs_input_grad[1] else None
    dbias = (
        full.sum(dim=0, dtype=torch.float32).to(full.dtype)
        if full is not None and ctx.has_bias and ctx.needs_input_grad[2]
        else None
    )
    grads = (dx if need_dx else None, dw, dbias, da if need_da else None, db if ctx.needs_input_grad[4] else None)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


class _FusedMultiLoRA(torch.autograd.Function):
    """Autograd of the Triton path for eager calls; saves ``x``, ``S`` and the seed.

    Eager calls use this Function, which takes the :class:`MultiLoRABatch` object itself (no Python
    dispatch of a custom op, no lookup of the batch); under ``torch.compile`` the same forward and
    backward run as the custom ops ``lorafusion::fused_multi_lora_forward`` / ``fused_multi_lora_backward``,
    which take the batch as its segment lists.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a_cat: torch.Tensor,
        b_cat: torch.Tensor,
        seed: torch.Tensor,
        batch: MultiLoRABatch,
        params: _AdapterParams,
        deterministic: bool,
    ) -> torch.Tensor:
        """``y [T, N]``."""
        y, s = _forward_core(x, weight, bias, a_cat, b_cat, seed, batch, params)
        segments = (batch.segment_lengths, batch.segment_adapters, batch.num_adapters)
        _save_for_backward(ctx, (x, weight, bias, a_cat, b_cat, seed), s, segments, params, deterministic)
        ctx.batch = batch
        return y

    @staticmethod
    @first_order_only  # the backward is not itself differentiable: create_graph=True raises
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(dx, dW, dbias, dA_cat, dB_cat, None, ...)`` by the chain rule of the module docstring."""
        return _backward(ctx, dy, opaque=False)


# As FusedLoRA's: the guard acts where the custom op's backward runs at backward time (no AOTAutograd).
_multi_forward_op.register_autograd(first_order_only(_backward), setup_context=_setup_context)


def _dys_dyb_by_segment(
    dy: torch.Tensor, b_cat: torch.Tensor, s: torch.Tensor, batch: MultiLoRABatch, params: _AdapterParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``dS``/``dB``: plain matmuls per segment (and member), summed in segment order (no atomics)."""
    ds = torch.zeros((dy.shape[0], s.shape[1]), dtype=torch.float32, device=dy.device)
    db = torch.zeros(b_cat.shape, dtype=torch.float32, device=dy.device)
    offsets = params.offsets
    for start, length, adapter in batch.nonempty_segments():
        r, roff, scale = params.ranks[adapter], offsets[adapter], params.scaling[adapter]
        if r == 0:
            continue
        rows = slice(start, start + length)
        if not params.members:
            mine = slice(roff, roff + r)
            _segment_ds_db(dy[rows], b_cat[:, mine], s[rows, :r], scale, ds[rows, :r], db[:, mine])
            continue
        n = dy.shape[1]
        b_a = b_cat[n * roff : n * (roff + r)].view(n, r)
        db_a = db[n * roff : n * (roff + r)].view(n, r)
        for g, cols in enumerate(_member_slices(params.members)):
            member = slice(g * r, (g + 1) * r)
            _segment_ds_db(dy[rows, cols], b_a[cols], s[rows, member], scale, ds[rows, member], db_a[cols])
    return ds, db


ROW_CHUNK = 2048
"""Rows of ``dy`` copied to fp32 at a time by :func:`_segment_ds_db` (the copy is ``ROW_CHUNK x N x 4`` bytes)."""


def _segment_ds_db(
    dy: torch.Tensor, b: torch.Tensor, s: torch.Tensor, scale: float, ds_out: torch.Tensor, db_out: torch.Tensor
) -> None:
    """``ds_out = scale * dy b`` and ``db_out += scale * dy^T s`` for one segment, in fp32, row chunk by row chunk.

    ``dy [rows, n]``, ``b [n, r]`` (rounded to dy's dtype first, as the kernels do), ``s [rows, r]``;
    ``ds_out``/``db_out`` are fp32 views. Summing in fp32 as the kernels do keeps fp16's range: a
    half-precision ``dy^T s`` would overflow before a ``scale`` below 1 brings it back. The chunks
    are summed in a fixed order, so the result is reproducible.
    """
    b32 = b.to(dy.dtype).float()
    for lo in range(0, dy.shape[0], ROW_CHUNK):
        chunk = dy[lo : lo + ROW_CHUNK].float()
        ds_out[lo : lo + ROW_CHUNK] = chunk @ b32 * scale
        db_out += chunk.t() @ s[lo : lo + ROW_CHUNK].float() * scale


def _member_slices(members: Sequence[int]) -> list[slice]:
    """The output columns of each member of a sibling call."""
    out, start = [], 0
    for n in members:
        out.append(slice(start, start + n))
        start += n
    return out
