"""Sibling calls (q/k/v-like members sharing one input) against the members' float64 references.

Member ``g`` of a sibling call must equal :func:`multi_lora_linear_reference` on ``W_g`` with the
adapters' ``A_{a,g}``/``B_{a,g}`` and the same seed (the mask depends on the seed, the token's row
and the input column only, so all members see the same mask). The members' widths are not multiples
of the interpreter's 32-column tiles, so column tiles straddle members.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorafusion_kernels import fused_multi_lora_linear, fused_multi_lora_siblings
from lorafusion_kernels._kernels.multi_lora_bwd import member_alignment
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.reference import multi_lora_linear_reference
from lorafusion_kernels.testing import assert_close_to_reference
from lorafusion_kernels.tuning.config import KernelConfig, override_configs

INTERPRET = pytest.mark.interpret
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
MEMBERS = (29, 7, 13)


@dataclasses.dataclass(frozen=True)
class Case:
    """One multi-adapter microbatch: segments, per-adapter ranks (in every member), scaling and p."""

    lengths: tuple[int, ...]
    adapters: tuple[int, ...]
    ranks: tuple[int, ...]
    scaling: tuple[float, ...]
    dropout_p: tuple[float, ...]
    k: int = 37
    bias: bool = False

    @property
    def t(self) -> int:
        return sum(self.lengths)


# Odd lengths, a segment of length 1, adapter 0 owns two segments, adapter 3 none, an empty segment,
# mixed ranks (3 x 32 stacks to 96), mixed p (0 included).
MIXED = Case(
    lengths=(7, 1, 19, 0, 11, 5),
    adapters=(0, 2, 1, 3, 0, 2),
    ranks=(8, 16, 32, 4),
    scaling=(2.0, 1.0 / 3.0, 0.7, 1.5),
    dropout_p=(0.1, 0.0, 0.3, 0.2),
    bias=True,
)
# One rank for every adapter with one (a constant row stride in the kernels); adapter 2 has rank 0
# ("no adapter": the frozen layer only) and tokens.
UNIFORM = Case(
    lengths=(9, 20, 14), adapters=(0, 2, 1), ranks=(16, 16, 0), scaling=(2.0, 0.5, 1.0), dropout_p=(0.1, 0.0, 0.2)
)
NO_DROPOUT = Case(lengths=(3, 30, 10), adapters=(1, 0, 1), ranks=(16, 8), scaling=(0.5, 2.0), dropout_p=(0.0, 0.0))


@dataclasses.dataclass
class Siblings:
    """A sibling call's inputs: shared ``x``, stacked ``W``/bias, per adapter per member ``A``/``B``."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: list[list[torch.Tensor]]
    lora_b: list[list[torch.Tensor]]

    @staticmethod
    def make(case: Case, members: tuple[int, ...], dtype: torch.dtype, *, seed: int = 0) -> Siblings:
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_(grad)

        n = sum(members)
        return Siblings(
            x=rand(case.t, case.k),
            weight=rand(n, case.k, scale=case.k**-0.5, grad=False),
            bias=rand(n, scale=0.1) if case.bias else None,
            lora_a=[[rand(r, case.k, scale=case.k**-0.5) for _ in members] for r in case.ranks],
            lora_b=[[rand(m, r, scale=max(r, 1) ** -0.5) for m in members] for r in case.ranks],
        )

    def to(self, dtype: torch.dtype, device: str | None = None) -> Siblings:
        def conv(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device or t.device).to(dtype).requires_grad_(t.requires_grad)

        return Siblings(
            conv(self.x),
            conv(self.weight),
            conv(self.bias) if self.bias is not None else None,
            [[conv(a) for a in per] for per in self.lora_a],
            [[conv(b) for b in per] for per in self.lora_b],
        )

    def grads(self) -> dict[str, torch.Tensor]:
        out = {"dx": self.x.grad}
        if self.bias is not None:
            out["dbias"] = self.bias.grad
        for i, (per_a, per_b) in enumerate(zip(self.lora_a, self.lora_b, strict=True)):
            for g, (a, b) in enumerate(zip(per_a, per_b, strict=True)):
                out[f"dA[{i}][{g}]"] = a.grad if a.grad is not None else torch.zeros_like(a)
                out[f"dB[{i}][{g}]"] = b.grad if b.grad is not None else torch.zeros_like(b)
        return {k: v for k, v in out.items() if v is not None}


def run_siblings(case: Case, members: tuple[int, ...], s: Siblings, dys: list[torch.Tensor], seed: int, **kw: object):
    ys = fused_multi_lora_siblings(
        s.x, s.weight, s.lora_a, s.lora_b, out_features=members, segment_lengths=case.lengths,
        segment_adapters=case.adapters, scaling=case.scaling, dropout_p=case.dropout_p, bias=s.bias, seed=seed, **kw,
    )  # fmt: skip
    torch.autograd.backward(list(ys), [dy.to(s.x.dtype) for dy in dys])
    return [y.detach() for y in ys]


def run_reference(case: Case, members: tuple[int, ...], s: Siblings, dys: list[torch.Tensor], seed: int):
    """Each member on its own rows of W (and bias), all on the same x leaf: dx sums over members."""
    ys, start = [], 0
    for g, n in enumerate(members):
        rows = slice(start, start + n)
        start += n
        y = multi_lora_linear_reference(
            s.x, s.weight[rows], [per[g] for per in s.lora_a], [per[g] for per in s.lora_b],
            segment_lengths=case.lengths, segment_adapters=case.adapters, scaling=case.scaling,
            dropout_p=case.dropout_p, bias=s.bias[rows] if s.bias is not None else None, seed=seed,
        )  # fmt: skip
        ys.append(y)
    torch.autograd.backward(ys, [dy.to(s.x.dtype) for dy in dys])
    return [y.detach() for y in ys]


def check(
    case: Case,
    dtype: torch.dtype,
    members: tuple[int, ...] = MEMBERS,
    seed: int = 4321,
    device: str = "cpu",
    **kw: object,
) -> None:
    inputs = Siblings.make(case, members, torch.float32).to(dtype, device)
    ref_in, eager_in = inputs.to(torch.float64), inputs.to(dtype)
    gen = torch.Generator().manual_seed(3)
    dys = [torch.randn(case.t, n, generator=gen).to(device) for n in members]
    ys = run_siblings(case, members, inputs, dys, seed, **kw)
    ys_ref = run_reference(case, members, ref_in, dys, seed)
    ys_eager = run_reference(case, members, eager_in, dys, seed)
    for g, (y, y_ref, y_eager) in enumerate(zip(ys, ys_ref, ys_eager, strict=True)):
        assert y.shape == (case.t, members[g])
        assert_close_to_reference(f"y[{g}]", y, y_ref, y_eager)
    ref_grads, eager_grads = ref_in.grads(), eager_in.grads()
    for name, grad in inputs.grads().items():
        assert_close_to_reference(name, grad, ref_grads[name], eager_grads[name], factor=3.0)


SIB_CASES = [
    pytest.param(MIXED, id="mixed-r8.16.32.4"),
    pytest.param(NO_DROPOUT, id="p0-r16.8"),
    pytest.param(UNIFORM, id="uniform-r16.16.0"),
]


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SIB_CASES)
def test_siblings_match_members_references(case: Case, dtype: torch.dtype) -> None:
    check(case, dtype)


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
def test_siblings_tma_and_split_reductions() -> None:
    """The sm_90 GEMM variants, and a dy pass split over N (column blocks of 16 cross the members)."""
    tma = KernelConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1, tma=True)
    split = KernelConfig(block_m=16, block_n=16, block_k=16, split=2, num_warps=4, num_stages=1)
    with override_configs({"multi_xw_sb": tma, "multi_dyw_dsa": tma, "multi_dys_dyb": split}):
        check(dataclasses.replace(MIXED, k=40), torch.float32, members=(24, 8, 16))


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize(
    ("members", "apart"),
    [((32, 16, 16), True), ((48, 48), True), ((16, 16, 16, 16), True), ((16,) * 5, False), ((32, 24), False)],
    ids=["qkv-like", "gate-up-like", "four", "five-views", "unaligned-views"],
)
@pytest.mark.parametrize("dx_tma", [True, False], ids=["dx-tma", "dx-pointer"])
def test_tma_linear_writes_members_apart(members: tuple[int, ...], apart: bool, dx_tma: bool) -> None:
    """Members whose widths are multiples of the TMA tile (at most 4 of them) get contiguous outputs of their own.

    Otherwise (a fifth member, a width that is not a multiple of ``block_n``) they stay column views of
    one output. Values and gradients match the references either way; with outputs apart the
    backward's kernels read each member's gradient where it is (the ``dx`` pass takes its TMA kernel
    for them whatever its config says; the ``dy`` pass split over N).
    """
    tma = KernelConfig(block_m=32, block_n=16, block_k=32, group_m=4, num_warps=4, num_stages=1, tma=True)
    dx = tma if dx_tma else dataclasses.replace(tma, block_k=16, tma=False)
    split = KernelConfig(block_m=16, block_n=16, block_k=16, split=2, num_warps=4, num_stages=1)
    case = dataclasses.replace(MIXED, ranks=(8, 16, 16, 4), k=40)
    with override_configs({"multi_xw_sb": tma, "multi_dyw_dsa": dx, "multi_dys_dyb": split}):
        s = Siblings.make(case, members, torch.float32)
        dys = [torch.ones(case.t, n) for n in members]
        ys = run_siblings(case, members, s, dys, seed=5)
        assert all(y.is_contiguous() for y in ys) is apart
        assert len({y.untyped_storage().data_ptr() for y in ys}) == (len(members) if apart else 1)
        check(case, torch.float32, members=members)


@pytest.mark.parametrize(
    ("members", "align"),
    [
        ((4096, 1024, 1024), 16),
        ((14336, 14336), 16),
        ((32, 16, 16), 16),
        ((24, 8, 16), 1),
        ((29, 7, 13), 1),
        ((33,), 1),
    ],
)
def test_member_bounds_are_declared_aligned_only_when_they_are(members: tuple[int, ...], align: int) -> None:
    """The dS/dB pass tells the compiler the members' bounds are multiples of 16 only where every width is.

    A wrong claim would let the compiler keep a vector load across a member's last column (masks are
    then assumed constant over 16 columns) and mix two members' gradients; the interpreter ignores the
    claim, so this is where it is checked.
    """
    assert member_alignment(members) == align
    bounds = [sum(members[:g]) for g in range(len(members) + 1)]
    assert all(b % align == 0 for b in bounds)


@INTERPRET
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("members", [(40, 40), (33,)], ids=["gate-up-like", "one-member"])
def test_siblings_deterministic_and_other_groupings(members: tuple[int, ...]) -> None:
    check(MIXED, torch.float32, members=members, deterministic=True)
    check(NO_DROPOUT, torch.float32, members=members)


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_one_adapter_batch_runs_the_multi_kernels() -> None:
    check(dataclasses.replace(NO_DROPOUT, lengths=(12, 9), adapters=(1, 1), dropout_p=(0.0, 0.2)), torch.float32)


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("case", SIB_CASES)
def test_torch_path_matches_members_references(case: Case) -> None:
    check(case, torch.float32)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_member_without_gradient_gets_exactly_zero_lora_b_gradients(path: str, request: pytest.FixtureRequest) -> None:
    """dy = 0 on member 1: its B gradients are exactly zero (nothing leaks between members)."""
    request.getfixturevalue(path)
    case = MIXED
    s = Siblings.make(case, MEMBERS, torch.float32)
    dys = [torch.randn(case.t, n) for n in MEMBERS]
    dys[1].zero_()
    run_siblings(case, MEMBERS, s, dys, seed=5)
    for a in (0, 1, 2):
        assert torch.count_nonzero(s.lora_b[a][1].grad) == 0
        assert torch.count_nonzero(s.lora_b[a][0].grad) > 0
    assert all(t.grad is None for t in (*s.lora_a[3], *s.lora_b[3]))  # adapter 3 owns no token: no gradient


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_a_rank0_adapter_with_tokens_gets_empty_gradients(path: str, request: pytest.FixtureRequest) -> None:
    """Regression: adapter 2 of UNIFORM (rank 0, with tokens) got ``[0, K]``/``[N_g, 0]`` gradients on the
    Triton path but None on the torch path; every path gives them now."""
    request.getfixturevalue(path)
    case = UNIFORM
    s = Siblings.make(case, MEMBERS, torch.float32)
    run_siblings(case, MEMBERS, s, [torch.randn(case.t, n) for n in MEMBERS], seed=5)
    for g, n in enumerate(MEMBERS):
        grad_a, grad_b = s.lora_a[2][g].grad, s.lora_b[2][g].grad
        assert grad_a is not None
        assert grad_a.shape == (0, case.k)
        assert grad_b is not None
        assert grad_b.shape == (n, 0)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"], ids=["negative", "over-63-bits", "float", "bool", "str"])
def test_a_bad_seed_is_refused_without_dropout(seed: object, path: str, request: pytest.FixtureRequest) -> None:
    """Regression: at p = 0 the seed was never read, so a bad one passed until dropout was turned on."""
    request.getfixturevalue(path)
    case = NO_DROPOUT
    s = Siblings.make(case, MEMBERS, torch.float32)
    with pytest.raises(LoRAFusionKernelsError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        fused_multi_lora_siblings(
            s.x, s.weight, s.lora_a, s.lora_b, out_features=MEMBERS, segment_lengths=case.lengths,
            segment_adapters=case.adapters, scaling=case.scaling, seed=seed,  # type: ignore[arg-type]
        )  # fmt: skip


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_siblings_at_p0_equal_separate_calls() -> None:
    """With p = 0 a sibling call and one call per member agree to rounding (fp32)."""
    case = NO_DROPOUT
    s = Siblings.make(case, MEMBERS, torch.float32)
    ys = fused_multi_lora_siblings(
        s.x, s.weight, s.lora_a, s.lora_b, out_features=MEMBERS, segment_lengths=case.lengths,
        segment_adapters=case.adapters, scaling=case.scaling,
    )  # fmt: skip
    start = 0
    for g, n in enumerate(MEMBERS):
        alone = fused_multi_lora_linear(
            s.x, s.weight[start : start + n], [per[g] for per in s.lora_a], [per[g] for per in s.lora_b],
            segment_lengths=case.lengths, segment_adapters=case.adapters, scaling=case.scaling,
        )  # fmt: skip
        start += n
        torch.testing.assert_close(ys[g], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"out_features": (29, 7)}, "stack the members' rows"),
        ({"rank_of_member_1": 4}, "one rank per adapter"),
        ({"out_features": (29, 0, 20)}, "positive width"),
    ],
)
def test_bad_sibling_calls_are_refused(change: dict[str, object], message: str) -> None:
    case = NO_DROPOUT
    s = Siblings.make(case, MEMBERS, torch.float32)
    if "rank_of_member_1" in change:
        s.lora_a[0][1] = torch.zeros(4, case.k)
    with pytest.raises(LoRAFusionKernelsError, match=message):
        fused_multi_lora_siblings(
            s.x, s.weight, s.lora_a, s.lora_b, out_features=change.get("out_features", MEMBERS),
            segment_lengths=case.lengths, segment_adapters=case.adapters, scaling=case.scaling,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"out_features": 49}, r"out_features must list each member's width .* got int 49"),
        ({"out_features": (29.5, 7, 12.5)}, r"out_features must hold each member's width as an integer, got 29.5"),
        ({"out_features": (29, 7.0, 13)}, r"as an integer, got 7.0"),
        ({"out_features": {29, 7, 13}}, r"out_features must list each member's width .* got set"),
        ({"stacked_a": True}, r"lora_a\[0\] is a tensor \[48, 37\], not a list: give adapter 0 a list"),
        ({"flat": True}, r"lora_a\[0\] is a tensor \[8, 37\], not a list"),
    ],
    ids=["one-int", "float-widths", "whole-float", "set", "stacked-a", "flat-lists"],
)
def test_sibling_layouts_are_named(change: dict[str, object], message: str) -> None:
    """Regression: ``out_features=49`` raised ``TypeError: 'int' object is not iterable``, float widths
    were truncated (and the error showed the truncated list), an adapter's members stacked into one
    ``A`` were counted as "48 A matrices", and flat per-member lists gave an error about ``scaling``."""
    case = NO_DROPOUT
    s = Siblings.make(case, MEMBERS, torch.float32)
    lora_a: list = s.lora_a
    lora_b: list = s.lora_b
    if change.get("stacked_a"):
        lora_a = [torch.cat(per_member) for per_member in s.lora_a]
    if change.get("flat"):
        lora_a, lora_b = s.lora_a[1], s.lora_b[1]  # adapter 1's three members, as if they were adapters
    with pytest.raises(LoRAFusionKernelsError, match=message):
        fused_multi_lora_siblings(
            s.x, s.weight, lora_a, lora_b, out_features=change.get("out_features", MEMBERS),
            segment_lengths=case.lengths, segment_adapters=case.adapters, scaling=case.scaling,
        )  # fmt: skip


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_stacked_rank_over_128_is_refused() -> None:
    case = dataclasses.replace(NO_DROPOUT, ranks=(64, 8))
    s = Siblings.make(case, MEMBERS, torch.float32)
    with pytest.raises(LoRAFusionKernelsError, match="stack to rank 192"):
        fused_multi_lora_siblings(
            s.x, s.weight, s.lora_a, s.lora_b, out_features=MEMBERS, segment_lengths=case.lengths,
            segment_adapters=case.adapters, scaling=case.scaling,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")  # no config file for this GPU
@pytest.mark.parametrize(
    ("members", "deterministic"),
    [
        pytest.param((4096, 1024, 1024), False, id="llama8b-qkv"),
        pytest.param((4096, 1024, 1024), True, id="llama8b-qkv-deterministic"),
        pytest.param((14336, 14336), False, id="llama8b-gate-up"),
    ],
)
def test_gpu_bf16_real_shapes(members: tuple[int, ...], deterministic: bool) -> None:
    case = Case(
        lengths=(1500, 700, 1, 1895),
        adapters=(0, 1, 2, 3),
        ranks=(16, 16, 32, 8),
        scaling=(2.0, 2.0, 0.5, 1.0),
        dropout_p=(0.1, 0.1, 0.05, 0.0),
        k=4096,
        bias=True,
    )
    check(case, torch.bfloat16, members=members, seed=77, device="cuda", deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")
def test_gpu_bf16_stacked_rank_tile_128() -> None:
    """q/k/v at rank 32 (stacked 96, rank tile 128) and 8,192 tokens: on H100 the dx GEMM's tuned tiles
    needed 263,168 of 232,448 bytes of shared memory and the call raised; it now runs with fewer stages."""
    case = Case(
        lengths=(4000, 4192),
        adapters=(0, 1),
        ranks=(32, 16),
        scaling=(2.0, 2.0),
        dropout_p=(0.1, 0.1),
        k=4096,
    )
    check(case, torch.bfloat16, members=(4096, 1024, 1024), seed=7, device="cuda")


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_torch_compile_runs_the_sibling_call_through_the_custom_ops() -> None:
    """Compiled and eager sibling calls agree (outputs and gradients), through ``lorafusion::fused_multi_lora_*``."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = dataclasses.replace(NO_DROPOUT, dropout_p=(0.2, 0.1))
    s = Siblings.make(case, MEMBERS, torch.float32)
    leaves = [s.x, *(t for per in (*s.lora_a, *s.lora_b) for t in per)]

    def fn(x: torch.Tensor, *ab: torch.Tensor) -> torch.Tensor:
        g = len(MEMBERS)
        per_a = [list(ab[i * g : (i + 1) * g]) for i in range(len(case.ranks))]
        per_b = [list(ab[(len(case.ranks) + i) * g : (len(case.ranks) + i + 1) * g]) for i in range(len(case.ranks))]
        ys = fused_multi_lora_siblings(
            x, s.weight, per_a, per_b, out_features=MEMBERS, segment_lengths=case.lengths,
            segment_adapters=case.adapters, scaling=case.scaling, dropout_p=case.dropout_p, seed=3,
        )  # fmt: skip
        return torch.cat([y.sin() for y in ys], dim=1)

    counter = CompileCounterWithBackend("aot_eager")
    eager = fn(*leaves)
    compiled = torch.compile(fn, backend=counter)(*leaves)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(
        torch.autograd.grad(compiled.sum(), leaves), torch.autograd.grad(eager.sum(), leaves), strict=True
    ):
        torch.testing.assert_close(got, want)
    assert any("lorafusion.fused_multi_lora_forward" in graph.code for graph in counter.graphs)
