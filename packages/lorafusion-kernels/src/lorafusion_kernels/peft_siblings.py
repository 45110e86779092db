"""Sibling PEFT LoRA layers (q/k/v, gate/up) as one FusedMultiLoRA call in mixed-adapter batches.

:func:`fuse_sibling_layers` finds, in a model patched with ``patch_peft_model``, the groups of PEFT
``lora.Linear`` layers that one parent module feeds with the same input (by default ``q_proj``,
``k_proj``, ``v_proj`` and ``gate_proj``, ``up_proj``), stacks each group's frozen weights into one
buffer and makes the layers' weights row views of it (no copy is left behind; the state dict is
unchanged). Inside :func:`~lorafusion_kernels.multi_lora_batch`, the first member called with an
input ``x`` computes every member's output with
:func:`~lorafusion_kernels.fused_multi_lora_siblings` and keeps the others' until their own call
with the same ``x`` (same tensor, same version, same batch, same grad mode); any other call runs
the member alone, as before.

Members share each token's dropout mask (see ``multi_lora_siblings``): a model whose members must draw
independent masks should not fuse them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lorafusion_kernels._kernels._common import MAX_RANK, runs_triton
from lorafusion_kernels.errors import OnceWarnings
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora_siblings import fused_multi_lora_siblings

__all__ = ["DEFAULT_SIBLINGS", "fuse_sibling_layers", "sibling_forward", "unfuse_sibling_layers"]

DEFAULT_SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Child names that read one input in LLaMA-, Qwen- and Mistral-style decoder layers."""

_SIBLING = "_lorafusion_sibling"


@dataclass(eq=False)
class _Pending:
    """Outputs of one sibling call that their members have not collected yet."""

    x: torch.Tensor
    version: int
    batch: MultiLoRABatch
    grad_enabled: bool
    outputs: list[torch.Tensor | None]


@dataclass(eq=False)
class SiblingGroup:
    """Layers that read one input, with their frozen weights stacked by rows into one buffer."""

    members: tuple[Any, ...]
    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: tuple[int, ...]
    pending: _Pending | None = field(default=None, repr=False)

    def intact(self) -> bool:
        """Whether every member's weight (and bias) is still its row view of the stacked buffer.

        ``model.to(...)`` and similar replace each parameter on its own, which ends the sharing.
        """
        row = 0
        for layer, n in zip(self.members, self.out_features, strict=True):
            base = layer.get_base_layer()
            if not _is_rows_of(base.weight, self.weight, row, n):
                return False
            if self.bias is not None and not _is_rows_of(base.bias, self.bias, row, n):
                return False
            row += n
        return True


def _is_rows_of(t: torch.Tensor | None, buffer: torch.Tensor, row: int, n: int) -> bool:
    if t is None or t.dtype != buffer.dtype or t.device != buffer.device or t.shape[0] != n:
        return False
    return bool(t.data_ptr() == buffer.data_ptr() + row * buffer.stride(0) * buffer.element_size())


def fuse_sibling_layers(model: nn.Module, groups: Sequence[Sequence[str]] = DEFAULT_SIBLINGS) -> int:
    """Stack the frozen weights of each group of sibling PEFT ``lora.Linear`` layers; returns the groups fused.

    A group is fused when one module holds every named child, each a ``lora.Linear`` patched by
    ``patch_peft_model`` with a plain ``nn.Linear`` base, all with the same ``in_features``, dtype
    and device, frozen weights, and frozen biases on all or none. Call it after the model has its final
    device and dtype (moving the model afterwards ends the fusion: the layers then run alone, with
    one warning). Calling it twice is harmless.

    Args:
        model: A ``PeftModel`` (or any module holding PEFT LoRA layers) patched with ``patch_peft_model``.
        groups: Child names of each kind of group, in the order their outputs are stacked.

    Returns:
        How many groups are fused now.
    """
    from lorafusion_kernels.peft_integration import is_patched

    fused = 0
    for parent in model.modules():
        for names in groups:
            found = [getattr(parent, name, None) for name in names]
            layers = [layer for layer in found if layer is not None and is_patched(layer)]
            if len(layers) < 2 or len(layers) != len(found):
                continue
            if all(getattr(layer, _SIBLING, None) is not None for layer in layers):
                fused += 1
                continue
            bases = [layer.get_base_layer() for layer in layers]
            if not _stackable(bases):
                continue
            group = _stack_group(layers, bases)
            for index, layer in enumerate(layers):
                setattr(layer, _SIBLING, (group, index))
            fused += 1
    return fused


def unfuse_sibling_layers(model: nn.Module) -> int:
    """Let every layer run alone again (the weights stay row views of the stacked buffers); returns the layers."""
    count = 0
    for module in model.modules():
        if getattr(module, _SIBLING, None) is not None:
            delattr(module, _SIBLING)
            count += 1
    return count


def _stackable(bases: list[Any]) -> bool:
    first = bases[0]
    if any(type(b) is not nn.Linear for b in bases):
        return False
    # A trainable weight or bias would get its gradient through the stacked buffer, never itself.
    if any(b.weight.requires_grad or (b.bias is not None and b.bias.requires_grad) for b in bases):
        return False
    same = {(b.in_features, b.weight.dtype, b.weight.device, b.bias is None) for b in bases}
    return len(same) == 1 and first.weight.dim() == 2


def _stack_group(layers: list[Any], bases: list[Any]) -> SiblingGroup:
    """One buffer per group; each base layer's weight (and bias) becomes its row view."""
    with torch.no_grad():
        weight = torch.cat([b.weight.detach() for b in bases])
        bias = torch.cat([b.bias.detach() for b in bases]) if bases[0].bias is not None else None
    row = 0
    for b in bases:
        n = b.weight.shape[0]
        b.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            b.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return SiblingGroup(tuple(layers), weight, bias, tuple(b.weight.shape[0] for b in bases))


def sibling_forward(layer: Any, x: torch.Tensor, batch: MultiLoRABatch, names: Sequence[str]) -> torch.Tensor | None:
    """This member's output of its group's one call, or None when the member must run alone.

    Args:
        layer: A PEFT ``lora.Linear`` (fused by :func:`fuse_sibling_layers` or not).
        x: Its input ``[..., K]``.
        batch: The microbatch's segments (on ``x``'s device).
        names: PEFT adapter name per adapter index of ``batch`` (``"__base__"``: the frozen layer only).

    Returns:
        ``[..., N_g]``, or None (not fused, not eligible, or the group's weights were replaced).
    """
    entry = getattr(layer, _SIBLING, None)
    if entry is None:
        return None
    group: SiblingGroup = entry[0]
    index: int = entry[1]
    pending = group.pending
    if (
        pending is not None
        and pending.x is x
        and pending.version == x._version
        and pending.batch is batch
        and pending.grad_enabled == torch.is_grad_enabled()
        and pending.outputs[index] is not None
    ):
        out: torch.Tensor | None = pending.outputs[index]
        pending.outputs[index] = None
        if all(o is None for o in pending.outputs):
            group.pending = None
        return out
    args = _group_arguments(group, x, batch, names)
    if args is None:
        return None
    outputs: list[torch.Tensor | None] = list(
        fused_multi_lora_siblings(x, group.weight, bias=group.bias, batch=batch, **args)
    )
    mine = outputs[index]
    outputs[index] = None
    group.pending = _Pending(x, x._version, batch, torch.is_grad_enabled(), outputs)
    return mine


def _group_arguments(
    group: SiblingGroup, x: torch.Tensor, batch: MultiLoRABatch, names: Sequence[str]
) -> dict[str, Any] | None:
    """``fused_multi_lora_siblings`` arguments for the group, or None if any member must run alone."""
    from lorafusion_kernels.multi_lora_context import BASE_ADAPTER
    from lorafusion_kernels.multi_lora_routing import _dropout_p, _fusable, _no_adapter

    # Per adapter index, the adapter name its tokens use; None: no tokens, or the frozen layer only.
    active = [
        names[a] if batch.adapter_tokens[a] and names[a] != BASE_ADAPTER else None for a in range(batch.num_adapters)
    ]

    if not group.intact():
        _warn_once("sibling layers whose weights were replaced after fuse_sibling_layers (call it again)")
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None  # each member alone, its operands cast as nn.Linear's would be (autocast.call_as_linear)
    members = group.members
    if any(m.disable_adapters or m.merged for m in members):
        return None
    for m in members:
        present = [name if name is not None and name in m.lora_A else None for name in active]
        variant = any(m.use_dora.get(n, False) or n in getattr(m, "lora_variant", {}) for n in filter(None, present))
        if variant or not _fusable(m, x, present, (), {}):
            return None
    k_in = x.shape[-1]
    lora_a, lora_b, scaling, ps = [], [], [], []
    for name in active:
        held = [name if name is not None and name in m.lora_A else None for m in members]
        if name is None or all(n is None for n in held):
            zeros = [_no_adapter(k_in, n, x.dtype, x.device) for n in group.out_features]
            lora_a.append([a for a, _ in zeros])
            lora_b.append([b for _, b in zeros])
            scaling.append(0.0)
            ps.append(0.0)
            continue
        if any(n is None for n in held):
            return None  # the adapter targets only some members
        values = {(m.r[name], float(m.scaling[name]), _dropout_p(m, name)) for m in members}
        if len(values) != 1:
            return None  # rank, scaling or p differs between members
        r, scale, p = values.pop()
        if runs_triton(x) and r * len(members) > MAX_RANK:
            return None
        lora_a.append([m.lora_A[name].weight for m in members])
        lora_b.append([m.lora_B[name].weight for m in members])
        scaling.append(scale)
        ps.append(p)
    return {"lora_a": lora_a, "lora_b": lora_b, "out_features": group.out_features, "scaling": scaling, "dropout_p": ps}


_WARNED = OnceWarnings()


def _warn_once(reason: str) -> None:
    _WARNED.warn(f"lorafusion: running {reason} one at a time")
