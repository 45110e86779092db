"""Drop-in for HF transformers + PEFT training scripts: route PEFT's ``lora.Linear`` through the fused op.

Two lines in a training script::

    import lorafusion_kernels

    lorafusion_kernels.patch_peft_model(model)

Each PEFT ``lora.Linear`` gets an instance-level ``forward`` that asks the routers (first answer
wins) whether this call can run fused: CUDA fp16/bf16 activations matching the base weight, or an
fp32 model under ``torch.autocast`` to one of them (which the fused op then follows: see
:mod:`lorafusion_kernels.autocast`), or CPU fp16/fp32 under ``TRITON_INTERPRET=1``; one active
adapter on the layer, no DoRA or other LoRA variant, no ``lora_bias``, an unquantized
``nn.Linear`` base layer or transformers' ``Conv1D`` (GPT-2: :mod:`lorafusion_kernels.base_layers`),
and no forward hooks on it or on the LoRA modules (the fused op does not call them). Anything else
runs PEFT's own forward, with one warning per reason and per ``patch_peft_model`` call. A trainable
base weight gets its gradient on either path. Nothing in the state dict changes, so
``save_pretrained`` still writes plain PEFT adapter files; :func:`unpatch_peft_model` removes the
instance attribute again.

Why not ``LoraConfig._register_custom_module``: PEFT does not persist that mapping (every load
must re-register it and pass ``config=``), it replaces the layer class at creation time only, and
it cannot be undone on a live model. The instance-level patch leaves classes, names and files alone.

PEFT is imported lazily: ``lorafusion_kernels`` itself depends on torch and triton only.
Multi-adapter batches extend this through :func:`register_router`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lorafusion_kernels._kernels._common import runs_triton
from lorafusion_kernels.autocast import autocast_dtype, call_as_linear, linear_compute_dtype
from lorafusion_kernels.base_layers import base_weight, unsupported_base
from lorafusion_kernels.errors import OnceWarnings
from lorafusion_kernels.instance_forward import bind_forward, unbind_forward
from lorafusion_kernels.lora import fused_lora_linear
from lorafusion_kernels.module_hooks import parts_wrapped
from lorafusion_kernels.multi_lora_routing import install_peft_mixed_batches, uninstall_peft_mixed_batches
from lorafusion_kernels.peft_siblings import unfuse_sibling_layers

__all__ = ["Route", "patch_peft_model", "register_router", "unpatch_peft_model"]

_PATCHED = "_lorafusion_patched"


@dataclasses.dataclass(frozen=True)
class Route:
    """How one call of a patched layer runs.

    Attributes:
        forward: ``(layer, x) -> y`` computing the layer fused, or None for PEFT's own forward.
        reason: Why PEFT's path is taken (warned once); None for a silent fallback (adapters
            disabled or merged, where PEFT's path is already the plain base layer).
        extra_args: Whether ``forward`` also takes the call's extra positional and keyword
            arguments, as ``forward(layer, x, *args, **kwargs)``. A route without them serves only
            calls that have none; other calls run PEFT's own forward, so a route for which PEFT's
            forward would be wrong (mixed-adapter segments) must set this.
    """

    forward: Callable[..., torch.Tensor] | None
    reason: str | None = None
    extra_args: bool = False


Router = Callable[[Any, torch.Tensor, dict[str, Any]], Route | None]
"""``(layer, x, forward kwargs) -> Route``, or None to let the next router decide."""

_WARNED = OnceWarnings()


def _warn_once(reason: str) -> None:
    _WARNED.warn(f"lorafusion: PEFT's own LoRA path is used for {reason}")


def _fused_single_adapter(layer: Any, x: torch.Tensor, name: str) -> torch.Tensor:
    """Adapter ``name`` of a PEFT ``lora.Linear`` through :func:`fused_lora_linear` (autocast: as nn.Linear)."""
    base, weight = layer.get_base_layer(), base_weight(layer)
    assert weight is not None  # the router checked unsupported_base
    dropout = layer.lora_dropout[name]
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    return call_as_linear(
        fused_lora_linear,
        x,
        weight,
        layer.lora_A[name].weight,
        layer.lora_B[name].weight,
        scaling=float(layer.scaling[name]),
        dropout_p=p,
        bias=base.bias,
    )


_HOOKED = (
    "layers with forward hooks or a wrapped forward on their base layer or LoRA modules "
    "(e.g. accelerate offloading), which the fused op would skip"
)


_VARIANTS = "DoRA and other LoRA variants"


def _is_variant(layer: Any, name: str) -> bool:
    """Whether adapter ``name`` of PEFT layer ``layer`` is DoRA or another LoRA variant (PEFT's forward only)."""
    return bool(layer.use_dora.get(name, False)) or name in getattr(layer, "lora_variant", {})


def single_adapter_router(layer: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Route:
    """The default router: one active plain-LoRA adapter on a supported tensor runs fused."""
    if kwargs.get("adapter_names") is not None:
        return Route(None, "mixed-adapter batches (adapter_names=...)")
    if layer.disable_adapters or layer.merged:
        return Route(None)
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if not active:
        return Route(None)  # none of the active adapters is on this layer: PEFT runs the base layer alone
    if len(active) > 1:
        return Route(None, "layers with several active adapters")
    name = active[0]
    if _is_variant(layer, name):
        return Route(None, _VARIANTS)
    if getattr(layer, "lora_bias", {}).get(name, False):
        return Route(None, "adapters with lora_bias=True")
    weight = base_weight(layer)
    if weight is None:
        return Route(None, unsupported_base(layer))
    if not isinstance(layer.lora_dropout[name], nn.Dropout | nn.Identity):
        return Route(None, f"dropout modules of type {type(layer.lora_dropout[name]).__name__}")
    if parts_wrapped(layer, (name,)):
        return Route(None, _HOOKED)
    compute = linear_compute_dtype(x, weight)
    if compute is None:
        amp = autocast_dtype(x)
        under = f" under torch.autocast to {amp}" if amp is not None else ""
        return Route(None, f"{x.dtype} inputs with {weight.dtype} base weights{under}")
    if not runs_triton(x, compute):
        return Route(
            None,
            f"{x.device.type} tensors of {compute} (the fused kernels serve CUDA fp16/bf16, "
            "and CPU fp16/fp32 under TRITON_INTERPRET=1)",
        )
    return Route(_fused_forward_for(name))


@functools.cache
def _fused_forward_for(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The single-adapter route's ``(layer, x)`` forward for adapter ``name``, made once per name."""
    return functools.partial(_fused_single_adapter, name=name)


_ROUTERS: list[Router] = [single_adapter_router]


def register_router(router: Router) -> None:
    """Ask ``router`` before the existing ones (e.g. a multi-adapter router handling ``adapter_names``)."""
    if router not in _ROUTERS:
        _ROUTERS.insert(0, router)


def _patched_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    route = None
    for router in _ROUTERS:
        route = router(self, x, kwargs)
        if route is not None:
            break
    if route is not None and route.forward is not None:
        if route.extra_args:
            return route.forward(self, x, *args, **kwargs)
        if not args and not kwargs:
            return route.forward(self, x)
        # Extra arguments are meant for the base layer, which PEFT's forward passes them to.
        _warn_once("calls with extra arguments for the base layer")
    elif route is not None and route.reason is not None:
        _warn_once(route.reason)
    peft_forward: Callable[..., torch.Tensor] = type(self).forward
    return peft_forward(self, x, *args, **kwargs)


def is_patched(module: nn.Module) -> bool:
    """Whether :func:`patch_peft_model` routed ``module`` through the patched forward."""
    return bool(getattr(module, _PATCHED, False))


def _lora_linear_class() -> type[nn.Module]:
    from peft.tuners.lora.layer import Linear

    return Linear


def _check_module(model: object, function: str) -> None:
    """Refuse a ``model`` that is not an ``nn.Module`` (a ``LoraConfig``, a state dict) with a ``TypeError``.

    Raises:
        TypeError: Naming what was given and what to pass.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{function} takes the model (an nn.Module), got {type(model).__name__}: pass the model that "
            "peft.get_peft_model returned"
        )


def patch_peft_model(model: nn.Module) -> int:
    """Route every PEFT ``lora.Linear`` in ``model`` through the fused op; returns how many were patched.

    Layers that can never run fused (quantized base, other LoRA layer types, DoRA or another
    LoRA variant on every adapter of the layer, a ``forward`` already overridden on the instance or
    its base layer by hooks) are left alone, not counted, with one warning per reason. Patching
    twice is harmless. LoRA layers created later (``add_adapter`` or ``load_adapter`` on new target
    modules) are not patched: call this again (until then, mixed-adapter calls of ``model`` raise an
    error naming them). A model without any PEFT LoRA layer (a plain model, or the base model before
    ``peft.get_peft_model`` wrapped it) is warned about: nothing of it runs fused.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ImportError: if ``peft`` is not installed.
    """
    _check_module(model, "patch_peft_model")
    from peft.tuners.lora.layer import LoraLayer

    linear_cls = _lora_linear_class()
    _WARNED.clear()
    patched = 0
    lora_layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    if not lora_layers:
        _WARNED.warn(
            f"lorafusion: patch_peft_model found no PEFT LoRA layer in this {type(model).__name__}, so nothing "
            "will run fused: call it on the model that peft.get_peft_model returned (after get_peft_model, "
            "not on the base model before it)"
        )
    for module in lora_layers:
        if type(module) is not linear_cls:
            _warn_once(f"{type(module).__name__} layers (only lora.Linear is fused)")
            continue
        if getattr(module, _PATCHED, False):
            patched += 1
            continue
        if module.lora_A and all(_is_variant(module, name) for name in module.lora_A):
            _warn_once(_VARIANTS)  # every call would take PEFT's path: no patch, and not counted
            continue
        structural = unsupported_base(module)
        if structural is not None:
            _warn_once(structural)
            continue
        if "forward" in vars(module) or "forward" in vars(module.get_base_layer()):
            _warn_once("layers whose forward is already wrapped by hooks (e.g. accelerate offloading)")
            continue
        # A partial, not a bound method: a bound method pickles as a lookup of its name on the
        # instance, which fails when the model is loaded (``_patched_forward`` is no attribute).
        bind_forward(module, _patched_forward)
        setattr(module, _PATCHED, True)
        patched += 1
    # Mixed-adapter batches (multi_lora_batch, adapter_names=): see lorafusion_kernels.multi_lora.
    install_peft_mixed_batches(model)
    return patched


def unpatch_peft_model(model: nn.Module) -> int:
    """Undo :func:`patch_peft_model`; returns how many layers were restored.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    _check_module(model, "unpatch_peft_model")
    restored = 0
    uninstall_peft_mixed_batches(model)
    unfuse_sibling_layers(model)
    for module in model.modules():
        if getattr(module, _PATCHED, False):
            unbind_forward(module, _patched_forward)
            delattr(module, _PATCHED)
            restored += 1
    return restored
