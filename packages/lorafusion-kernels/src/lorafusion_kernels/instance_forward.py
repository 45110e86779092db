"""Instance-level ``forward`` overrides that follow their module into ``nn.DataParallel`` replicas.

``patch_peft_model`` sets ``module.forward = partial(func, module)`` on PEFT's layers and wrappers
(a partial, not a bound method, so that a saved model loads). ``nn.DataParallel`` (what the HF
Trainer wraps a model in on several GPUs without ``torchrun``) replicates each module with a shallow
copy of its ``__dict__``, so a replica would call ``func`` on the original module, whose parameters
live on the first GPU. :func:`bind_forward` also overrides the module's
``_replicate_for_data_parallel``, which binds ``func`` to each replica instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["INSTANCE_ATTRIBUTES", "bind_forward", "unbind_forward"]

_REPLICATE = "_replicate_for_data_parallel"

INSTANCE_ATTRIBUTES = frozenset({"forward", _REPLICATE})
"""The instance attributes :func:`bind_forward` sets and :func:`unbind_forward` removes."""


def bind_forward(module: nn.Module, func: Callable[..., Any]) -> None:
    """Make ``module``'s forward ``func(module, ...)``, in ``nn.DataParallel`` replicas too."""
    setattr(module, "forward", functools.partial(func, module))  # noqa: B010 (mypy: assigning to a method)
    setattr(module, _REPLICATE, functools.partial(_replicate, module, func))


def _replicate(module: nn.Module, func: Callable[..., Any]) -> nn.Module:
    replica: nn.Module = type(module)._replicate_for_data_parallel(module)  # type: ignore[no-untyped-call]
    bind_forward(replica, func)
    return replica


def _is_partial_of(value: object, func: Callable[..., Any]) -> bool:
    return isinstance(value, functools.partial) and value.func is func


def unbind_forward(module: nn.Module, func: Callable[..., Any]) -> None:
    """Undo :func:`bind_forward`; a ``forward`` that hooks installed since is theirs, and stays."""
    if _is_partial_of(vars(module).get("forward"), func):
        del module.forward
    if _is_partial_of(vars(module).get(_REPLICATE), _replicate):
        delattr(module, _REPLICATE)
