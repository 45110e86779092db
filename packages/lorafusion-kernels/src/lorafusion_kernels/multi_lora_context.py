"""Which segments a forward routes to which adapters, and replaying that in recomputed forwards.

:func:`multi_lora_batch` makes a microbatch's segments the active routing for the forward that
runs inside it; PEFT's ``adapter_names=`` in training mode sets :data:`ACTIVE_ROWS` likewise. A
forward recomputed in the backward (activation checkpointing) runs after both have exited, so the
checkpoint wrappers here capture the routing when the checkpointed function first runs and re-enter
it around the recomputation. The layers that read the routing live in
:mod:`lorafusion_kernels.multi_lora_routing`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lorafusion_kernels.errors import LoRAFusionKernelsError, OnceWarnings
from lorafusion_kernels.metadata import MultiLoRABatch

__all__ = [
    "ACTIVE_ROWS",
    "BASE_ADAPTER",
    "active_routing",
    "captured_routing",
    "multi_lora_batch",
    "multi_lora_checkpoint_contexts",
    "route_checkpoints",
    "routed_checkpoint",
    "routed_checkpoint_function",
    "unroute_checkpoints",
]

BASE_ADAPTER = "__base__"
"""PEFT's name for "no adapter" in ``adapter_names``: those tokens get the frozen layer only."""


@dataclass
class _Routing:
    batch: MultiLoRABatch
    adapter_names: tuple[str, ...]
    on_device: dict[torch.device, MultiLoRABatch]
    held: set[str] = field(default_factory=set)
    """The adapter names held by the LoRA layers that ran inside the block (to catch a misspelt name)."""
    reached: bool = False
    """Whether a patched module (model, LoRA layer, wrapper) looked the routing up: else the model is unpatched."""

    def batch_on(self, device: torch.device) -> MultiLoRABatch:
        if device not in self.on_device:
            self.on_device[device] = self.batch.to(device)
        return self.on_device[device]


_ACTIVE: contextvars.ContextVar[_Routing | None] = contextvars.ContextVar("lorafusion_multi_lora_batch", default=None)
ACTIVE_ROWS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "lorafusion_adapter_names", default=None
)
"""PEFT's ``adapter_names=`` of the model call running in training mode, for recomputed forwards.

PEFT hands ``adapter_names`` to each LoRA layer through hooks that live only during the model call;
a checkpointed layer recomputed in the backward finds them here (re-entered with the routing).
"""

_Captured = tuple[_Routing | None, tuple[str, ...] | None]


def captured_routing() -> _Captured:
    """The routing and the ``adapter_names`` rows active now (to re-enter them in a recomputation)."""
    return _ACTIVE.get(), ACTIVE_ROWS.get()


def active_routing() -> _Routing | None:
    """The routing of the enclosing :func:`multi_lora_batch`, marked as reached by a patched module."""
    routing = _ACTIVE.get()
    if routing is not None:
        routing.reached = True
    return routing


@contextlib.contextmanager
def multi_lora_batch(batch: MultiLoRABatch, adapter_names: Sequence[str]) -> Iterator[MultiLoRABatch]:
    """Route every patched PEFT ``lora.Linear`` through FusedMultiLoRA for one microbatch's forward.

    Inside the block, each PEFT ``lora.Linear`` of a model patched with
    :func:`lorafusion_kernels.patch_peft_model` flattens its input ``[..., K]`` to ``[T, K]`` (``T``
    must equal ``batch.total_tokens``, else :class:`LoRAFusionKernelsError`) and treats it as the
    batch's segments: segment ``j`` uses the PEFT adapter named
    ``adapter_names[batch.segment_adapters[j]]`` with that layer's own ``lora_A``/``lora_B``
    weights, ``scaling`` and ``lora_dropout`` p (p applies only while the layer is in training mode).
    The name ``"__base__"``, or an adapter that a layer does not have, means "frozen layer only" for
    those tokens (as in PEFT's ``adapter_names=``). When the block exits normally, a name with
    tokens that no LoRA layer run inside the block holds, while LoRA layers did run (a misspelt
    name), raises :class:`LoRAFusionKernelsError`, as PEFT's ``adapter_names=`` raises for an
    unknown adapter; a block in which no patched module ran at all (an unpatched model, or a
    pipeline stage without LoRA layers) is warned about once per process. Works in training and eval
    mode, on CPU (plain torch) and CUDA fp16/bf16 (Triton). Autograd saves what the backward needs:
    the context is needed only while the forward runs, so ``loss.backward()`` may run after the block.
    PEFT's ``modules_to_save`` and trainable-token wrappers around ``nn.Linear`` and ``nn.Embedding``
    (``lm_head``, a ``SEQ_CLS`` head, ``embed_tokens``) give each segment's tokens the copy of its
    adapter; one around another module whose single copy would be wrong for an adapter with tokens
    raises :class:`LoRAFusionKernelsError` when it is called inside the block.

    Trainer usage (one microbatch, adapters of the run listed once in a fixed order)::

        batch = MultiLoRABatch.from_segments(lengths, adapter_ids, num_adapters=len(names), device="cuda")
        with lorafusion_kernels.multi_lora_batch(batch, names):
            logits = model(input_ids=packed_ids, position_ids=position_ids)  # [1, T] packed tokens
        loss.backward()

    Recomputed forwards (activation checkpointing) must see the same segments. HF models'
    checkpointing (``gradient_checkpointing_enable``, reentrant or not, before or after patching)
    replays the routing by itself: ``patch_peft_model`` wraps the models' checkpoint function
    (:func:`routed_checkpoint`). Around a direct ``torch.utils.checkpoint.checkpoint`` call, wrap the
    function (``checkpoint(routed_checkpoint_function(block), h, ...)``) or, with
    ``use_reentrant=False``, pass ``context_fn=multi_lora_checkpoint_contexts``.

    Args:
        batch: The microbatch's segments, built once with :meth:`MultiLoRABatch.from_segments`.
        adapter_names: PEFT adapter name of each adapter index, in index order (a list or tuple of
            at least ``batch.num_adapters`` strings; not a set or a dict, whose order is not the indices').

    Yields:
        ``batch``.

    Raises:
        LoRAFusionKernelsError: ``batch`` is not a :class:`MultiLoRABatch` (or the arguments are
            swapped); ``adapter_names`` is a string, a set or a mapping, holds a non-string, or has
            fewer names than the batch's adapters; at a normal exit of the block, an adapter with
            tokens that no LoRA layer run inside the block holds, while other LoRA layers ran.
    """
    names = _check_arguments(batch, adapter_names)
    routing = _Routing(batch, names, {batch.device: batch})
    token = _ACTIVE.set(routing)
    try:
        yield batch
    finally:
        _ACTIVE.reset(token)
    _check_routed(routing)


def _check_arguments(batch: object, adapter_names: object) -> tuple[str, ...]:
    """``adapter_names`` as a tuple of strings, after checking both arguments of :func:`multi_lora_batch`.

    Raises:
        LoRAFusionKernelsError: Saying what to pass instead.
    """
    if isinstance(adapter_names, MultiLoRABatch):
        raise LoRAFusionKernelsError(
            "multi_lora_batch takes the batch first: multi_lora_batch(batch, adapter_names), "
            f"got adapter_names={type(adapter_names).__name__} and batch={type(batch).__name__}"
        )
    if not isinstance(batch, MultiLoRABatch):
        raise LoRAFusionKernelsError(
            f"batch must be a MultiLoRABatch, got {type(batch).__name__}: build it with "
            "MultiLoRABatch.from_segments(segment_lengths, segment_adapters, num_adapters=..., device=...)"
        )
    if isinstance(adapter_names, Mapping | Set):
        raise LoRAFusionKernelsError(
            f"adapter_names must be a list or tuple of PEFT adapter names in adapter-index order, got a "
            f"{type(adapter_names).__name__}, whose iteration order is not the indices' and would route "
            "segments to the wrong adapters: pass [name of adapter 0, name of adapter 1, ...]"
        )
    if isinstance(adapter_names, str | bytes) or not isinstance(adapter_names, Iterable):
        raise LoRAFusionKernelsError(
            f"adapter_names must list one PEFT adapter name per adapter index ({batch.num_adapters} needed), "
            f"got {adapter_names!r}"
        )
    names = tuple(adapter_names)  # once: a generator would be empty the second time
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise LoRAFusionKernelsError(
                f"adapter_names[{i}] must be a PEFT adapter name (a str), got {type(name).__name__} {name!r}; "
                f"use {BASE_ADAPTER!r} for tokens that take the frozen model only"
            )
    if len(names) < batch.num_adapters:
        raise LoRAFusionKernelsError(
            f"adapter_names must list one PEFT adapter name per adapter index "
            f"({batch.num_adapters} needed), got {list(names)!r}"
        )
    return names


_WARNED_UNREACHED = OnceWarnings()


def _check_routed(routing: _Routing) -> None:
    """At a normal exit of the block: every adapter with tokens was held by a LoRA layer that ran.

    A name no LoRA layer held, while some did run, is a mistake (a misspelt name: its tokens got the
    frozen model, and its adapter no gradient) and raises, as PEFT's ``adapter_names=`` does for an
    unknown adapter. A block in which no patched module (model, LoRA layer, PEFT wrapper) ran at all
    is only warned about, once per process: PEFT's own layers of an unpatched model ignore the
    block and give every token the active adapter, but a pipeline stage that holds no LoRA layer
    runs such blocks on purpose, every microbatch.

    Raises:
        LoRAFusionKernelsError: Naming the adapter, its index and the names the layers hold.
    """
    if not routing.reached:
        _WARNED_UNREACHED.warn(
            "lorafusion: no patched module ran inside multi_lora_batch, so nothing was routed by "
            "adapter: call lorafusion_kernels.patch_peft_model(model) first (an unpatched PEFT model gives "
            "every token its active adapter), and run the model's forward inside the block"
        )
    if not routing.held:
        return  # no LoRA layer ran (only wrappers, or an error was caught inside the block)
    batch = routing.batch
    for a in batch.active_adapters:
        name = routing.adapter_names[a]
        if name != BASE_ADAPTER and name not in routing.held:
            raise LoRAFusionKernelsError(
                f"adapter {name!r} (index {a}) has {batch.adapter_tokens[a]} tokens in a multi_lora_batch, "
                f"but no LoRA layer that ran holds an adapter of that name (they hold {sorted(routing.held)}), "
                f"so its tokens got the frozen model only: fix adapter_names (name {BASE_ADAPTER!r} to mean "
                "the frozen model on purpose)"
            )


def multi_lora_checkpoint_contexts() -> tuple[
    contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the recomputation sees the same segments.

    Called by the checkpoint at forward time, it captures the routing active then (if any) and
    re-enters it around the recomputation in the backward, when :func:`multi_lora_batch` has long
    exited (and another microbatch's routing may be active)::

        torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=multi_lora_checkpoint_contexts)

    Returns:
        ``(forward context, recompute context)``.
    """
    return contextlib.nullcontext(), _reenter(captured_routing())


@contextlib.contextmanager
def _reenter(captured: _Captured) -> Iterator[None]:
    routing, rows = captured
    token, rows_token = _ACTIVE.set(routing), ACTIVE_ROWS.set(rows)
    try:
        yield
    finally:
        ACTIVE_ROWS.reset(rows_token)
        _ACTIVE.reset(token)


_UNROUTED = "_lorafusion_unrouted_checkpoint"
"""Attribute of a :func:`routed_checkpoint` wrapper: the checkpoint function it wraps."""
_CHECKPOINT_SETTER = "_set_gradient_checkpointing"
"""HF ``PreTrainedModel`` method that sets every layer's ``_gradient_checkpointing_func``."""


def routed_checkpoint_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` made to run, each time it is called, under the routing active when this was called.

    For ``torch.utils.checkpoint.checkpoint`` (reentrant or not), whose recomputation in the backward
    runs after :func:`multi_lora_batch` or the ``adapter_names=`` call has exited::

        h = torch.utils.checkpoint.checkpoint(routed_checkpoint_function(block), h, use_reentrant=True)
    """
    captured = captured_routing()
    if captured == (None, None):
        return function

    @functools.wraps(function)
    def replayed(*args: Any, **kwargs: Any) -> Any:
        with _reenter(captured):
            return function(*args, **kwargs)

    return replayed


def routed_checkpoint(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A checkpoint function (``checkpoint(function, *args, **kwargs)``) that replays the routing.

    ``patch_peft_model`` sets HF models' ``_gradient_checkpointing_func`` to this wrapper of theirs,
    so a decoder layer recomputed in the backward sees the segments it saw in the forward. Wrapping
    twice returns the same wrapper.
    """
    if hasattr(checkpoint, _UNROUTED):
        return checkpoint

    @functools.wraps(checkpoint)
    def checkpoint_with_routing(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(routed_checkpoint_function(function), *args, **kwargs)

    setattr(checkpoint_with_routing, _UNROUTED, checkpoint)
    return checkpoint_with_routing


def route_checkpoints(model: nn.Module) -> None:
    """Wrap every HF checkpoint function of ``model`` now, and whenever checkpointing is enabled later."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if callable(func):
            setattr(module, "_gradient_checkpointing_func", routed_checkpoint(func))  # noqa: B010 (not a typed field)
        setter = getattr(module, _CHECKPOINT_SETTER, None)
        if callable(setter) and _CHECKPOINT_SETTER not in vars(module):
            setattr(module, _CHECKPOINT_SETTER, functools.partial(_set_checkpointing_routed, module, setter))


def _set_checkpointing_routed(model: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """HF's ``_set_gradient_checkpointing``, then the checkpoint functions it set wrapped."""
    result = original(*args, **kwargs)
    route_checkpoints(model)
    return result


def unroute_checkpoints(model: nn.Module) -> None:
    """Undo :func:`route_checkpoints`: HF's own checkpoint functions and setter again."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if hasattr(func, _UNROUTED):
            setattr(module, "_gradient_checkpointing_func", getattr(func, _UNROUTED))  # noqa: B010
        if _CHECKPOINT_SETTER in vars(module):
            delattr(module, _CHECKPOINT_SETTER)
