"""Mixed-adapter microbatches through PEFT models: the runtime hook and the PEFT routing.

:func:`multi_lora_batch` tells every PEFT ``lora.Linear`` of a model patched with
``patch_peft_model`` that its tokens are consecutive segments of several adapters, and routes them
through :func:`~lorafusion_kernels.multi_lora.fused_multi_lora_linear`. The same routing serves
PEFT's own ``adapter_names=`` mixed batches, which PEFT itself refuses in training.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
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
from lorafusion_kernels.multi_lora_context import (
    ACTIVE_ROWS,
    BASE_ADAPTER,
    active_routing,
    captured_routing,
    route_checkpoints,
    unroute_checkpoints,
)
from lorafusion_kernels.peft_siblings import sibling_forward
from lorafusion_kernels.peft_wrappers import segment_wrapper_forward, wrong_copy_error

__all__ = [
    "install_peft_mixed_batches",
    "multi_lora_router",
    "peft_multi_lora_forward",
    "uninstall_peft_mixed_batches",
]


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
        adapter_names = ACTIVE_ROWS.get()  # a recomputed forward: PEFT's per-call hooks are gone
    if adapter_names is not None:
        batch, names = _rows_to_batch(layer, x, adapter_names)
    else:
        routing = active_routing()
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
    token = ACTIVE_ROWS.set(tuple(adapter_names)) if mixed_training else None
    try:
        yield
    finally:
        if token is not None:
            ACTIVE_ROWS.reset(token)
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

    if kwargs.get("adapter_names") is None and captured_routing() == (None, None):
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
    if kwargs.get("adapter_names") is not None or captured_routing() == (None, None):
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
        rows, routing = ACTIVE_ROWS.get(), active_routing()
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
    rows = ACTIVE_ROWS.get()
    if rows is not None:
        return args, {**kwargs, "adapter_names": list(rows)}
    routing = active_routing()
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
        if active_routing() is None and (kwargs.get("adapter_names") is None or not model.training):
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
    route_checkpoints(model)
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
    unroute_checkpoints(model)
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
