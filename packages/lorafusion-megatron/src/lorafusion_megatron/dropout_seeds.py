"""Dropout draws that depend on what is computed, not on which process computes it or when.

Dropout (PEFT's ``nn.Dropout``, the seed the fused ``lorafusion_kernels`` ops draw and replay in
the backward, attention dropout) reads torch's global generators, whose state depends on everything
drawn before. A pipeline stage runs other layers, in another order (1F1B interleaves microbatches),
than the single-process trainer, so the same draw would see another state. Instead, a forward
pre-hook on every decoder layer reseeds the generators of the layer's device (the CPU's and, on a
GPU, that device's CUDA generator) right before the layer runs:

    seed(L, k) = H(run seed, L, k)

with ``L`` the layer's index in the whole model, ``k`` the key of the samples the layer runs on and
``H`` a 63-bit slice of BLAKE2b. ``k`` is a digest of segments (adapter, global batch and sample
indices, in order): all of the microbatch's when the fused ops run it in one pass, the one segment's
when plain PEFT runs a microbatch one segment at a time (so a segment's draws do not depend on what
else the scheduler packed with it). So every draw of layer ``L`` on given samples is the same in any
process that runs ``L`` and in any order, and a resumed run draws what an uninterrupted one did
without any saved generator state. Keys name samples rather than the microbatch's position, which
shifts with the no-ops a pipelined plan or program inserts; no two microbatches (or segments) of a
run hold the same samples of a global batch, so keys never repeat.

The runtimes say which microbatch (and segment) runs through :func:`drawing_for` and
:func:`drawing_segment`; a recomputation under activation checkpointing runs in the backward, where
another microbatch may be current, so :func:`with_draws_restored` re-enters the draw context its
forward saw. Outside :func:`drawing_for` (evaluation, tests of bare models) the hook leaves the
generators alone.

Cost: one short BLAKE2b and one or two ``manual_seed`` calls per layer call (host-side: a CUDA
generator's seed and offset are plain fields, no kernel runs). Measured on a busy 2-core CPU: 9 us
per layer call, the hash and the CPU generator's reseed about 2.5 us each; not yet timed on a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from lorafusion_sched.models import Microbatch, Segment

__all__ = [
    "CheckpointContexts",
    "DrawContext",
    "current_draws",
    "drawing_for",
    "drawing_segment",
    "install_dropout_seeding",
    "layer_seed",
    "samples_key",
    "with_draws_restored",
]

CheckpointContexts = Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]
"""A ``context_fn`` of ``torch.utils.checkpoint.checkpoint``: ``() -> (forward context, recompute context)``."""


@dataclass(frozen=True)
class DrawContext:
    """What the decoder layers run on now.

    Attributes:
        key: ``k``: the key of the samples the layers run on (:func:`samples_key`).
        segment_keys: The key of each segment of the current microbatch alone, for :func:`drawing_segment`.
    """

    key: bytes
    segment_keys: tuple[bytes, ...] = ()


_CURRENT: contextvars.ContextVar[DrawContext | None] = contextvars.ContextVar("lorafusion_dropout_draws", default=None)


def samples_key(segments: Sequence[Segment]) -> bytes:
    """``k``: a 16-byte digest of ``segments`` (adapter, global batch and sample indices, in order)."""
    text = ";".join(
        f"{segment.adapter}/{segment.global_batch}/{','.join(map(str, segment.samples))}" for segment in segments
    )
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def layer_seed(run_seed: int, layer: int, key: bytes) -> int:
    """``seed(L, k)``: the seed of layer ``layer``'s draws on the samples of ``key``, in ``[0, 2**63)``."""
    # The run seed goes in through its decimal digits: Python ints of any size.
    message = struct.pack("<q", layer) + key + str(run_seed).encode()
    return int.from_bytes(hashlib.blake2b(message, digest_size=8).digest(), "little") >> 1


def current_draws() -> DrawContext | None:
    """The draw context set by :func:`drawing_for` (and :func:`drawing_segment`), if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def _entered(draws: DrawContext | None) -> Iterator[None]:
    token = _CURRENT.set(draws)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def drawing_for(microbatch: Microbatch) -> contextlib.AbstractContextManager[None]:
    """Decoder layers run inside draw for all of ``microbatch``'s samples (run in one pass)."""
    segments = microbatch.segments
    return _entered(DrawContext(samples_key(segments), tuple(samples_key((segment,)) for segment in segments)))


def drawing_segment(index: int) -> contextlib.AbstractContextManager[None]:
    """Decoder layers run inside draw for segment ``index`` of the current microbatch alone.

    Outside :func:`drawing_for` there is no microbatch to draw for, and this changes nothing.
    """
    draws = _CURRENT.get()
    return contextlib.nullcontext() if draws is None else _entered(DrawContext(draws.segment_keys[index]))


def with_draws_restored(context_fn: CheckpointContexts) -> CheckpointContexts:
    """``context_fn`` whose recomputation also sees the draw context of the checkpointed forward.

    ``torch.utils.checkpoint`` calls ``context_fn`` at forward time, so the draw context current
    then is captured and re-entered around the recomputation in the backward.
    """

    def contexts() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        forward, recompute = context_fn()
        return forward, _restoring(_CURRENT.get(), recompute)

    return contexts


@contextlib.contextmanager
def _restoring(draws: DrawContext | None, inner: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with _entered(draws), inner:
        yield


def _reseed(device: torch.device, seed: int) -> None:
    """Seed the CPU generator and, for a GPU, ``device``'s CUDA generator (not every GPU's)."""
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)


def install_dropout_seeding(layers: Mapping[int, torch.nn.Module], *, run_seed: int) -> list[RemovableHandle]:
    """Reseed the generators before each call of each decoder layer, from ``seed(L, k)``.

    Args:
        layers: Decoder layers by their index ``L`` in the whole model (a pipeline stage passes its own).
        run_seed: The run's seed (``runtime.seed``).

    Returns:
        The hooks' handles (``handle.remove()`` uninstalls one).
    """

    def hook_for(layer: int) -> Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def reseed(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            draws = _CURRENT.get()
            if draws is None:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            _reseed(hidden.device, layer_seed(run_seed, layer, draws.key))

        return reseed

    return [
        module.register_forward_pre_hook(hook_for(index), with_kwargs=True) for index, module in sorted(layers.items())
    ]
