"""Next-token cross-entropy from the decoder's last hidden state, without the full logits.

An HF causal LM computes logits ``Z = H W^T (+ b)`` of shape ``[T, V]`` and then the loss. For
LLaMA-3.1-8B (``V = 128,256``) at ``T = 4,096`` tokens those logits take 1 GiB in bf16, their fp32
copy for the loss 2 GiB, and the backward the same again for their gradients. Here the loss runs
over chunks of rows: each chunk's logits exist only while that chunk is processed, in the forward
and once more (recomputed) in the backward, so the extra memory is ``O(chunk_tokens * V)`` rather
than ``O(T * V)``; what the backward keeps beyond the inputs is ``O(T)``: each row's float32
log-sum-exp, target id and trained flag.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch.autograd.function import once_differentiable

from lorafusion_megatron.data.samples import IGNORE_INDEX

__all__ = ["LOGITS_CHUNK_ELEMENTS", "causal_lm_token_losses", "chunked_token_losses", "default_chunk_tokens"]

LOGITS_CHUNK_ELEMENTS = 2**27
"""Logit elements per chunk: 512 MiB of float32 logits, about 1,000 tokens of LLaMA-3's vocabulary."""

# Config keys of HF models that transform the logits between the LM head and the loss.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def default_chunk_tokens(vocab_size: int) -> int:
    """Rows per chunk: as many as keep one chunk's float32 logits within :data:`LOGITS_CHUNK_ELEMENTS`.

    A chunk costs about ``10 * chunk_tokens * V`` bytes at its peak (logits in a 2-byte model dtype,
    their float32 copy and one float32 temporary), 1.3 GB for ``V = 128,256`` (1,046 tokens), while
    the LM-head matmul ``[chunk_tokens, H] x [H, V]`` keeps over a thousand rows, a large GEMM.

    Args:
        vocab_size: ``V``, the output layer's rows.
    """
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)


def chunked_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int,
) -> torch.Tensor:
    """Per-token cross-entropy of a linear output layer, ``chunk_tokens`` rows of logits at a time.

    For row ``t`` with hidden state ``h_t`` and target ``y_t``, the logits ``z_t = W h_t + b`` are
    computed in the model dtype and upcast to float32 (as ``F.cross_entropy(logits.float())`` on
    HF's logits sees them), and

        loss_t = logsumexp(z_t) - z_t[y_t]      (0 where y_t == -100).

    The backward recomputes each chunk's logits and uses ``d loss_t / d z_t = softmax(z_t) -
    onehot(y_t)``: with ``G[t] = g_t (softmax(z_t) - onehot(y_t))`` (``g_t`` the incoming gradient,
    ``G[t] = 0`` for ignored rows) cast to the model dtype,

        dL/dH = G W,    dL/dW = G^T H,    dL/db = sum_t G[t].

    ``dL/dW`` and ``dL/db`` are computed only when those tensors require a gradient (a frozen LM
    head, as in LoRA training, costs nothing more), accumulated over chunks in float32.

    Memory: the forward keeps ``hidden``, ``weight`` and ``bias`` (references, no copies) and per
    row the float32 log-sum-exp, the target id and whether it is trained; forward and backward
    each need about ``10 * chunk_tokens * V`` bytes at their peak for one chunk's logits, instead
    of the ``O(T * V)`` of full logits.

    Args:
        hidden: ``[T, H]`` last hidden states (after the final norm).
        weight: ``[V, H]`` output layer weight, same dtype as ``hidden``.
        targets: ``[T]`` int64 target token ids, ``-100`` where not trained.
        bias: ``[V]`` output layer bias, if any.
        chunk_tokens: Rows per chunk (see :func:`default_chunk_tokens`).

    Returns:
        ``[T]`` float32 token losses, 0 where the target is ``-100``.

    Raises:
        ValueError: Shapes do not match or ``chunk_tokens < 1``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [V, H] do not match: {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T] = [{hidden.shape[0]}], got {list(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {list(bias.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    losses: torch.Tensor = _ChunkedTokenLosses.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, targets, chunk_tokens
    )
    return losses


def causal_lm_token_losses(causal_lm: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token losses of an HF ``*ForCausalLM`` from its decoder's output, its LM head applied in chunks.

    Equals ``F.cross_entropy(causal_lm(...).logits[0].float(), targets, reduction="none")``. A tied
    LM head is the embedding matrix itself, so gradients, if it takes any, reach that parameter.
    An output layer that is not a plain ``torch.nn.Linear`` (a LoRA adapter on ``lm_head``), or a
    model that transforms its logits after the head (:func:`_transform_logits`), takes the full
    ``[T, V]`` logits instead, as HF computes them.

    Args:
        causal_lm: The ``*ForCausalLM`` module (inside PEFT: ``peft_model.base_model.model``).
        hidden: ``[1, T, H]`` the decoder's last hidden state, final norm applied.
        targets: ``[T]`` target token ids, ``-100`` where not trained.

    Returns:
        ``[T]`` float32 token losses, 0 where the target is ``-100``.
    """
    head = causal_lm.get_output_embeddings()
    configured = {key: getattr(causal_lm.config, key, None) for key in _LOGIT_TRANSFORMS}
    transforms = {key: float(value) for key, value in configured.items() if value is not None and value != 1}
    if type(head) is not torch.nn.Linear or transforms:
        logits = _transform_logits(head(hidden)[0], transforms)
        return F.cross_entropy(logits.float(), targets, reduction="none")
    return chunked_token_losses(
        hidden[0], head.weight, targets, bias=head.bias, chunk_tokens=default_chunk_tokens(head.out_features)
    )


def _transform_logits(logits: torch.Tensor, transforms: dict[str, float]) -> torch.Tensor:
    """What HF's models do to the head's logits, by config key.

    ``final_logit_softcapping`` ``c`` (Gemma 2 and 3): ``c * tanh(z / c)``; ``logit_scale`` ``s``
    (Cohere): ``s * z``; ``logits_scaling`` ``s`` (Granite): ``z / s``.
    """
    for key, value in transforms.items():
        match key:
            case "final_logit_softcapping":
                logits = torch.tanh(logits / value) * value
            case "logit_scale":
                logits = logits * value
            case "logits_scaling":
                logits = logits / value
            case _:
                raise AssertionError(key)
    return logits


class _ChunkedTokenLosses(torch.autograd.Function):
    """The autograd function behind :func:`chunked_token_losses` (maths and memory there)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_tokens: int,
    ) -> torch.Tensor:
        trained = targets != IGNORE_INDEX
        picked = torch.where(trained, targets, 0)  # a valid index on every row
        losses = hidden.new_empty(hidden.shape[:1], dtype=torch.float32)
        log_sum_exp = torch.empty_like(losses)
        for rows in _chunks(hidden.shape[0], chunk_tokens):
            logits = F.linear(hidden[rows], weight, bias).float()
            log_sum_exp[rows] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, picked[rows, None]).squeeze(1)
            losses[rows] = torch.where(trained[rows], log_sum_exp[rows] - target_logit, 0.0)
        ctx.save_for_backward(hidden, weight, bias, picked, trained, log_sum_exp)
        ctx.chunk_tokens = chunk_tokens
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, picked, trained, log_sum_exp = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        scale = torch.where(trained, grad_losses, 0.0)
        for rows in _chunks(hidden.shape[0], ctx.chunk_tokens):
            logits = F.linear(hidden[rows], weight, bias).float()
            # softmax - onehot, in place: the chunk's logits are its only [chunk, V] buffer.
            grad_logits = logits.sub_(log_sum_exp[rows, None]).exp_()
            grad_logits[torch.arange(grad_logits.shape[0], device=grad_logits.device), picked[rows]] -= 1.0
            grad_logits.mul_(scale[rows, None])
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ hidden[rows]).float()
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def _chunks(total: int, size: int) -> list[slice]:
    """``[0, size), [size, 2 size), ...`` up to ``total`` rows (the last one shorter)."""
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]
