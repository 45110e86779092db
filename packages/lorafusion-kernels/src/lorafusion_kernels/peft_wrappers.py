"""PEFT's ``modules_to_save`` and trainable-token wrappers in a mixed-adapter microbatch.

PEFT's ``AuxiliaryTrainingWrapper`` (``ModulesToSaveWrapper``: a whole copy of a module per
adapter, as a ``SEQ_CLS`` head or an ``lm_head`` with added tokens; ``TrainableTokensWrapper``:
per-adapter rows of an embedding) applies one adapter's copy to every token of a plain call.
Inside :func:`lorafusion_kernels.multi_lora_batch` the tokens are consecutive segments of several
adapters, so the tokens of segment ``j`` need the copy of adapter ``segment_adapters[j]`` (or the
original module, for ``"__base__"`` and adapters without a copy). This module decides which copy
each segment needs and runs them: one call per copy on all of its tokens, the outputs put back in
token order. That is exact only for modules that act on each token alone, so it serves wrappers
around ``nn.Linear`` and ``nn.Embedding`` (PEFT's own mixed batches serve these and convolutions,
per sample); any other wrapper whose one copy would be wrong for some segment is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lorafusion_kernels.errors import LoRAFusionKernelsError, module_path
from lorafusion_kernels.metadata import MultiLoRABatch

__all__ = ["segment_wrapper_forward", "wrapper_copy_for", "wrong_copy_error"]

TOKENWISE = (nn.Linear, nn.Embedding)
"""Wrapped modules whose output row ``t`` depends only on input token ``t``: routed per segment."""


def wrapper_applies(wrapper: Any) -> str | None:
    """The adapter whose copy ``wrapper`` applies to every token of a plain call (None: the original module).

    As PEFT's ``AuxiliaryTrainingWrapper.forward`` decides: the first active adapter, unless the
    wrapper is disabled, has no active adapter, or lacks one of them.
    """
    active: list[str] = list(wrapper.active_adapters)
    if wrapper.disable_adapters or not active or any(name not in wrapper._adapters for name in active):
        return None
    return active[0]


def wrapper_copy_for(wrapper: Any, name: str) -> str | None:
    """The adapter whose copy the tokens of adapter ``name`` need (None: the original module).

    Its own copy if the wrapper holds one; the original module otherwise, or while the wrapper is
    disabled (``disable_adapter()`` disables the LoRA layers too, so every token gets the frozen model).
    """
    return None if wrapper.disable_adapters or name not in wrapper._adapters else name


def _segment_copies(
    wrapper: Any, batch: MultiLoRABatch, adapter_names: Sequence[str]
) -> list[tuple[int, int, str | None]]:
    """``(start, length, copy)`` per run of consecutive non-empty segments that need the same copy."""
    runs: list[tuple[int, int, str | None]] = []
    for start, length, adapter in batch.nonempty_segments():
        copy = wrapper_copy_for(wrapper, adapter_names[adapter])
        if runs and runs[-1][2] == copy:
            runs[-1] = (runs[-1][0], runs[-1][1] + length, copy)
        else:
            runs.append((start, length, copy))
    return runs


def wrong_copy_error(
    wrapper: Any, batch: MultiLoRABatch, adapter_names: Sequence[str], why: str
) -> LoRAFusionKernelsError | None:
    """The error for a plain call of ``wrapper`` in this batch, or None when its one copy suits every token.

    Args:
        wrapper: A PEFT ``AuxiliaryTrainingWrapper``.
        batch: The microbatch's segments.
        adapter_names: PEFT adapter name of each adapter index.
        why: Why the call cannot be routed per segment (ends the first sentence of the message).
    """
    applies = wrapper_applies(wrapper)
    wronged = [
        adapter_names[a] for a in batch.active_adapters if wrapper_copy_for(wrapper, adapter_names[a]) != applies
    ]
    if not wronged:
        return None
    where = module_path(wrapper)
    applied = "the original module" if applies is None else f"the copy of adapter {applies!r}"
    return LoRAFusionKernelsError(
        f"{where} is a PEFT {type(wrapper).__name__} (modules_to_save or trainable tokens) holding copies for "
        f"adapters {sorted(wrapper._adapters)}; {why}, so a plain call would apply {applied} to every token, "
        f"wrong for the tokens of {wronged}. Pass PEFT's adapter_names= (one adapter name per sample) instead, "
        "or batch these adapters separately"
    )


def _call_copy(wrapper: Any, copy: str | None, x: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Adapter ``copy``'s module of ``wrapper`` (the original module for None), as PEFT's mixed batches call it."""
    if copy is None:
        out: torch.Tensor = wrapper.original_module(x, *args, **kwargs)
    else:
        out = wrapper._forward_wrapped_mixed_batch(x, copy, *args, **kwargs)
    return out


def _token_rows(
    wrapper: Any, batch: MultiLoRABatch, adapter_names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Size]:
    """The call's input as one row per token, and the leading shape to restore; raises when it has no such form."""
    original = wrapper.original_module
    if not isinstance(original, TOKENWISE):
        why = f"it wraps a {type(original).__name__}, and only copies of nn.Linear and nn.Embedding route per segment"
    elif len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        why = "it was called with arguments other than one input tensor, which the per-segment routing does not take"
    else:
        x: torch.Tensor = args[0]
        lead = x.shape if isinstance(original, nn.Embedding) else x.shape[:-1]
        if lead.numel() != batch.total_tokens:
            where = module_path(wrapper)
            raise LoRAFusionKernelsError(
                f"{where} got {lead.numel()} tokens (input {list(x.shape)}) but the multi-LoRA batch holds "
                f"{batch.total_tokens}; every module routed inside `multi_lora_batch` must see the packed tokens"
            )
        rows = x.reshape(-1) if isinstance(original, nn.Embedding) else x.reshape(-1, x.shape[-1])
        return rows, lead
    error = wrong_copy_error(wrapper, batch, adapter_names, why)
    assert error is not None  # called only when the segments need different copies
    raise error


def segment_wrapper_forward(
    wrapper: Any, batch: MultiLoRABatch, adapter_names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor:
    """``wrapper``'s output with each segment's tokens through the copy of that segment's adapter.

    One call per copy, on the tokens of every segment that needs it: ``y[t] = copy_j(x[t])`` for
    token ``t`` of segment ``j`` (so each copy's weight gradient is computed once, however its
    segments interleave with others'). A batch whose segments all need one copy calls it once with
    the arguments unchanged (any wrapped module, any arguments after the input).

    Args:
        wrapper: A PEFT ``AuxiliaryTrainingWrapper``.
        batch: The microbatch's segments.
        adapter_names: PEFT adapter name of each adapter index.
        args: The call's positional arguments: ``x [..., K]`` for ``nn.Linear``, ids ``[...]`` for
            ``nn.Embedding``, with ``batch.total_tokens`` tokens.
        kwargs: The call's keyword arguments (none, when routed per segment).

    Returns:
        ``[..., N]`` (``nn.Linear``) or ``[..., H]`` (``nn.Embedding``), as the wrapped module returns.

    Raises:
        LoRAFusionKernelsError: Segments need different copies of a module that is not token-wise,
            or the input's token count differs from the batch's.
    """
    runs = _segment_copies(wrapper, batch, adapter_names)
    copies = {copy for *_, copy in runs}
    if copies <= {wrapper_applies(wrapper)}:
        plain: torch.Tensor = type(wrapper).forward(wrapper, *args, **kwargs)
        return plain
    if len(copies) == 1 and args:
        return _call_copy(wrapper, copies.pop(), *args, **kwargs)
    rows, lead = _token_rows(wrapper, batch, adapter_names, args, kwargs)
    if len(copies) == len(runs):  # one run per copy: slices, in token order
        pieces = [_call_copy(wrapper, copy, rows[start : start + length]) for start, length, copy in runs]
        out = torch.cat(pieces, dim=0)
    else:
        owned = {copy: _token_index([(s, n) for s, n, c in runs if c == copy], rows.device) for copy in copies}
        pieces = [_call_copy(wrapper, copy, rows.index_select(0, index)) for copy, index in owned.items()]
        out = _PlaceRows.apply(tuple(owned.values()), *pieces)  # type: ignore[no-untyped-call]
    return out.reshape(*lead, *out.shape[1:])


def _token_index(runs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The tokens of ``runs`` (``(start, length)``), in order, as an int64 index built on ``device``."""
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in runs])


class _PlaceRows(torch.autograd.Function):
    """``out[indices[c]] = pieces[c]``: each copy's output rows put back at its tokens (``indices`` cover ``T``).

    One write of ``out`` forward and one read of its gradient backward; the built-in alternatives
    (``index_copy_`` per copy, or ``cat`` then a gather) pass over the ``[T, N]`` output again per
    copy or twice. Outputs of several dtypes are placed in the one that holds them all.
    """

    @staticmethod
    def forward(ctx: Any, indices: tuple[torch.Tensor, ...], *pieces: torch.Tensor) -> torch.Tensor:
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in pieces))
        out = pieces[0].new_empty((sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]), dtype=dtype)
        for index, piece in zip(indices, pieces, strict=True):
            out.index_copy_(0, index, piece.to(dtype))
        ctx.indices = indices
        ctx.dtypes = [p.dtype for p in pieces]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pieces = (grad.index_select(0, index).to(dtype) for index, dtype in zip(ctx.indices, ctx.dtypes, strict=True))
        return (None, *pieces)
