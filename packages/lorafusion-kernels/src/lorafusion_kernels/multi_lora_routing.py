"""Mixed-adapter microbatches through PEFT models: the runtime hook and the PEFT routing.

:func:`multi_lora_batch` tells every PEFT ``lora.Linear`` of a model patched with
``patch_peft_model`` that its tokens are consecutive segments of several adapters, and routes them
through :func:`~lorafusion_kernels.multi_lora.fused_multi_lora_linear`. The same routing serves
PEFT's own ``adapter_names=`` mixed batches, which PEFT itself refuses in training.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lorafusion_kernels._kernels._common import MAX_RANK
from lorafusion_kernels.autocast import call_as_linear, linear_compute_dtype
from lorafusion_kernels.base_layers import base_weight
from lorafusion_kernels.errors import MODULE_PATH, LoRAFusionKernelsError, OnceWarnings, module_path
from lorafusion_kernels.instance_forward import bind_forward, unbind_forward
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.module_hooks import parts_wrapped
from lorafusion_kernels.multi_lora import fused_multi_lora_linear
from lorafusion_kernels.peft_siblings import sibling_forward
from lorafusion_kernels.peft_wrappers import segment_wrapper_forward, wrong_copy_error

__all__ = [
    "BASE_ADAPTER",
    "install_peft_mixed_batches",
    "multi_lora_batch",
    "multi_lora_checkpoint_contexts",
    "multi_lora_router",
    "peft_multi_lora_forward",
    "routed_checkpoint",
    "routed_checkpoint_function",
    "uninstall_peft_mixed_batches",
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
_ACTIVE_ROWS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "lorafusion_adapter_names", default=None
)
"""PEFT's ``adapter_names=`` of the model call running in training mode, for recomputed forwards.

PEFT hands ``adapter_names`` to each LoRA layer through hooks that live only during the model call;
a checkpointed layer recomputed in the backward finds them here (re-entered with the routing).
"""

_Captured = tuple[_Routing | None, tuple[str, ...] | None]


def _captured() -> _Captured:
    return _ACTIVE.get(), _ACTIVE_ROWS.get()


def _active_routing() -> _Routing | None:
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
    those tokens (as in PEFT's ``adapter_names=``); a name with tokens that no layer run inside the
    block holds (misspelt?) is warned about once, when the block exits, and so is a block in which
    no patched module ran (an unpatched model). Works in training and eval
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
        adapter_names: PEFT adapter name of each adapter index (at least ``batch.num_adapters`` names).

    Yields:
        ``batch``.

    Raises:
        LoRAFusionKernelsError: Fewer names than the batch's adapters.
    """
    names = tuple(adapter_names)
    if isinstance(adapter_names, str) or len(names) < batch.num_adapters:
        raise LoRAFusionKernelsError(
            f"adapter_names must list one PEFT adapter name per adapter index "
            f"({batch.num_adapters} needed), got {adapter_names!r}"
        )
    routing = _Routing(batch, names, {batch.device: batch})
    token = _ACTIVE.set(routing)
    try:
        yield batch
    finally:
        _ACTIVE.reset(token)
    _warn_unheld_names(routing)


_WARNED_UNHELD = OnceWarnings()


def _warn_unheld_names(routing: _Routing) -> None:
    """Once per name: an adapter with tokens that no LoRA layer of the block held (a misspelt name?).

    A block in which no patched module (model, LoRA layer, PEFT wrapper) ran at all is warned about
    too: PEFT's own layers of an unpatched model ignore the block and give every token the active
    adapter.
    """
    if not routing.reached:
        _WARNED_UNHELD.warn(
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
            _WARNED_UNHELD.warn(
                f"lorafusion: adapter {name!r} (index {a}) has {batch.adapter_tokens[a]} tokens in a "
                f"multi_lora_batch, but no LoRA layer that ran holds an adapter of that name (they hold "
                f"{sorted(routing.held)}), so its tokens got the frozen model only; check adapter_names "
                f"(name {BASE_ADAPTER!r} to mean the frozen model on purpose)",
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
    return contextlib.nullcontext(), _reenter(_captured())


@contextlib.contextmanager
def _reenter(captured: _Captured) -> Iterator[None]:
    routing, rows = captured
    token, rows_token = _ACTIVE.set(routing), _ACTIVE_ROWS.set(rows)
    try:
        yield
    finally:
        _ACTIVE_ROWS.reset(rows_token)
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
    captured = _captured()
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


def _route_checkpoints(model: nn.Module) -> None:
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
    _route_checkpoints(model)
    return result


def _unroute_checkpoints(model: nn.Module) -> None:
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if hasattr(func, _UNROUTED):
            setattr(module, "_gradient_checkpointing_func", getattr(func, _UNROUTED))  # noqa: B010
        if _CHECKPOINT_SETTER in vars(module):
            delattr(module, _CHECKPOINT_SETTER)


def _rows_to_batch(layer: Any, x: torch.Tensor, adapter_names: Sequence[str]) -> tuple[MultiLoRABatch, tuple[str, ...]]:
    """PEFT's per-sample ``adapter_names`` (one per row of ``x [B, ..., K]``) as consecutive segments."""
    rows = x.shape[0] if x.dim() >= 2 else 0
    if len(adapter_names) != rows:
        flattened = x.dim() == 2 and len(adapter_names) > 0 and rows % len(adapter_names) == 0
        hint = (
            ". The model flattens its rows before this layer (as OPT's fc1/fc2 see [batch x tokens, hidden]), "
            "so it cannot take adapter_names=; pack the rows as segments with multi_lora_batch instead"
            if flattened
            else ""
        )
        raise LoRAFusionKernelsError(
            f"Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(adapter_names)} and {rows} respectively, at {module_path(layer)} (input {tuple(x.shape)}){hint}"
        )
    names = tuple(dict.fromkeys(adapter_names))
    index = {name: i for i, name in enumerate(names)}
    per_row = x.numel() // (rows * x.shape[-1]) if x.shape[-1] else 0
    return _row_batch(tuple(index[n] for n in adapter_names), per_row, x.device, len(names)), names


@functools.lru_cache(maxsize=64)
def _row_batch(row_adapters: tuple[int, ...], per_row: int, device: torch.device, num_adapters: int) -> MultiLoRABatch:
    lengths: list[int] = []
    adapters: list[int] = []
    for a in row_adapters:
        if adapters and adapters[-1] == a:
            lengths[-1] += per_row
        else:
            lengths.append(per_row)
            adapters.append(a)
    return MultiLoRABatch.from_segments(lengths, adapters, num_adapters=num_adapters, device=device)


def peft_multi_lora_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The routed forward of a PEFT ``lora.Linear``, or None when no multi-adapter routing applies.

    The patched ``lora.Linear.forward`` calls this first, for every layer (fused or not), and returns
    its result when it is not None. It applies when :func:`multi_lora_batch` is active or PEFT passed
    ``adapter_names=`` (one name per row of ``x``; consecutive rows of one adapter form a segment).
    Eligible layers (plain ``nn.Linear`` or transformers ``Conv1D`` base in ``x``'s dtype, no
    ``lora_bias``, ranks the kernels take) run :func:`fused_multi_lora_linear`; others, and calls
    with extra arguments, run a per-segment eager loop with PEFT's own modules (the extra arguments
    go to the base layer, as in PEFT's forward). DoRA and other LoRA variants, and merged
    adapters, are refused, as PEFT refuses them for mixed batches.

    Args:
        layer: A PEFT ``lora.Linear``.
        x: Its input ``[..., K]``.
        *args: Extra positional arguments of the forward (passed to the base layer).
        **kwargs: Extra keyword arguments; ``adapter_names`` is consumed here.

    Returns:
        ``[..., N]`` in ``x.dtype``, or None.

    Raises:
        LoRAFusionKernelsError: Token count differs from the batch, too few names, DoRA/variants, or
            merged adapters.
    """
    adapter_names = kwargs.pop("adapter_names", None)
    if adapter_names is None:
        adapter_names = _ACTIVE_ROWS.get()  # a recomputed forward: PEFT's per-call hooks are gone
    if adapter_names is not None:
        batch, names = _rows_to_batch(layer, x, adapter_names)
    else:
        routing = _active_routing()
        if routing is None:
            return None
        batch, names = routing.batch_on(x.device), routing.adapter_names
        routing.held.update(layer.lora_A.keys())
    # Merged first, as PEFT checks it: disabling adapters leaves them merged in the base weight.
    if layer.merged:
        where = module_path(layer)
        raise LoRAFusionKernelsError(
            f"{where} has merged adapters, which mixed-adapter batches (adapter_names=, multi_lora_batch) "
            "cannot take: call `unmerge_adapter()` first"
        )
    if layer.disable_adapters:
        frozen: torch.Tensor = layer.base_layer(x, *args, **kwargs)
        return frozen
    k_in = x.shape[-1]
    tokens = x.numel() // k_in if k_in else 0
    if tokens != batch.total_tokens:
        where = module_path(layer)
        raise LoRAFusionKernelsError(
            f"{where} got {tokens} tokens (input {list(x.shape)}) but the multi-LoRA batch "
            f"holds {batch.total_tokens}; every LoRA layer inside `multi_lora_batch` must see the packed tokens"
        )
    # An adapter without tokens in this batch takes no part: no stacking, no (zero) gradient to accumulate.
    present = [_layer_adapter(layer, names[a]) if batch.adapter_tokens[a] else None for a in range(batch.num_adapters)]
    for name in filter(None, present):
        if layer.use_dora.get(name, False) or name in getattr(layer, "lora_variant", {}):
            raise LoRAFusionKernelsError(
                f"adapter {name!r} uses DoRA or another LoRA variant, which mixed-adapter batches do not support"
            )
        if layer.training and torch.is_grad_enabled() and not layer.lora_A[name].weight.requires_grad:
            _warn_frozen_adapter(name)
    if parts_wrapped(layer, filter(None, present)):
        _WARNED_HOOKED.warn(
            "lorafusion: mixed-adapter batches run per segment with PEFT's modules on layers with forward hooks "
            "on their base layer or LoRA modules (e.g. accelerate offloading), which the fused ops would skip",
        )
        return _eager_layer_forward(layer, x, batch, present, args, kwargs)
    if not args and not kwargs:
        grouped = sibling_forward(layer, x, batch, names)
        if grouped is not None:
            return grouped
    if _fusable(layer, x, present, args, kwargs):
        return _fused_layer_forward(layer, x, batch, present)
    return _eager_layer_forward(layer, x, batch, present, args, kwargs)


_WARNED_FROZEN = OnceWarnings()
_WARNED_HOOKED = OnceWarnings()


def _warn_frozen_adapter(name: str) -> None:
    """Once per adapter: it trains in a mixed batch but its weights take no gradient."""
    _WARNED_FROZEN.warn(
        f"lorafusion: adapter {name!r} has tokens in a mixed-adapter batch in training mode, but its LoRA "
        "weights do not require grad, so it gets no gradient (PEFT's set_adapter makes only the active "
        "adapter trainable); call requires_grad_(True) on its lora_A/lora_B weights to train it",
    )


def _layer_adapter(layer: Any, name: str) -> str | None:
    """``name`` if this layer holds that adapter, else None (base only, as PEFT does)."""
    return name if name != BASE_ADAPTER and name in layer.lora_A else None


def _dropout_p(layer: Any, name: str) -> float:
    drop = layer.lora_dropout[name]
    return float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0


def _fusable(
    layer: Any, x: torch.Tensor, present: list[str | None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    weight = base_weight(layer)
    if args or kwargs or weight is None:
        return False
    compute = linear_compute_dtype(x, weight)
    if compute is None:
        return False
    for name in filter(None, present):
        if layer.lora_B[name].bias is not None:
            return False
        if not isinstance(layer.lora_dropout[name], nn.Dropout | nn.Identity):
            return False
        if layer.r[name] > MAX_RANK:
            return False
    return True


def _fused_layer_forward(layer: Any, x: torch.Tensor, batch: MultiLoRABatch, present: list[str | None]) -> torch.Tensor:
    k_in = x.shape[-1]
    base, weight = layer.base_layer, base_weight(layer)
    assert weight is not None  # _fusable checked it
    lora_a, lora_b, scaling, ps = [], [], [], []
    for name in present:
        if name is None:
            no_a, no_b = _no_adapter(k_in, weight.shape[0], x.dtype, x.device)
            lora_a.append(no_a)
            lora_b.append(no_b)
            scaling.append(0.0)
            ps.append(0.0)
        else:
            # In their own dtype (fp32 under PEFT's default autocast_adapter_dtype): the kernels cast
            # tiles as they load them, and the gradients reach the parameters with no conversion.
            lora_a.append(layer.lora_A[name].weight)
            lora_b.append(layer.lora_B[name].weight)
            scaling.append(float(layer.scaling[name]))
            ps.append(_dropout_p(layer, name))
    return call_as_linear(
        fused_multi_lora_linear, x, weight, lora_a, lora_b, scaling=scaling, dropout_p=ps, bias=base.bias,
        batch=batch,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _no_adapter(k_in: int, n_out: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-0 ``(A [0, K], B [N, 0])``: "no adapter" for a layer's call; empty, so shared by every call."""
    return torch.zeros(0, k_in, dtype=dtype, device=device), torch.zeros(n_out, 0, dtype=dtype, device=device)


def _eager_layer_forward(
    layer: Any,
    x: torch.Tensor,
    batch: MultiLoRABatch,
    present: list[str | None],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """PEFT's own modules, one segment at a time (what ``_mixed_batch_forward`` does per sample)."""
    result = layer.base_layer(x, *args, **kwargs)
    flat_x = x.reshape(-1, x.shape[-1])
    out_features = result.shape[-1]
    pieces = []
    for start, length, adapter in batch.nonempty_segments():
        name = present[adapter]
        if name is None:
            pieces.append(result.new_zeros(length, out_features))
            continue
        lora_a = layer.lora_A[name]
        xs = flat_x[start : start + length].to(lora_a.weight.dtype)
        delta = layer.lora_B[name](lora_a(layer.lora_dropout[name](xs))) * layer.scaling[name]
        pieces.append(delta.to(result.dtype))
    out: torch.Tensor = result + torch.cat(pieces, dim=0).reshape(result.shape)
    return out


@contextlib.contextmanager
def _mixed_batch_hooks(lora_model: Any, original: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
    """``LoraModel._enable_peft_forward_hooks`` that also admits ``adapter_names=`` in training mode.

    PEFT refuses per-sample adapters in training only because its ``_mixed_batch_forward`` is an
    inference path; the patched layers route them through FusedMultiLoRA (or a per-segment loop)
    with dropout and gradients, so the check is skipped while PEFT registers its per-layer hooks.
    """
    adapter_names: Any = kwargs.get("adapter_names")
    mixed_training = adapter_names is not None and lora_model.training
    if mixed_training:
        lora_model.training = False  # what PEFT's check refuses adapter_names under
    try:
        hooks = original(*args, **kwargs)
        hooks.__enter__()
    finally:
        if mixed_training:
            lora_model.training = True
    token = _ACTIVE_ROWS.set(tuple(adapter_names)) if mixed_training else None
    try:
        yield
    finally:
        if token is not None:
            _ACTIVE_ROWS.reset(token)
        # As if the call had succeeded: PEFT's generator removes its per-call hooks after its
        # ``yield`` without a ``finally``, so an error thrown into it would leave them on the model.
        hooks.__exit__(None, None, None)


_GUARD_HOOKS = "_lorafusion_mixed_batch_guards"
"""Attribute of each LoRA layer and PEFT wrapper guarded or routed for mixed batches.

Its value is the guard hook's handle, or :data:`_ROUTED_FORWARD`.
"""
_ROUTED_FORWARD = "routed forward"
"""Value of :data:`_GUARD_HOOKS` on a PEFT wrapper whose instance ``forward`` is :func:`_wrapper_forward`."""


def multi_lora_router(layer: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """Router for ``peft_integration``: claims the calls that carry mixed-adapter segments.

    Those are the calls made under :func:`multi_lora_batch` or with PEFT's ``adapter_names=``; any
    other call returns None, so the next router (single adapter) decides. The route takes the
    call's extra arguments (passed on to the base layer, as PEFT does): PEFT's own forward would
    apply the one active adapter to every segment.
    """
    from lorafusion_kernels.peft_integration import Route

    if kwargs.get("adapter_names") is None and _captured() == (None, None):
        return None
    return Route(_routed_forward, extra_args=True)


def _routed_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`peft_multi_lora_forward` for a call that :func:`multi_lora_router` claimed (never None)."""
    out = peft_multi_lora_forward(layer, x, *args, **kwargs)
    assert out is not None, "multi_lora_router claimed a call without multi-adapter routing"
    return out


def _unpatched_guard(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook on the LoRA layers that ``patch_peft_model`` left alone.

    Inside :func:`multi_lora_batch` their output (PEFT's active adapter on every token) would be
    wrong, so it is replaced by the per-segment result, or refused for LoRA layer types other than
    ``lora.Linear``. This includes layers whose ``forward`` hooks (e.g. accelerate's) wrapped before
    patching: the forward hook still sees the call's arguments.
    """
    if kwargs.get("adapter_names") is not None or _captured() == (None, None):
        return None
    from peft.tuners.lora.layer import Linear

    from lorafusion_kernels.peft_integration import is_patched

    if is_patched(module):
        return None

    if type(module) is not Linear:
        raise LoRAFusionKernelsError(
            f"{type(module).__name__} LoRA layers cannot route multi_lora_batch segments; "
            "target only linear layers with the adapters trained in mixed batches"
        )
    return peft_multi_lora_forward(module, *args, **kwargs)


def _wrapper_forward(wrapper: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Instance ``forward`` of PEFT's ``AuxiliaryTrainingWrapper`` modules (``modules_to_save``, trainable tokens).

    A wrapper picks one adapter's copy per call: PEFT's ``adapter_names=`` reaches it through hooks
    that live only during the model call, and without them it applies the active adapter's copy to
    every token. So a forward recomputed by activation checkpointing after an ``adapter_names=``
    call gets the names back here, and inside :func:`multi_lora_batch` each segment's tokens go
    through the copy of that segment's adapter (:func:`~lorafusion_kernels.peft_wrappers.segment_wrapper_forward`).
    """
    peft_forward: Callable[..., torch.Tensor] = type(wrapper).forward
    if kwargs.get("adapter_names") is None:
        kwargs.pop("adapter_names", None)  # an explicit None means no names, as in PEFT
        rows, routing = _ACTIVE_ROWS.get(), _active_routing()
        if rows is not None:
            kwargs = {**kwargs, "adapter_names": list(rows)}
        elif routing is not None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), routing.batch.device)
            return segment_wrapper_forward(wrapper, routing.batch_on(device), routing.adapter_names, args, kwargs)
    return peft_forward(wrapper, *args, **kwargs)


def _wrapper_guard(
    wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook on the PEFT wrappers whose ``forward`` hooks (e.g. accelerate's) replaced first.

    As :func:`_wrapper_forward`, except that a pre-hook cannot route segments: inside
    :func:`multi_lora_batch`, a wrapper whose one copy would be wrong for some segment is refused.
    """
    if kwargs.get("adapter_names") is not None:
        return None
    rows = _ACTIVE_ROWS.get()
    if rows is not None:
        return args, {**kwargs, "adapter_names": list(rows)}
    routing = _active_routing()
    if routing is not None:
        why = "its forward is wrapped by hooks (e.g. accelerate offloading), so multi_lora_batch cannot route it"
        error = wrong_copy_error(wrapper, routing.batch, routing.adapter_names, why)
        if error is not None:
            raise error
    return None


_LATE_CHECK = "_lorafusion_late_layer_check"
"""Attribute of the model given to ``patch_peft_model``: its :class:`_LateLayerCheck` hook."""


class _LateLayerCheck:
    """Forward pre-hook on the patched model: refuse mixed-adapter calls while some layer escaped the patch.

    ``add_adapter`` or ``load_adapter`` on new target modules after ``patch_peft_model`` creates LoRA
    layers (and ``modules_to_save`` wrappers) that are neither patched nor guarded: in a mixed-adapter
    call they would apply the active adapter to every token. Checked on model calls inside
    :func:`multi_lora_batch`, or with ``adapter_names=`` in training (whose recomputation under
    activation checkpointing only the patch routes). The walk over the modules (6 ms on the
    development CPU for LLaMa-3.1-8B with 4 adapters: 4,681 modules) runs again only when the
    model's adapters (``peft_config``'s names) change or the model is patched again; a model without
    ``peft_config`` is walked on every such call.

    Attributes:
        clean_for: The adapter names at the last walk that found every layer routed, else None.
        handle: The hook's handle, to remove it.
    """

    def __init__(self) -> None:
        self.clean_for: tuple[str, ...] | None = None
        self.handle: Any = None

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _active_routing() is None and (kwargs.get("adapter_names") is None or not model.training):
            return
        config = getattr(model, "peft_config", None)
        adapters = tuple(config) if isinstance(config, dict) else None
        if adapters is not None and adapters == self.clean_for:
            return
        late = _unrouted_modules(model)
        if late:
            shown = ", ".join(late[:3]) + (f" and {len(late) - 3} more" if len(late) > 3 else "")
            raise LoRAFusionKernelsError(
                f"{len(late)} PEFT LoRA layer(s) or modules_to_save wrapper(s) were created after patch_peft_model "
                f"({shown}) and would apply the active adapter to every token of this mixed-adapter batch: call "
                "lorafusion_kernels.patch_peft_model(model) again after add_adapter or load_adapter"
            )
        self.clean_for = adapters


def _unrouted_modules(model: nn.Module) -> list[str]:
    """Paths of the PEFT LoRA layers and wrappers in ``model`` that are neither patched nor guarded."""
    from peft.tuners.lora.layer import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper

    from lorafusion_kernels.peft_integration import is_patched

    peft_kinds: tuple[type[Any], ...] = (LoraLayer, AuxiliaryTrainingWrapper)
    return [
        path
        for path, module in model.named_modules()
        if isinstance(module, peft_kinds) and _GUARD_HOOKS not in vars(module) and not is_patched(module)
    ]


def install_peft_mixed_batches(model: nn.Module) -> None:
    """Route mixed-adapter batches of a PEFT model: :func:`multi_lora_batch` and ``adapter_names=``.

    Called by ``patch_peft_model`` after it patched the layers: registers :func:`multi_lora_router`
    (asked before the single-adapter router), lets PEFT's ``adapter_names=`` through in training
    mode, makes HF activation checkpointing replay the routing (:func:`routed_checkpoint`), and
    hooks the LoRA layers left unpatched (whatever the reason, a ``forward`` already
    wrapped by hooks included) so that they never compute a silent wrong result inside
    :func:`multi_lora_batch`, routes PEFT's ``AuxiliaryTrainingWrapper`` modules (``modules_to_save``,
    trainable tokens: :func:`_wrapper_forward`, or :func:`_wrapper_guard` where hooks replaced their
    ``forward``), and refuses mixed-adapter calls of ``model`` while a LoRA layer created
    later is neither (:class:`_LateLayerCheck`). Calling it twice is harmless.

    Args:
        model: A ``PeftModel`` or a module holding PEFT LoRA layers.
    """
    from peft.tuners.lora.layer import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper

    from lorafusion_kernels.peft_integration import is_patched, register_router

    register_router(multi_lora_router)
    lora_model = _lora_model(model)
    if lora_model is not None and "_enable_peft_forward_hooks" not in vars(lora_model):
        original = lora_model._enable_peft_forward_hooks
        lora_model._enable_peft_forward_hooks = functools.partial(_mixed_batch_hooks, lora_model, original)
    _route_checkpoints(model)
    for path, named in model.named_modules():
        if isinstance(named, LoraLayer | AuxiliaryTrainingWrapper):
            setattr(named, MODULE_PATH, path)
    for module in model.modules():
        if _GUARD_HOOKS in vars(module):
            continue
        if isinstance(module, LoraLayer) and not is_patched(module):
            setattr(module, _GUARD_HOOKS, module.register_forward_hook(_unpatched_guard, with_kwargs=True))
        elif isinstance(module, AuxiliaryTrainingWrapper) and "forward" in vars(module):
            setattr(module, _GUARD_HOOKS, module.register_forward_pre_hook(_wrapper_guard, with_kwargs=True))
        elif isinstance(module, AuxiliaryTrainingWrapper):
            bind_forward(module, _wrapper_forward)
            setattr(module, _GUARD_HOOKS, _ROUTED_FORWARD)
    check = vars(model).get(_LATE_CHECK)
    if check is None:
        check = _LateLayerCheck()
        check.handle = model.register_forward_pre_hook(check, with_kwargs=True)
        setattr(model, _LATE_CHECK, check)
    check.clean_for = None  # patched again: walk at the next mixed-adapter call


def uninstall_peft_mixed_batches(model: nn.Module) -> None:
    """Undo :func:`install_peft_mixed_batches` on ``model`` (called by ``unpatch_peft_model``)."""
    lora_model = _lora_model(model)
    if lora_model is not None and "_enable_peft_forward_hooks" in vars(lora_model):
        del lora_model._enable_peft_forward_hooks
    _unroute_checkpoints(model)
    check = vars(model).pop(_LATE_CHECK, None)
    if check is not None:
        check.handle.remove()
    for module in model.modules():
        handle = vars(module).pop(_GUARD_HOOKS, None)
        if handle == _ROUTED_FORWARD:
            unbind_forward(module, _wrapper_forward)
        elif handle is not None:
            handle.remove()
        if MODULE_PATH in vars(module):
            delattr(module, MODULE_PATH)


def _lora_model(model: nn.Module) -> Any:
    """The PEFT ``LoraModel`` of ``model`` (itself or its ``base_model``), or None."""
    try:
        from peft.tuners.lora import LoraModel
    except ImportError:
        return None
    for candidate in (model, getattr(model, "base_model", None)):
        if isinstance(candidate, LoraModel):
            return candidate
    return None
