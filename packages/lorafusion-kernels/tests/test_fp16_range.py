"""fp16 keeps PEFT's range: ``scaling`` is applied in fp32 inside the kernels, never stored in ``S``.

The inputs make ``|x_hat A^T|`` a few thousand and ``scaling`` 48 or 64, so ``scaling * x_hat A^T``
is past fp16's largest value (65504) while ``x_hat A^T`` and the output are not: PEFT, which scales
after ``B``, stays finite there, and so must every path of the fused ops (they once stored
``scaling * x_hat A^T`` in fp16 and gave inf). Adapters are fp32 (PEFT's autocast_adapter_dtype),
so that ``dB`` itself fits its dtype. One adapter has ``scaling = 0``: its rows are the frozen
layer's and its gradients exactly zero.
"""

from __future__ import annotations

import math

import pytest
import torch

import lorafusion_kernels.lora as lora_module
import lorafusion_kernels.multi_lora as multi_lora_module
import lorafusion_kernels.multi_lora_siblings as siblings_module
from lorafusion_kernels import fused_lora_linear, fused_multi_lora_linear, fused_multi_lora_siblings
from lorafusion_kernels.reference import lora_linear_reference_seeded, multi_lora_linear_reference
from lorafusion_kernels.testing import rel_rms

pytestmark = pytest.mark.interpret

FP16_MAX = torch.finfo(torch.float16).max
SEED = 5
LENGTHS, ADAPTERS = (7, 1, 19, 11, 5), (0, 2, 1, 0, 2)
RANKS, SCALING, DROPOUT_P = (8, 16, 4), (64.0, 0.0, 48.0), (0.1, 0.0, 0.25)
K = 37
PATHS = ["kernels", "deterministic", "torch"]


def _wide(*shape: int, scale: float, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()


def _inputs(t: int, n: int, ranks: tuple[int, ...], members: int = 1, seed: int = 0):
    """fp16 ``x [t, K]`` (std 200) and ``W [n, K]``; fp32 ``A`` (std ``10 / sqrt(K)``), ``B`` (``1e-3 / sqrt(r)``).

    ``members`` copies of each adapter's ``A`` and ``B`` (a sibling call's members, ``n / members`` wide).
    """
    gen = torch.Generator().manual_seed(seed)
    x = _wide(t, K, scale=200.0, gen=gen, dtype=torch.float16)
    weight = _wide(n, K, scale=1 / math.sqrt(K), gen=gen, dtype=torch.float16).requires_grad_(False)
    lora_a = [[_wide(r, K, scale=10 / math.sqrt(K), gen=gen) for _ in range(members)] for r in ranks]
    width = n // members
    lora_b = [[_wide(width, r, scale=1e-3 / math.sqrt(r), gen=gen) for _ in range(members)] for r in ranks]
    dy = torch.randn(t, n, generator=gen).half()
    return x, weight, lora_a, lora_b, dy


def _assert_matches(outputs, references, leaves) -> None:
    """Outputs and gradients within fp16 rounding of the float64 ones; exact zeros where those are zero."""
    for name, got, want in zip(("y", *(f"d{i}" for i in range(len(leaves)))), outputs, references, strict=True):
        assert torch.isfinite(got).all(), name
        if not want.any():
            assert not got.any(), name
            continue
        assert rel_rms(got, want) < 5e-3, (name, rel_rms(got, want))


def _run(fn, leaves, dy):
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype))]


def _as_float64(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _use_path(monkeypatch: pytest.MonkeyPatch, path: str, *modules) -> bool:
    """Point ``modules`` at the torch path for ``"torch"``; returns the call's ``deterministic`` flag."""
    if path == "torch":
        for module in modules:
            monkeypatch.setattr(module, "runs_triton", lambda t: False)
    return path == "deterministic"


def test_premise_scaled_activation_overflows_fp16() -> None:
    x, _, lora_a, _, _ = _inputs(sum(LENGTHS), 45, RANKS)
    s = x.detach().double() @ lora_a[0][0].detach().double().T
    assert s.abs().max() < FP16_MAX / 4 < FP16_MAX < SCALING[0] * s.abs().max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("p", [0.0, 0.25], ids=["p0", "p0.25"])
def test_fused_lora(monkeypatch: pytest.MonkeyPatch, path: str, p: float) -> None:
    deterministic = _use_path(monkeypatch, path, lora_module)
    x, weight, lora_a, lora_b, dy = _inputs(37, 45, (8,))
    leaves = [x, lora_a[0][0], lora_b[0][0]]

    def fused(x, a, b):
        return fused_lora_linear(x, weight, a, b, scaling=64.0, dropout_p=p, seed=SEED, deterministic=deterministic)

    def reference(x, a, b):
        return lora_linear_reference_seeded(x, weight.double(), a, b, scaling=64.0, dropout_p=p, seed=SEED)

    leaves64 = _as_float64(leaves)
    _assert_matches(_run(fused, leaves, dy), _run(reference, leaves64, dy), leaves)


# Row tiles holding several segments (the GEMM's per-row scaling), and tiles of one segment each
# (the interpreter's 32-row tiles: one scalar scaling per tile, ONE_SEGMENT).
LAYOUTS = {"straddling": (LENGTHS, ADAPTERS), "tile-aligned": ((32, 32, 64), (0, 1, 2))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("path", PATHS)
def test_fused_multi_lora(monkeypatch: pytest.MonkeyPatch, path: str, layout: str) -> None:
    deterministic = _use_path(monkeypatch, path, multi_lora_module)
    lengths, adapters = LAYOUTS[layout]
    x, weight, lora_a, lora_b, dy = _inputs(sum(lengths), 45, RANKS)
    segments = {"segment_lengths": lengths, "segment_adapters": adapters, "scaling": SCALING, "dropout_p": DROPOUT_P}
    leaves = [x, *(a[0] for a in lora_a), *(b[0] for b in lora_b)]
    n = len(RANKS)

    def fused(x, *ab):
        return fused_multi_lora_linear(
            x, weight, list(ab[:n]), list(ab[n:]), **segments, seed=SEED, deterministic=deterministic
        )

    def reference(x, *ab):
        return multi_lora_linear_reference(x, weight.double(), ab[:n], ab[n:], **segments, seed=SEED)

    _assert_matches(_run(fused, leaves, dy), _run(reference, _as_float64(leaves), dy), leaves)


@pytest.mark.parametrize("path", PATHS)
def test_fused_multi_lora_siblings(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    deterministic = _use_path(monkeypatch, path, siblings_module, multi_lora_module)
    members = 3
    x, weight, lora_a, lora_b, dy = _inputs(sum(LENGTHS), 45, RANKS, members=members)
    segments = {"segment_lengths": LENGTHS, "segment_adapters": ADAPTERS, "scaling": SCALING, "dropout_p": DROPOUT_P}
    widths = [b.shape[0] for b in lora_b[0]]
    leaves = [x, *(t for per_adapter in (*lora_a, *lora_b) for t in per_adapter)]
    n = len(RANKS)

    def unflatten(ab):
        grouped = [list(ab[i * members : (i + 1) * members]) for i in range(2 * n)]
        return grouped[:n], grouped[n:]

    def fused(x, *ab):
        a, b = unflatten(ab)
        ys = fused_multi_lora_siblings(
            x, weight, a, b, out_features=widths, **segments, seed=SEED, deterministic=deterministic
        )
        return torch.cat(ys, dim=-1)

    def reference(x, *ab):
        a, b = unflatten(ab)
        weights = torch.split(weight.double(), widths)
        return torch.cat(
            [
                multi_lora_linear_reference(
                    x, weights[g], [a_[g] for a_ in a], [b_[g] for b_ in b], **segments, seed=SEED
                )
                for g in range(members)
            ],
            dim=-1,
        )

    _assert_matches(_run(fused, leaves, dy), _run(reference, _as_float64(leaves), dy), leaves)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_multi_lora_db_with_a_scaling_below_one(deterministic: bool) -> None:
    """``scaling = 1/16``: ``dy^T S`` is past fp16's range, ``scaling * dy^T S`` is not (every dB path sums in fp32)."""
    gen = torch.Generator().manual_seed(3)
    t, n, r = 128, 32, 8
    x = (200 * torch.randn(t, K, generator=gen)).half().requires_grad_()
    weight = (torch.randn(n, K, generator=gen) / math.sqrt(K)).half()
    lora_a = [(10 * torch.randn(r, K, generator=gen) / math.sqrt(K)).requires_grad_() for _ in range(2)]
    lora_b = [(1e-3 * torch.randn(n, r, generator=gen)).requires_grad_() for _ in range(2)]
    s = x.detach().double() @ lora_a[0].detach().double().T
    dy = (4 * torch.sign(s[:, :1])).expand(t, n).half()  # every row pushes dy^T S the same way
    y = fused_multi_lora_linear(
        x, weight, lora_a, lora_b, segment_lengths=[64, 64], segment_adapters=[0, 1], scaling=1 / 16,
        deterministic=deterministic,
    )  # fmt: skip
    (db,) = torch.autograd.grad(y, [lora_b[0]], dy)
    unscaled = dy[:64].double().T @ s[:64]
    assert unscaled.abs().max() > FP16_MAX > unscaled.abs().max() / 16  # the premise
    assert rel_rms(db, unscaled / 16) < 1e-3
