"""Instance-level ``forward`` overrides that follow their module into copies and ``nn.DataParallel`` replicas.

``patch_peft_model`` sets ``module.forward = partial(func, module)`` on PEFT's layers and wrappers
(a partial, not a bound method, so that a saved model loads). Such an attribute names the module it
was made for, so every way of copying a module must bind ``func`` to the copy instead:

- ``nn.DataParallel`` (what the HF Trainer wraps a model in on several GPUs without ``torchrun``)
  replicates each module with a shallow copy of its ``__dict__``, so a replica would call ``func``
  on the original module, whose parameters live on the first GPU. :func:`bind_forward` overrides
  the module's ``_replicate_for_data_parallel``, which binds ``func`` to each replica.
- ``copy.copy`` reuses the original's attribute values, the partial included. ``copy.copy``,
  ``copy.deepcopy`` and pickling all ask the instance for its ``__reduce_ex__``, which
  :func:`bind_forward` also overrides: the copy is built with ``func`` bound to it, and its state
  (the original's, shallow or deep) carries none of these attributes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["INSTANCE_ATTRIBUTES", "bind_forward", "unbind_forward"]

_REPLICATE = "_replicate_for_data_parallel"
_REDUCE = "__reduce_ex__"

INSTANCE_ATTRIBUTES = frozenset({"forward", _REPLICATE, _REDUCE})
"""The instance attributes :func:`bind_forward` sets and :func:`unbind_forward` removes."""


def bind_forward(module: nn.Module, func: Callable[..., Any]) -> None:
    """Make ``module``'s forward ``func(module, ...)``, in its copies and ``nn.DataParallel`` replicas too."""
    setattr(module, "forward", functools.partial(func, module))  # noqa: B010 (mypy: assigning to a method)
    setattr(module, _REPLICATE, functools.partial(_replicate, module, func))
    setattr(module, _REDUCE, functools.partial(_reduce, module, func))


def _replicate(module: nn.Module, func: Callable[..., Any]) -> nn.Module:
    replica: nn.Module = type(module)._replicate_for_data_parallel(module)  # type: ignore[no-untyped-call]
    bind_forward(replica, func)
    return replica


def _reduce(module: nn.Module, func: Callable[..., Any], protocol: int) -> tuple[Any, ...]:
    """``module.__reduce_ex__(protocol)``, any protocol: rebuilt by :func:`_rebuild`, with ``nn.Module``'s state.

    The state leaves out the attributes :func:`bind_forward` set (the copy gets its own); a
    ``forward`` that hooks installed since is theirs, and stays in it, as it would without the patch.
    """
    ours = _bound(module, func)
    pickled: dict[str, Any] = module.__getstate__()  # type: ignore[no-untyped-call]
    state = {name: value for name, value in pickled.items() if name not in ours}
    return _rebuild, (type(module), func), state


def _rebuild(cls: type[nn.Module], func: Callable[..., Any]) -> nn.Module:
    """An empty ``cls`` with ``func`` bound to it; ``copy`` and ``pickle`` then set the copied state."""
    module = cls.__new__(cls)
    bind_forward(module, func)
    return module


def _bound(module: nn.Module, func: Callable[..., Any]) -> list[str]:
    """The attributes of ``module`` still holding what ``bind_forward(..., func)`` set (hooks may replace forward)."""
    installed: dict[str, Callable[..., Any]] = {"forward": func, _REPLICATE: _replicate, _REDUCE: _reduce}
    return [name for name, made_by in installed.items() if _is_partial_of(vars(module).get(name), made_by)]


def _is_partial_of(value: object, func: Callable[..., Any]) -> bool:
    return isinstance(value, functools.partial) and value.func is func


def unbind_forward(module: nn.Module, func: Callable[..., Any]) -> None:
    """Undo :func:`bind_forward`; a ``forward`` that hooks installed since is theirs, and stays."""
    for name in _bound(module, func):
        delattr(module, name)
