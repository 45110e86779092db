"""Every kernel launched alone on random inputs of one layer shape: what ``lorafusion-tune`` times.

For ``x [m, k]``, ``W [n, k]`` and rank ``r``, :func:`kernel_launches` returns, per kernel name, a
factory ``config -> zero-argument launch`` (``None``: the config the lookup gives). The FusedLoRA
kernels get one adapter; the FusedMultiLoRA kernels get a packed microbatch of ``adapters``
adapters of rank ``r`` whose segments split the ``m`` tokens evenly. The values are random (times do
not depend on them); the dropout mask is drawn as in training when ``p > 0``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lorafusion_kernels.tuning.config import KernelConfig, ShapeKey, dtype_name

SINGLE_ADAPTER_KERNELS = ("xa", "xw_sb", "dys_dyb", "dsx", "dyw_dsa")
"""FusedLoRA's kernels, in the order a forward and backward run them."""
MULTI_ADAPTER_KERNELS = ("multi_xa", "multi_xw_sb", "multi_dys_dyb", "multi_dsx", "multi_dsx_dx", "multi_dyw_dsa")
"""FusedMultiLoRA's kernels, likewise (``multi_dsx_dx``: the ``dA`` pass that also writes dx's LoRA term,
which the op runs instead of ``multi_dsx`` where ``k <= n``); each falls back to a FusedLoRA kernel
(:func:`~lorafusion_kernels.tuning.config.fallback_kernel`)."""

Launch = Callable[[KernelConfig | None], Callable[[], object]]
"""``config -> zero-argument launch`` of one kernel; ``None`` launches with the looked-up config."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerProblem:
    """One layer shape to time the kernels on."""

    m: int
    """Tokens (rows of x)."""
    n: int
    """Output features (rows of W)."""
    k: int
    """Input features."""
    r: int
    """LoRA rank (of every adapter)."""
    dtype: torch.dtype
    """Activation and weight dtype."""
    p: float
    """Dropout probability."""
    adapters: int
    """Adapters sharing the microbatch of the FusedMultiLoRA kernels."""
    device: str
    """``"cuda"``, or ``"cpu"`` under ``TRITON_INTERPRET=1``."""


def config_key(kernel: str, problem: LayerProblem) -> ShapeKey:
    """The key under which the op looks up ``kernel``'s config when it runs ``problem``'s layer (:func:`shape_key`)."""
    return shape_key(kernel, m=problem.m, n=problem.n, k=problem.k, r=problem.r, dtype=dtype_name(problem.dtype))


def shape_key(kernel: str, *, m: int, n: int, k: int, r: int, dtype: str) -> ShapeKey:
    """The key of ``kernel``'s config on a layer ``W [n, k]`` at ``m`` tokens and rank ``r``.

    Entries are keyed by the problem each kernel sees, which is not always the layer ``W [n, k]``:

    - the shrink (``xa``) and the ``dA`` pass (``dsx``, ``multi_dsx_dx``) read ``x [m, k]`` against
      a rank-``r`` operand: ``(m, r, k)``;
    - the ``dS``/``dB`` pass reads ``dy [m, n]`` against ``B [n, r]``: ``(m, n, n)``;
    - the two GEMMs see the layer: ``(m, n, k)``.

    Layers that share a key share its entry, so the tuner times each key once.
    """
    keyed_n, keyed_k = _keyed_nk(kernel, n, k, r)
    return ShapeKey(m=m, n=keyed_n, k=keyed_k, r=r, dtype=dtype)


def _keyed_nk(kernel: str, n: int, k: int, r: int) -> tuple[int, int]:
    """The ``(n, k)`` of :func:`config_key` for a layer ``W [n, k]`` and rank ``r``."""
    base = kernel.removeprefix("multi_")
    if base in ("xa", "dsx", "dsx_dx"):  # x [m, k] against a rank-r operand
        return r, k
    if base == "dys_dyb":  # dy [m, n] against B [n, r]
        return n, n
    return n, k


def can_be_looked_up(kernel: str, key: ShapeKey) -> bool:
    """Whether some layer's :func:`config_key` of ``kernel`` can be ``key``: the key rule leaves it as it is.

    Entries the tuner keyed otherwise before 2026-11-25 (e.g. a shrink entry with ``n != r``) never can.
    """
    return _keyed_nk(kernel, key.n, key.k, key.r) == (key.n, key.k)


def even_segments(m: int, adapters: int) -> list[int]:
    """``m`` tokens in ``adapters`` consecutive segments whose lengths differ by at most one."""
    return [m // adapters + (i < m % adapters) for i in range(adapters)]


def kernel_launches(problem: LayerProblem, kernels: Iterable[str]) -> dict[str, Launch]:
    """Launch factories of ``kernels`` on ``problem``'s inputs (built only for the kernel families named).

    A kernel the op never runs on this layer (``multi_dsx_dx`` where ``k > n``) is left out.

    Raises:
        KeyError: for a name in neither :data:`SINGLE_ADAPTER_KERNELS` nor :data:`MULTI_ADAPTER_KERNELS`.
    """
    kernels = list(kernels)
    unknown = set(kernels) - {*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS}
    if unknown:
        raise KeyError(f"unknown kernels {sorted(unknown)}")
    launches: dict[str, Launch] = {}
    if set(kernels) & set(SINGLE_ADAPTER_KERNELS):
        launches.update(single_adapter_launches(problem))
    if set(kernels) & set(MULTI_ADAPTER_KERNELS):
        launches.update(multi_adapter_launches(problem))
    return {name: launches[name] for name in kernels if name in launches}


def _random(problem: LayerProblem, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.randn(*shape, device=problem.device, dtype=dtype or problem.dtype) * scale


def single_adapter_launches(problem: LayerProblem) -> dict[str, Launch]:
    """The FusedLoRA kernels ``xa``, ``xw_sb``, ``dys_dyb``, ``dsx``, ``dyw_dsa``."""
    from lorafusion_kernels._kernels._common import zeroed_fp32
    from lorafusion_kernels._kernels.lora_dsx import lora_dsx
    from lorafusion_kernels._kernels.lora_dys_dyb import lora_dys_dyb
    from lorafusion_kernels._kernels.lora_dyw_dsa import lora_dyw_dsa
    from lorafusion_kernels._kernels.lora_xa import lora_xa
    from lorafusion_kernels._kernels.lora_xw_sb import lora_xw_sb
    from lorafusion_kernels.dropout import keep_threshold, seed_tensor

    m, n, k, r, p = problem.m, problem.n, problem.k, problem.r, problem.p
    x = _random(problem, m, k)
    w = _random(problem, n, k, scale=1 / math.sqrt(k))
    a = _random(problem, r, k, scale=1 / math.sqrt(k))
    b = _random(problem, n, r, scale=1 / math.sqrt(r))
    s = _random(problem, m, r)
    dy = _random(problem, m, n)
    dropout: dict[str, Any] = {
        "keep_threshold": keep_threshold(p),
        "seed": seed_tensor(1234, problem.device),
        "has_dropout": p > 0,
    }
    inv_keep = 1.0 / (1.0 - p)
    # As the op's backward runs them: fp32 accumulators, dA by atomics.
    _, (db32, da32, ds32) = zeroed_fp32((n, r), (r, k), (m, r), device=x.device)
    return {
        "xa": lambda c: lambda: lora_xa(x, a, scale=2.0, config=c, **dropout),
        "xw_sb": lambda c: lambda: lora_xw_sb(x, w, s, b, None, scaling=2.0, config=c),
        "dys_dyb": lambda c: lambda: lora_dys_dyb(dy, b, s, scaling=2.0, accumulators=(ds32, db32), config=c),
        "dsx": lambda c: (
            lambda: lora_dsx(ds32, x, out_dtype=problem.dtype, inv_keep=inv_keep, out=da32, config=c, **dropout)
        ),
        "dyw_dsa": lambda c: lambda: lora_dyw_dsa(dy, w, ds32, a, inv_keep=inv_keep, config=c, **dropout),
    }


def multi_adapter_launches(problem: LayerProblem) -> dict[str, Launch]:
    """The FusedMultiLoRA kernels, named as in the config files (``multi_xa``, ``multi_xw_sb``, ...).

    The ``dA`` pass as the op's backward runs it when x needs a gradient: ``multi_dsx`` alone, and
    ``multi_dsx_dx`` (writing dx's LoRA term too) only where ``k <= n``, the layers it runs on.
    """
    from lorafusion_kernels._kernels import multi_lora_bwd, multi_lora_fwd
    from lorafusion_kernels.dropout import seed_tensor
    from lorafusion_kernels.metadata import MultiLoRABatch
    from lorafusion_kernels.multi_lora_core import dx_from_da_pass
    from lorafusion_kernels.multi_lora_params import AdapterParams, device_params

    m, n, k, r, count = problem.m, problem.n, problem.k, problem.r, problem.adapters
    params = AdapterParams(ranks=(r,) * count, scaling=(2.0,) * count, dropout_p=(problem.p,) * count)
    tables = device_params(params, torch.device(problem.device))
    batch = MultiLoRABatch.from_segments(even_segments(m, count), list(range(count)), device=problem.device)
    x = _random(problem, m, k)
    w = _random(problem, n, k, scale=1 / math.sqrt(k))
    a_cat = _random(problem, r * count, k, scale=1 / math.sqrt(k))
    b_cat = _random(problem, n, r * count, scale=1 / math.sqrt(r))
    s = _random(problem, m, params.block_r)
    ds = _random(problem, m, params.block_r, dtype=torch.float32)
    dy = _random(problem, m, n)
    dropout: dict[str, Any] = {
        "max_rank": r,
        "ranks": tables.ranks,
        "thresholds": tables.thresholds,
        "seed": seed_tensor(1234, problem.device),
        "has_dropout": params.has_dropout,
    }
    routing: dict[str, Any] = {"ranks": tables.ranks, "max_rank": r}

    def da_launch(lora_dx: tuple[torch.Tensor, torch.Tensor] | None) -> Launch:
        return lambda c: (
            lambda: multi_lora_bwd.multi_lora_dsx(
                ds, x, batch, r_tot=r * count, inv_keep=tables.inv_keep, lora_dx=lora_dx, config=c, **dropout
            )
        )

    launches: dict[str, Launch] = {
        multi_lora_fwd.SHRINK_KERNEL: lambda c: (
            lambda: multi_lora_fwd.multi_lora_shrink(
                x, a_cat, batch, block_r=params.block_r, inv_keep=tables.inv_keep, config=c, **dropout
            )
        ),
        multi_lora_fwd.LINEAR_KERNEL: lambda c: (
            lambda: multi_lora_fwd.multi_lora_linear(
                x, w, None, s, b_cat, batch, scaling=tables.scaling, config=c, **routing
            )
        ),
        multi_lora_bwd.DY_KERNEL: lambda c: (
            lambda: multi_lora_bwd.multi_lora_dys_dyb(
                dy, b_cat, s, batch, scaling=tables.scaling, ranks_host=params.ranks, config=c, **routing
            )
        ),
        multi_lora_bwd.DA_KERNEL: da_launch(None),
        multi_lora_bwd.DX_KERNEL: lambda c: (
            lambda: multi_lora_bwd.multi_lora_dyw_dsa(
                dy, w, ds, a_cat, batch, inv_keep=tables.inv_keep, config=c, **dropout
            )
        ),
    }
    if dx_from_da_pass(n, k):
        launches[multi_lora_bwd.DA_DX_KERNEL] = da_launch((a_cat, torch.empty_like(x)))
    return launches
