"""What this host lacks for a config: a GPU for ``runtime.device: cuda``, TensorBoard for ``logging.tensorboard_dir``.

These are warnings, not the errors of :mod:`lorafusion_megatron.checks`: ``validate`` is meant to
run on a login node, which often has no GPU and may hold other packages than the node that trains.
``train`` refuses ``device: cuda`` without a GPU at its start
(:func:`lorafusion_megatron.model.resolve_device`) and trains without TensorBoard scalars when the
package is missing, as it always has. ``validate`` also warns here of a ``scheduler.capacity`` past
the base model's context, which is a config's matter, not the host's.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig

__all__ = ["TENSORBOARD_INSTALL", "cuda_missing", "host_warnings", "tensorboard_missing"]

TENSORBOARD_INSTALL = 'pip install "lorafusion-megatron[tensorboard]"'
"""The command that installs TensorBoard for ``logging.tensorboard_dir`` (the package's optional extra)."""


def _tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def tensorboard_missing(tensorboard_dir: str | None) -> str | None:
    """Why ``logging.tensorboard_dir`` gets no scalars on this host (TensorBoard is not installed), if so."""
    if tensorboard_dir is None or _tensorboard_installed():
        return None
    return (
        f"logging.tensorboard_dir is set but TensorBoard is not installed: `{TENSORBOARD_INSTALL}` to get "
        "scalars, or set logging.tensorboard_dir: null; training goes on without them"
    )


def cuda_missing(config: TrainerConfig) -> str | None:
    """Why ``runtime.device: cuda`` cannot train on this host (torch sees no GPU), if so.

    Imports torch, and only for ``device: cuda``: other configs validate without it.
    """
    if config.runtime.device != "cuda":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (
        "runtime.device is cuda but this host has no GPU that torch can use (torch.cuda.is_available() is False): "
        "fine if the run trains on another node; to train here, set runtime.device: auto or cpu"
    )


def host_warnings(config: TrainerConfig) -> list[str]:
    """What this host lacks for ``config``, and a capacity past the model's context (``validate`` prints them).

    None of them stops ``validate``. The capacity warning is not the host's: it is here because
    these are the warnings ``validate`` prints (``train`` warns of it too:
    :func:`~lorafusion_megatron.checks.capacity_past_context`).
    """
    from lorafusion_megatron.checks import capacity_past_context

    found = (cuda_missing(config), tensorboard_missing(config.logging.tensorboard_dir), capacity_past_context(config))
    return [warning for warning in found if warning is not None]
