"""FusedMultiLoRA's host side of a call: per-adapter values and their device tables, checks, seeds, stacking.

Shared by :mod:`lorafusion_kernels.multi_lora` and :mod:`lorafusion_kernels.multi_lora_siblings`; no
kernel runs here. Only the adapters that own tokens are stacked (:func:`owning`), so one without
tokens stays out of the autograd graph.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lorafusion_kernels._kernels._common import rank_block
from lorafusion_kernels.dropout import draw_seed, keep_threshold, seed_tensor
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.lora import check_activation_dtype, check_finite, check_not_trainable, dtype_mismatch
from lorafusion_kernels.metadata import MultiLoRABatch, as_int_list

__all__ = [
    "AdapterParams",
    "DeviceParams",
    "adapter_list",
    "call_batch",
    "check_call",
    "device_params",
    "eager_seed",
    "owned_ranks",
    "owning",
    "per_adapter",
    "seed_for",
    "stack_adapters",
]


_T = TypeVar("_T")


@dataclass(frozen=True)
class AdapterParams:
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
        """Each adapter's first row in the stacked ``A`` (column in the stacked ``B``): running sums of ``ranks``."""
        out, acc = [], 0
        for r in self.ranks:
            out.append(acc)
            acc += r
        return tuple(out)

    @property
    def has_dropout(self) -> bool:
        """Whether any adapter has ``p > 0`` (else no mask is drawn and the seed is never read)."""
        return any(p > 0.0 for p in self.dropout_p)

    @property
    def max_rank(self) -> int:
        """Largest rank of the call, at least 1."""
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
        """The kernels' rank tile for :attr:`stacked_rank`: the width of the saved ``S``."""
        return rank_block(self.stacked_rank)


@dataclass(frozen=True)
class DeviceParams:
    """The per-adapter values of :class:`AdapterParams` as device tables the kernels read."""

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
def device_params(params: AdapterParams, device: torch.device) -> DeviceParams:
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
    return DeviceParams(
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


def per_adapter(value: float | Sequence[float], n: int, name: str) -> tuple[float, ...]:
    """``value`` (one number for all, or a sequence in adapter order) as ``n`` finite floats; else a clear error."""
    if isinstance(value, torch.Tensor):
        check_not_trainable(value, name)  # before .tolist(), which would detach it without a word
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
        raise dtype_mismatch(x, weight)
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
        batch = _batch_of_lists(x, num_adapters, segment_lengths, segment_adapters)
    elif segment_lengths is not None or segment_adapters is not None:
        raise LoRAFusionKernelsError("give either batch= or segment_lengths= and segment_adapters=, not both")
    elif not isinstance(batch, MultiLoRABatch):
        raise LoRAFusionKernelsError(
            f"batch must be a MultiLoRABatch, got {type(batch).__name__}: build it with "
            "MultiLoRABatch.from_segments(segment_lengths, segment_adapters), or pass segment_lengths= and "
            "segment_adapters= instead of batch="
        )
    else:
        batch = batch.to(x.device)
    return batch, per_adapter(scaling, num_adapters, "scaling"), per_adapter(dropout_p, num_adapters, "dropout_p")


def _batch_of_lists(
    x: torch.Tensor,
    num_adapters: int,
    segment_lengths: Sequence[int] | torch.Tensor,
    segment_adapters: Sequence[int] | torch.Tensor,
) -> MultiLoRABatch:
    """The batch of a call given segment lists, on ``x``'s device, for its ``num_adapters`` adapters.

    The lists are read once, by the helper that names a bad one (a generator would be empty the
    second time; an int or a string is no list of integers).
    """
    lengths = as_int_list(segment_lengths, "segment_lengths")
    indices = as_int_list(segment_adapters, "segment_adapters")
    if num_adapters == 0:
        raise LoRAFusionKernelsError("lora_a and lora_b are empty: give one A and one B per adapter")
    if indices and max(indices) >= num_adapters:
        raise LoRAFusionKernelsError(
            f"segment_adapters = {indices} refers to adapter {max(indices)}, but lora_a and lora_b "
            f"hold {num_adapters} adapters (indices 0 to {num_adapters - 1}): give one A and one B per adapter"
        )
    return MultiLoRABatch.from_segments(lengths, indices, num_adapters=num_adapters, device=x.device)


def eager_seed(seed: int | None, params: AdapterParams, device: torch.device) -> torch.Tensor:
    """The seed tensor of an eager call: drawn (or ``seed`` wrapped) with dropout, a cached zero without."""
    return seed_for(seed, device) if params.has_dropout else device_params(params, device).zero_seed


def seed_for(seed: int | None, device: torch.device) -> torch.Tensor:
    """``seed`` as the kernels' int64 seed tensor on ``device``; drawn from torch's generator when None."""
    return draw_seed(device) if seed is None else seed_tensor(seed, device)


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


def stack_adapters(tensors: Sequence[torch.Tensor], *, dim: int) -> torch.Tensor:
    """``tensors`` concatenated along ``dim`` in the dtype that holds each exactly (fp32 if any is fp32).

    Stacked in the adapters' own dtype (fp32 under PEFT's default autocast), the kernels cast tiles
    to x's dtype as they load them, and the gradients come back without conversions.
    """
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.cat([t if t.dtype == dtype else t.to(dtype) for t in tensors], dim=dim)
