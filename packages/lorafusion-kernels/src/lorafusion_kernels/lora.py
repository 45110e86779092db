"""FusedLoRA: the single-adapter LoRA linear layer as two fused Triton GEMMs and two skinny passes.

Maths (shapes ``x [M, K]``, ``W [N, K]``, ``A [r, K]``, ``B [N, r]``, ``bias [N]``)::

    keep ~ Bernoulli(1 - p) per element of x, regenerated from (seed, row, col)
    x_hat = keep * x / (1 - p)
    S     = x_hat A^T                                  [M, r]
    y     = x W^T + bias + scaling * S B^T             [M, N]

Chain rule, with ``dy = dL/dy [M, N]`` (W is frozen and gets no gradient)::

    dB    = scaling * dy^T S                           [N, r]
    dS    = scaling * dy B                             [M, r]
    dA    = dS^T x_hat                                 [r, K]
    dx    = dy W + keep * (dS A) / (1 - p)             [M, K]
    dbias = sum_rows dy                                [N]       (only if bias requires grad)

Kernels: forward ``lora_xa`` (dropout and ``x_hat A^T`` in one read of x), then ``lora_xw_sb``
(``x W^T + scaling * S B^T + bias`` in one GEMM); backward ``lora_dys_dyb`` (``dS`` and ``dB`` from
one read of dy), ``lora_dsx`` (``dA``) and ``lora_dyw_dsa`` (``dx`` in one GEMM). Saved for backward:
x, S (in x's dtype) and the 8-byte seed; neither the mask nor ``x_hat`` is stored. ``scaling`` is
applied in fp32 inside the kernels, never stored in ``S``, so in fp16 ``S`` overflows where PEFT's
``lora_A(dropout(x))`` does.

Both halves are ``torch.library`` custom ops (``lorafusion::fused_lora_forward`` and
``lorafusion::fused_lora_backward``), so ``torch.compile`` traces through them. CUDA fp16/bf16 tensors
run the Triton kernels; so do CPU fp16/fp32 tensors when ``TRITON_INTERPRET=1``; other tensors (CUDA
fp32, CPU without the interpreter, float64 anywhere) take a plain torch path with the same dropout
mask, computing in fp32 (float64 in float64).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from lorafusion_kernels._kernels._common import (
    ACTIVATION_DTYPES,
    MAX_RANK,
    parameter_grads,
    runs_triton,
    unaliased,
    zeroed_fp32,
)
from lorafusion_kernels._kernels.lora_dsx import lora_dsx
from lorafusion_kernels._kernels.lora_dys_dyb import lora_dys_dyb
from lorafusion_kernels._kernels.lora_dyw_dsa import lora_dyw_dsa
from lorafusion_kernels._kernels.lora_xa import lora_xa
from lorafusion_kernels._kernels.lora_xw_sb import lora_xw_sb
from lorafusion_kernels.autocast import call_as_linear
from lorafusion_kernels.dropout import check_seed, draw_seed, dropout_keep_mask, keep_threshold, seed_tensor
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.first_order import first_order_only
from lorafusion_kernels.integers import integer_or_none

__all__ = ["FusedLoRAFunction", "FusedLoRALinear", "fused_lora_linear"]

DETERMINISTIC_ENV = "LORAFUSION_DETERMINISTIC"


def deterministic_mode() -> bool:
    """Whether backward avoids atomics.

    True under ``torch.use_deterministic_algorithms(True)`` or with ``LORAFUSION_DETERMINISTIC=1``.
    """
    return torch.are_deterministic_algorithms_enabled() or os.environ.get(DETERMINISTIC_ENV, "0") == "1"


def _torch_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    seed: torch.Tensor,
    scaling: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch version of the forward op (tensors no Triton kernel serves), accumulating in fp32 (fp64 for fp64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x_hat = x.to(compute)
    if dropout_p > 0.0:
        keep = dropout_keep_mask(int(seed.item()), x.shape[0], x.shape[1], dropout_p, device=x.device)
        x_hat = x_hat * keep
    s = (x_hat @ lora_a.to(compute).T * (1.0 / (1.0 - dropout_p))).to(x.dtype)
    y = x.to(compute) @ weight.to(compute).T + s.to(compute) @ lora_b.to(compute).T * scaling
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype), s


def _torch_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    scaling: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch version of the backward op, accumulating in fp32 (fp64 for fp64)."""
    compute = torch.promote_types(dy.dtype, torch.float32)
    dy_c = dy.to(compute)
    inv_keep = 1.0 / (1.0 - dropout_p)
    x_c = x.to(compute)
    ds = dy_c @ lora_b.to(compute) * scaling
    ds_a = ds @ lora_a.to(compute) * inv_keep
    if dropout_p > 0.0:
        keep = dropout_keep_mask(int(seed.item()), x.shape[0], x.shape[1], dropout_p, device=x.device)
        x_c = x_c * keep
        ds_a = ds_a * keep
    dx = dy_c @ weight.to(compute) + ds_a
    da = ds.T @ x_c * inv_keep
    db = dy_c.T @ s.to(compute) * scaling
    return dx.to(dy.dtype), da.to(lora_a.dtype), db.to(lora_b.dtype)


def _forward_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    seed: torch.Tensor,
    scaling: float,
    dropout_p: float,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, S)`` for 2-D ``x [M, K]``: ``y [M, N]``, ``S = x_hat A^T [M, r]``.

    ``deterministic`` is read by the backward only (its autograd context keeps it).
    """
    if not runs_triton(x) or x.shape[0] == 0:
        return _torch_forward(x, weight, lora_a, lora_b, bias, seed, scaling, dropout_p)
    s = lora_xa(
        x,
        lora_a,
        scale=1.0 / (1.0 - dropout_p),
        keep_threshold=keep_threshold(dropout_p),
        seed=seed,
        has_dropout=dropout_p > 0.0,
    )
    y = lora_xw_sb(x, weight, s, lora_b, bias, scaling=scaling)
    return y, s


def _backward_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    scaling: float,
    dropout_p: float,
    need_dx: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dA, dB)``; ``dx`` is an empty ``[0]`` tensor when ``need_dx`` is False."""
    dy = dy.contiguous() if dy.stride(-1) != 1 else dy
    if not runs_triton(dy) or dy.shape[0] == 0:
        dx, da, db = _torch_backward(dy, x, weight, lora_a, lora_b, s, seed, scaling, dropout_p)
        return (dx if need_dx else dx.new_empty(0)), da, db
    threshold = keep_threshold(dropout_p)
    inv_keep = 1.0 / (1.0 - dropout_p)
    has_dropout = dropout_p > 0.0
    if deterministic:
        ds, db = lora_dys_dyb(dy, lora_b, s, scaling=scaling, deterministic=True)
        da_out = None
    else:
        # One zeroed fp32 buffer [dB | dA | dS] takes every atomic sum: one fill, and for parameters
        # of one dtype one conversion of the [dB | dA] span (none for fp32 parameters).
        (m, n), (r, k) = dy.shape, lora_a.shape
        buffer, (db, da_out, ds) = zeroed_fp32((n, r), (r, k), (m, r), device=dy.device)
        lora_dys_dyb(dy, lora_b, s, scaling=scaling, deterministic=False, accumulators=(ds, db))
    da = lora_dsx(
        ds,
        x,
        out_dtype=lora_a.dtype,
        inv_keep=inv_keep,
        keep_threshold=threshold,
        seed=seed,
        has_dropout=has_dropout,
        out=da_out,
    )
    if need_dx:
        dx = lora_dyw_dsa(
            dy, weight, ds, lora_a, inv_keep=inv_keep, keep_threshold=threshold, seed=seed, has_dropout=has_dropout
        )
    else:
        dx = dy.new_empty(0)
    if not deterministic:
        da, db = parameter_grads(buffer, db, da, lora_a.dtype, lora_b.dtype)
    return dx, da, db


_forward_op = torch.library.custom_op(
    "lorafusion::fused_lora_forward",
    _forward_impl,
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor lora_a, Tensor lora_b, Tensor? bias, Tensor seed, "
    "float scaling, float dropout_p, bool? deterministic=None) -> (Tensor, Tensor)",
)


@_forward_op.register_fake
def _forward_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    seed: torch.Tensor,
    scaling: float,
    dropout_p: float,
    deterministic: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((x.shape[0], lora_a.shape[0]))


def _backward_op_impl(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_backward_impl` for the custom op, whose outputs may not share storage: dA is copied out.

    (Eager calls keep dA and dB as views of one buffer; the copy costs one tiny kernel under compile.)
    """
    dx, da, db = _backward_impl(*args)
    return dx, unaliased(da, db), db


_backward_op = torch.library.custom_op(
    "lorafusion::fused_lora_backward",
    _backward_op_impl,
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor weight, Tensor lora_a, Tensor lora_b, Tensor s, Tensor seed, "
    "float scaling, float dropout_p, bool need_dx, bool deterministic) -> (Tensor, Tensor, Tensor)",
)


@_backward_op.register_fake
def _backward_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    s: torch.Tensor,
    seed: torch.Tensor,
    scaling: float,
    dropout_p: float,
    need_dx: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = dy.new_empty((dy.shape[0], weight.shape[1])) if need_dx else dy.new_empty(0)
    return dx, torch.empty_like(lora_a), torch.empty_like(lora_b)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, lora_a, lora_b, bias, seed, scaling, dropout_p, deterministic = inputs
    ctx.save_for_backward(x, weight, lora_a, lora_b, output[1], seed)
    ctx.scaling = scaling
    ctx.dropout_p = dropout_p
    ctx.has_bias = bias is not None
    ctx.deterministic = deterministic_mode() if deterministic is None else bool(deterministic)


def _backward(ctx: Any, dy: torch.Tensor, *_unused: Any, opaque: bool = True) -> tuple[torch.Tensor | None, ...]:
    """Shared backward; ``opaque`` routes through the custom op (always, when AOTAutograd traces it)."""
    x, weight, lora_a, lora_b, s, seed = ctx.saved_tensors
    need_dx = bool(ctx.needs_input_grad[0])
    args = (dy, x, weight, lora_a, lora_b, s, seed, ctx.scaling, ctx.dropout_p, need_dx, ctx.deterministic)
    if opaque:
        dx, da, db = torch.ops.lorafusion.fused_lora_backward(*args)
    else:
        dx, da, db = _backward_impl(*args)
    needs_dbias = ctx.has_bias and ctx.needs_input_grad[4]
    dbias = dy.sum(dim=0, dtype=torch.promote_types(dy.dtype, torch.float32)).to(dy.dtype) if needs_dbias else None
    # A base weight left trainable gets its gradient too (one plain GEMM; frozen weights skip it).
    dweight = dy.t().mm(x).to(weight.dtype) if ctx.needs_input_grad[1] else None
    grads = ((dx if need_dx else None), dweight, da, db, dbias)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


class FusedLoRAFunction(torch.autograd.Function):
    """Autograd for ``y = x W^T + bias + scaling * x_hat A^T B^T`` (2-D ``x``); see the module docstring.

    Eager calls use this Function directly: a ``torch.library`` custom op costs a few hundred
    microseconds more per call in Python dispatch (a tiny CPU forward: 288 us as a custom op, 101 us as
    this Function, measured on the 2-core CI host),
    which would starve the GPU on small layers. Under ``torch.compile`` the same forward and
    backward run as the custom ops ``lorafusion::fused_lora_forward`` / ``fused_lora_backward``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        bias: torch.Tensor | None,
        seed: torch.Tensor,
        scaling: float,
        dropout_p: float,
        deterministic: bool | None = None,
    ) -> torch.Tensor:
        """``y [M, N]``; saves x, S and the seed (plus references to the parameters).

        ``deterministic`` picks the backward without atomics; None follows :func:`deterministic_mode`.
        """
        y, s = _forward_impl(x, weight, lora_a, lora_b, bias, seed, scaling, dropout_p)
        _setup_context(ctx, (x, weight, lora_a, lora_b, bias, seed, scaling, dropout_p, deterministic), (y, s))
        return y

    @staticmethod
    @first_order_only  # the backward is not itself differentiable: create_graph=True raises
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(dx, dW, dA, dB, dbias, None, ...)`` by the chain rule of the module docstring (dW: None when frozen)."""
        return _backward(ctx, dy, opaque=False)


# The custom op's backward runs at backward time where Dynamo hands the graph to a backend without
# AOTAutograd (backend="eager"), so the guard refuses create_graph=True there too. AOTAutograd
# backends (inductor, aot_eager) trace it ahead of time, without grad mode: torch itself then
# refuses the double backward (docs/kernels/index.md, "First-order gradients only").
_forward_op.register_autograd(first_order_only(_backward), setup_context=_setup_context)


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    dropout_p: float,
    scaling: object,
) -> None:
    for name, value in (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)):
        if not isinstance(value, torch.Tensor):
            several = " (several adapters: fused_multi_lora_linear)" if name.startswith("lora") else ""
            raise LoRAFusionKernelsError(f"{name} must be a tensor, got {type(value).__name__}{several}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise LoRAFusionKernelsError(f"bias must be a tensor or None, got {type(bias).__name__}")
    if x.dim() == 0:
        raise LoRAFusionKernelsError("x must be [..., K] (at least 1-D), got a 0-d tensor")
    check_activation_dtype(x)
    if weight.dtype != x.dtype:
        raise dtype_mismatch(x, weight)
    if weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2:
        raise LoRAFusionKernelsError("weight, lora_a and lora_b must be 2-D: [N, K], [r, K], [N, r]")
    n, k = weight.shape
    r = lora_a.shape[0]
    _check_in_features(x, weight, lora_a)
    if tuple(lora_b.shape) != (n, r):
        raise LoRAFusionKernelsError(f"lora_b must be [{n}, {r}] (out_features, rank), got {list(lora_b.shape)}")
    if not 1 <= r <= MAX_RANK:
        raise LoRAFusionKernelsError(f"LoRA rank must be in [1, {MAX_RANK}], got {r}")
    if k == 0:
        raise LoRAFusionKernelsError(f"in_features must be at least 1, got weight [{n}, {k}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise LoRAFusionKernelsError(f"bias must be [{n}], got {list(bias.shape)}")
    if bias is not None and not bias.dtype.is_floating_point:
        raise LoRAFusionKernelsError(f"bias must be floating point, got {bias.dtype}")
    if not lora_a.dtype.is_floating_point or not lora_b.dtype.is_floating_point:
        raise LoRAFusionKernelsError("lora_a and lora_b must be floating point")
    devices = {t.device for t in (x, weight, lora_a, lora_b) + ((bias,) if bias is not None else ())}
    if len(devices) != 1:
        raise LoRAFusionKernelsError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_finite(dropout_p, "dropout_p")
    if not 0.0 <= dropout_p < 1.0:
        raise LoRAFusionKernelsError(f"dropout_p must be in [0, 1), got {dropout_p}")
    check_finite(scaling, "scaling")


def _check_in_features(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor) -> None:
    """Refuse ``x``, ``weight`` and ``lora_a`` that disagree on ``K``, naming the one that differs.

    Raises:
        LoRAFusionKernelsError: Naming the odd tensor out and the three shapes.
    """
    n, k = weight.shape
    x_k, a_k = x.shape[-1], lora_a.shape[1]
    if x_k == k and a_k == k:
        return
    shapes = f"x [..., {x_k}], weight [{n}, {k}], lora_a {list(lora_a.shape)}"
    if x_k == a_k:
        fix = f"weight has {k} in_features where x and lora_a have {x_k}: weight must be [N, {x_k}] ([out, in])"
    elif x_k != k:
        fix = f"x has {x_k} features where weight has {k}: x must be [..., {k}]"
    else:
        fix = f"lora_a has {a_k} columns where x and weight have {k}: lora_a must be [r, {k}] (PEFT's lora_A.weight)"
    raise LoRAFusionKernelsError(f"in_features mismatch ({shapes}): {fix}")


def dtype_mismatch(x: torch.Tensor, weight: torch.Tensor) -> LoRAFusionKernelsError:
    """The error for a base weight whose dtype is not ``x``'s, saying how to make them agree."""
    return LoRAFusionKernelsError(
        f"weight dtype {weight.dtype} must match x dtype {x.dtype}: cast x (or the weight) to one dtype, "
        "or call the layer (FusedLoRALinear, a patched PEFT model) under torch.autocast, which casts both "
        "as nn.Linear does"
    )


def check_activation_dtype(x: torch.Tensor) -> None:
    """Refuse an input dtype the ops do not take (the same rule for FusedLoRA and FusedMultiLoRA).

    Raises:
        LoRAFusionKernelsError: Naming the dtype and the dtypes accepted.
    """
    if x.dtype not in ACTIVATION_DTYPES:
        raise LoRAFusionKernelsError(
            f"x must be float16, bfloat16, float32 or float64 (float64 runs the plain torch path), got {x.dtype}"
        )


def check_finite(value: object, name: str) -> None:
    """Refuse a scalar argument (a scaling, a dropout probability) that is not a finite number.

    Python and NumPy numbers and 0-d real tensors are numbers; callers pass ``float(value)`` on. A
    tensor that requires grad is refused (:func:`check_not_trainable`): it would get no gradient.

    Raises:
        LoRAFusionKernelsError: Naming the argument and the value (None, a string, NaN, inf, a bool,
            a tensor that requires grad).
    """
    if isinstance(value, torch.Tensor):
        check_not_trainable(value, name)
    if torch.compiler.is_compiling():
        return  # a float input may be symbolic there, and math.isfinite on it would break the graph
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LoRAFusionKernelsError(f"{name} must be a finite number, got {value!r}")


def check_not_trainable(value: torch.Tensor, name: str) -> None:
    """Refuse a scaling or dropout-probability tensor that requires grad: its value is read once, as a constant.

    Raises:
        LoRAFusionKernelsError: Naming the argument, and what to pass instead.
    """
    if value.requires_grad:
        raise LoRAFusionKernelsError(
            f"{name} is a runtime constant; it gets no gradient, but the tensor given requires grad: "
            f"pass a number or {name}.detach() (a learnable scale belongs in lora_b, which does get a gradient)"
        )


def check_deterministic(value: object) -> None:
    """Refuse a ``deterministic`` argument other than None, True or False (a string would read as True).

    Raises:
        LoRAFusionKernelsError: Naming the value.
    """
    if value is not None and not isinstance(value, bool):
        raise LoRAFusionKernelsError(f"deterministic must be None, True or False, got {value!r}")


_NO_SEED: dict[torch.device, torch.Tensor] = {}


def _seed_for(x: torch.Tensor, dropout_p: float, seed: int | None) -> torch.Tensor:
    if dropout_p == 0.0:
        # Never read by the kernels (no RNG at p = 0); one cached tensor per device, no allocation per call.
        if x.device not in _NO_SEED:
            _NO_SEED[x.device] = torch.zeros(1, dtype=torch.int64, device=x.device)
        return _NO_SEED[x.device]
    if seed is None:
        return draw_seed(x.device)
    return seed_tensor(seed, x.device)


def fused_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scaling: float,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
    seed: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``y = x W^T + bias + scaling * dropout_p(x) A^T B^T``, fused; gradients for x, A, B and bias.

    Args:
        x: ``[..., K]`` input, float16, bfloat16 or float32 (any leading dims); float64 runs the
            plain torch path in float64 on every device (a reference-grade run, for debugging).
        weight: ``[N, K]`` frozen base weight, ``x.dtype``.
        lora_a: ``[r, K]`` LoRA A, ``1 <= r <= 128``, any float dtype (its gradient comes back in it).
        lora_b: ``[N, r]`` LoRA B.
        scaling: ``lora_alpha / r`` (PEFT) or ``lora_alpha / sqrt(r)`` (rsLoRA); a runtime fp32 value.
        dropout_p: Dropout probability on the LoRA branch only, in ``[0, 1)``; 0 draws no random numbers.
        bias: ``[N]`` base bias or None; gets a gradient if it requires one.
        seed: Dropout seed, an integer in ``[0, 2**63)`` (checked whatever ``dropout_p``); None
            draws one from torch's generator of ``x``'s device (so ``torch.manual_seed`` reproduces
            it). The same seed gives the same mask (see :func:`lorafusion_kernels.dropout.dropout_keep_mask`).
        deterministic: Sum ``dB`` (and a split ``dS``) without atomics: run-to-run identical
            gradients, one more read of ``dy``. None follows :func:`deterministic_mode`
            (``torch.use_deterministic_algorithms(True)`` or ``LORAFUSION_DETERMINISTIC=1``) when the
            forward runs; True or False overrides it for this call.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        LoRAFusionKernelsError: on mismatched shapes, dtypes or devices, a rank outside
            ``[1, 128]``, ``dropout_p`` outside ``[0, 1)`` or a bad seed.

    Example:
        >>> y = fused_lora_linear(x, layer.weight, lora_a, lora_b, scaling=2.0, dropout_p=0.1)
    """
    _check_inputs(x, weight, lora_a, lora_b, bias, dropout_p, scaling)
    check_deterministic(deterministic)
    if seed is not None:
        seed = check_seed(seed)  # at any p (a refused seed fails now, not once dropout is on); read once
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    seed_t = _seed_for(x, float(dropout_p), seed)
    if torch.compiler.is_compiling():
        y, _ = torch.ops.lorafusion.fused_lora_forward(
            x2, weight, lora_a, lora_b, bias, seed_t, float(scaling), float(dropout_p), deterministic
        )
    else:
        y = FusedLoRAFunction.apply(  # type: ignore[no-untyped-call]
            x2, weight, lora_a, lora_b, bias, seed_t, float(scaling), float(dropout_p), deterministic
        )
    return cast(torch.Tensor, y).reshape(*lead, weight.shape[0])


def _positive_int(value: object, name: str) -> int:
    """``value`` as an int ``>= 1`` (a NumPy integer too; never a float, a string or a bool).

    Raises:
        LoRAFusionKernelsError: Naming the argument and the value.
    """
    number = integer_or_none(value)
    if number is None:
        raise LoRAFusionKernelsError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if number < 1:
        raise LoRAFusionKernelsError(f"{name} must be at least 1, got {number}")
    return number


def _check_layer_dtype(dtype: object) -> None:
    """Refuse a layer ``dtype`` that is not a floating-point ``torch.dtype`` (None: torch's default).

    Raises:
        LoRAFusionKernelsError: Naming the dtype.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise LoRAFusionKernelsError(
            f"dtype must be a floating-point torch.dtype (torch.bfloat16, torch.float16, torch.float32), got {dtype!r}"
        )


class FusedLoRALinear(nn.Module):
    """A frozen linear layer with a trainable LoRA adapter, computed by :func:`fused_lora_linear`.

    ``y = x W^T + bias + scaling * dropout(x) A^T B^T`` with ``scaling = lora_alpha / r`` (or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``). A is initialised like PEFT's default
    (Kaiming-uniform) and B with zeros, so a fresh layer equals the frozen one.

    Args:
        in_features: ``K``, at least 1.
        out_features: ``N``, at least 1.
        r: LoRA rank, an integer in ``[1, 128]``.
        lora_alpha: LoRA alpha (default ``r``: scaling 1).
        dropout_p: Dropout on the LoRA branch (applied in training mode only).
        bias: Whether the frozen base layer has a bias.
        use_rslora: Scale by ``lora_alpha / sqrt(r)``.
        device: Where to allocate.
        dtype: Dtype of the base weight, a floating-point one (the adapter is created in the same dtype).

    Raises:
        LoRAFusionKernelsError: A width or rank that is not a positive integer, a rank above 128,
            a dtype that is not floating point, or a bad ``lora_alpha`` or ``dropout_p``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int,
        *,
        lora_alpha: float | None = None,
        dropout_p: float = 0.0,
        bias: bool = True,
        use_rslora: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        in_features = _positive_int(in_features, "in_features")
        out_features = _positive_int(out_features, "out_features")
        r = _positive_int(r, "r")
        if r > MAX_RANK:
            raise LoRAFusionKernelsError(f"LoRA rank must be in [1, {MAX_RANK}], got {r}")
        _check_layer_dtype(dtype)
        check_finite(dropout_p, "dropout_p")
        keep_threshold(dropout_p)  # refused here, not at the first training-mode forward
        if lora_alpha is not None:
            check_finite(lora_alpha, "lora_alpha")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.r = r
        alpha = float(r if lora_alpha is None else lora_alpha)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.dropout_p = float(dropout_p)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False) if bias else None
        self.lora_a = nn.Parameter(torch.empty(r, in_features, **factory))
        self.lora_b = nn.Parameter(torch.empty(out_features, r, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Base layer like ``nn.Linear``, A Kaiming-uniform, B zero (the adapter starts as a no-op)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        r: int,
        *,
        lora_alpha: float | None = None,
        dropout_p: float = 0.0,
        use_rslora: bool = False,
    ) -> FusedLoRALinear:
        """Wrap an existing ``nn.Linear`` (its weight and bias are shared, frozen) with a fresh adapter.

        Raises:
            LoRAFusionKernelsError: ``linear`` is not an ``nn.Linear``, or a bad rank or hyperparameter.
        """
        if not isinstance(linear, nn.Linear):
            raise LoRAFusionKernelsError(
                f"from_linear wraps an nn.Linear, got {type(linear).__name__}: for other layers build "
                "FusedLoRALinear(in_features, out_features, r) and copy the weight ([out, in]) into it"
            )
        layer = cls(
            linear.in_features,
            linear.out_features,
            r,
            lora_alpha=lora_alpha,
            dropout_p=dropout_p,
            bias=linear.bias is not None,
            use_rslora=use_rslora,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        layer.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features] -> [..., out_features]``; dropout only in training mode.

        Inside ``torch.autocast`` it computes in autocast's dtype as ``nn.Linear`` does (see
        :mod:`lorafusion_kernels.autocast`).
        """
        return call_as_linear(
            fused_lora_linear,
            x,
            self.weight,
            self.lora_a,
            self.lora_b,
            scaling=self.scaling,
            dropout_p=self.dropout_p if self.training else 0.0,
            bias=self.bias,
        )

    def extra_repr(self) -> str:
        """Shapes, rank, scaling, dropout and bias, for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"scaling={self.scaling:g}, dropout_p={self.dropout_p:g}, bias={self.bias is not None}"
        )
