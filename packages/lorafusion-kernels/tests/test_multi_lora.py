"""FusedMultiLoRA against its float64 per-segment reference (Triton kernels under TRITON_INTERPRET=1).

Under the interpreter the kernels run on CPU, so shapes are tiny and configs are the interpreter
heuristics (no autotuning). The same cases run through the plain-torch path by switching the
interpreter off for the call. GPU cases (bf16, real shapes) are marked ``gpu``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lorafusion_kernels.lora as lora_module
import lorafusion_kernels.multi_lora as multi_lora_module
from lorafusion_kernels.errors import LoRAFusionKernelsError, LoRAFusionKernelsWarning
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora import fused_multi_lora_linear
from lorafusion_kernels.multi_lora_autograd import batch_of_segments
from lorafusion_kernels.multi_lora_context import multi_lora_batch
from lorafusion_kernels.multi_lora_params import AdapterParams, device_params
from lorafusion_kernels.reference import multi_lora_linear_reference
from lorafusion_kernels.testing import assert_close_to_reference, rel_rms
from lorafusion_kernels.tuning.config import KernelConfig, override_configs

INTERPRET = pytest.mark.interpret


@dataclasses.dataclass(frozen=True)
class Case:
    """One multi-adapter microbatch: segments, per-adapter ranks, scaling and dropout p."""

    name: str
    lengths: tuple[int, ...]
    adapters: tuple[int, ...]
    ranks: tuple[int, ...]
    scaling: tuple[float, ...]
    dropout_p: tuple[float, ...]
    n: int = 45
    k: int = 37
    bias: bool = False

    @property
    def t(self) -> int:
        return sum(self.lengths)


# Odd lengths, a segment of length 1, adapter 0 owns two segments, adapter 3 owns none, an empty
# segment, mixed ranks 8/16/64, mixed p (0 included) and a scaling that bf16 cannot represent.
MIXED = Case(
    name="mixed",
    lengths=(7, 1, 19, 0, 11, 5),
    adapters=(0, 2, 1, 3, 0, 2),
    ranks=(8, 16, 64, 4),
    scaling=(2.0, 1.0 / 3.0, 0.7, 1.5),
    dropout_p=(0.1, 0.0, 0.3, 0.2),
    bias=True,
)
NO_DROPOUT = Case(
    name="p0",
    lengths=(3, 30, 10),
    adapters=(1, 0, 1),
    ranks=(16, 8),
    scaling=(0.5, 2.0),
    dropout_p=(0.0, 0.0),
    n=33,
    k=48,
)


def make_inputs(case: Case, dtype: torch.dtype, *, seed: int = 0, frozen_a: bool = False) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
        t = (torch.randn(*shape, generator=gen) * scale).to(dtype)
        return t.requires_grad_(grad)

    return {
        "x": rand(case.t, case.k),
        "weight": rand(case.n, case.k, scale=case.k**-0.5, grad=False),
        "lora_a": [rand(r, case.k, scale=case.k**-0.5, grad=not frozen_a) for r in case.ranks],
        "lora_b": [rand(case.n, r, scale=max(r, 1) ** -0.5) for r in case.ranks],
        "bias": rand(case.n, scale=0.1) if case.bias else None,
    }


def detached(inputs: dict[str, object], dtype: torch.dtype) -> dict[str, object]:
    def conv(t: object) -> object:
        if isinstance(t, torch.Tensor):
            return t.detach().to(dtype).requires_grad_(t.requires_grad)
        if isinstance(t, list):
            return [conv(v) for v in t]
        return t

    return {k: conv(v) for k, v in inputs.items()}


def grads(inputs: dict[str, object]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in inputs.items():
        tensors = value if isinstance(value, list) else [value]
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                out[f"d{key}[{i}]" if isinstance(value, list) else f"d{key}"] = g
    return out


def run_fused(case: Case, inputs: dict[str, object], dy: torch.Tensor, seed: int, **kw: object) -> torch.Tensor:
    y = fused_multi_lora_linear(
        inputs["x"],
        inputs["weight"],
        inputs["lora_a"],
        inputs["lora_b"],
        segment_lengths=case.lengths,
        segment_adapters=case.adapters,
        scaling=case.scaling,
        dropout_p=case.dropout_p,
        bias=inputs["bias"],
        seed=seed,
        **kw,
    )
    y.backward(dy)
    return y.detach()


def run_reference(case: Case, inputs: dict[str, object], dy: torch.Tensor, seed: int) -> torch.Tensor:
    y = multi_lora_linear_reference(
        inputs["x"],
        inputs["weight"],
        inputs["lora_a"],
        inputs["lora_b"],
        segment_lengths=case.lengths,
        segment_adapters=case.adapters,
        scaling=case.scaling,
        dropout_p=case.dropout_p,
        bias=inputs["bias"],
        seed=seed,
    )
    y.backward(dy.to(y.dtype))
    return y.detach()


def check_against_reference(
    case: Case, dtype: torch.dtype, seed: int = 1234, *, frozen_a: bool = False, **kw: object
) -> None:
    """Output and every gradient against float64 (``frozen_a``: no ``dA``, so ``dx`` takes the fused GEMM)."""
    inputs = make_inputs(case, dtype, frozen_a=frozen_a)
    ref_in = detached(inputs, torch.float64)
    eager_in = detached(inputs, dtype)
    dy = torch.randn(case.t, case.n, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = run_fused(case, inputs, dy, seed, **kw)
    y_ref = run_reference(case, ref_in, dy, seed)
    y_eager = run_reference(case, eager_in, dy, seed)
    assert_close_to_reference("y", y, y_ref, y_eager)
    ref_grads, eager_grads = grads(ref_in), grads(eager_in)
    for name, g in grads(inputs).items():
        assert_close_to_reference(name, g, ref_grads[name], eager_grads[name], factor=3.0)


# Segments that are whole 32-row tiles (the interpreter's GEMM tile): no tile straddles a boundary,
# so the GEMMs compile their routing for one segment per tile (ONE_SEGMENT) and draw the dx mask
# with one threshold per tile. Mixed p and ranks still.
ALIGNED = Case(
    name="aligned",
    lengths=(32, 64, 32),
    adapters=(1, 0, 2),
    ranks=(8, 16, 4),
    scaling=(2.0, 0.5, 1.0),
    dropout_p=(0.1, 0.3, 0.0),
)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
CASES = [
    pytest.param(MIXED, id="mixed-T43-N45-K37-r8.16.64.4"),
    pytest.param(NO_DROPOUT, id="p0-T43-N33-K48-r16.8"),
    pytest.param(ALIGNED, id="aligned-T128-N45-K37-r8.16.4"),
]


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_reference(case: Case, dtype: torch.dtype) -> None:
    check_against_reference(case, dtype)


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_fused_dx_gemm_matches_reference(case: Case, dtype: torch.dtype) -> None:
    """Frozen A: no dA pass to write dx's LoRA term, so dx is the one Triton GEMM with the term routed in."""
    check_against_reference(case, dtype, frozen_a=True)


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize("frozen_a", [False, True], ids=["dx-from-dA-pass", "dx-fused-gemm"])
def test_tma_kernels_match_reference(frozen_a: bool) -> None:
    """The sm_90 variants of the two GEMMs (TMA descriptors), which the interpreter also runs."""
    tma = KernelConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1, tma=True)
    with override_configs({"multi_xw_sb": tma, "multi_dyw_dsa": tma}):
        check_against_reference(dataclasses.replace(MIXED, k=40, n=48), torch.float32, frozen_a=frozen_a)


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize("split", [2, 3])
def test_split_reductions_match_reference(split: int) -> None:
    """The backward's reductions shared by several programs (on a GPU the launchers pick the count)."""
    config = KernelConfig(block_m=16, block_n=16, block_k=16, split=split, num_warps=4, num_stages=1)
    with override_configs({"multi_xa": config, "multi_dys_dyb": config, "multi_dsx": config, "multi_dsx_dx": config}):
        check_against_reference(dataclasses.replace(MIXED, k=40, n=48), torch.float32)


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
def test_dy_pass_leaves_zeros_past_each_rank() -> None:
    """dS columns past a token's rank are zeros: the dA pass and the dx GEMM read whole dS rows."""
    from lorafusion_kernels._kernels.multi_lora_bwd import multi_lora_dys_dyb

    lengths, adapters, ranks, n = [9, 20, 3, 14], [1, 0, 2, 1], [4, 16, 8], 40
    gen = torch.Generator().manual_seed(11)
    batch = MultiLoRABatch.from_segments(lengths, adapters, device="cpu")
    offsets = [sum(ranks[:a]) for a in range(len(ranks))]
    b_cat = torch.randn(n, sum(ranks), generator=gen)
    s = torch.zeros(sum(lengths), 16)  # S as the shrink writes it: zeros past each token's rank
    rows = torch.repeat_interleave(torch.tensor(adapters), torch.tensor(lengths))
    for t, a in enumerate(rows.tolist()):
        s[t, : ranks[a]] = torch.randn(ranks[a], generator=gen)
    dy = torch.randn(sum(lengths), n, generator=gen)
    rank_table = torch.tensor([[r, o] for r, o in zip(ranks, offsets, strict=True)], dtype=torch.int32)
    scaling = torch.tensor([0.5, 2.0, 1.5])
    config = KernelConfig(block_m=16, block_n=16, block_k=16, split=2, num_warps=4, num_stages=1)
    ds, db = multi_lora_dys_dyb(
        dy, b_cat, s, batch, ranks=rank_table, scaling=scaling, max_rank=16, ranks_host=tuple(ranks), config=config
    )
    for t, a in enumerate(rows.tolist()):
        r, o = ranks[a], offsets[a]
        expected = scaling[a].double() * dy[t].double() @ b_cat[:, o : o + r].double()
        torch.testing.assert_close(ds[t, :r].double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(ds[t, r:], torch.zeros(16 - r)), (t, a)
    for a, (r, o) in enumerate(zip(ranks, offsets, strict=True)):
        mine = rows == a
        expected = scaling[a].double() * dy[mine].double().T @ s[mine, :r].double()
        torch.testing.assert_close(db[:, o : o + r].double(), expected, rtol=1e-5, atol=1e-5)


@INTERPRET
@pytest.mark.usefixtures("interpreter", "nan_poison")
@pytest.mark.parametrize("split", [1, 3])
def test_dy_pass_with_one_column_block_matches_reference(split: int) -> None:
    """dS stored, not added by atomics, where one column block covers N; runs of one row group or several."""
    config = KernelConfig(block_m=16, block_n=64, block_k=16, split=split, num_warps=4, num_stages=1)
    with override_configs({"multi_dys_dyb": config}):
        check_against_reference(dataclasses.replace(MIXED, k=40, n=48), torch.float32)


@INTERPRET
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_kernels_match_reference_both_reductions(deterministic: bool) -> None:
    check_against_reference(MIXED, torch.float32, seed=99, deterministic=deterministic)


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_deterministic_da_does_not_depend_on_whether_x_needs_a_gradient() -> None:
    """Where ``K <= N`` the ``dA`` pass also writes dx's LoRA term when x needs a gradient, a variant with
    launch configs of its own; deterministic sums keep ``dA``'s bits either way (a first layer whose
    input gains a gradient under activation checkpointing rounds as without it)."""
    case = dataclasses.replace(MIXED, k=40, n=48)
    dy = torch.randn(case.t, case.n, generator=torch.Generator().manual_seed(7))
    tiles = {
        "multi_dsx": KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1),
        "multi_dsx_dx": KernelConfig(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=1),
    }
    da = []
    with override_configs(tiles):
        for x_needs_grad in (False, True):
            inputs = make_inputs(case, torch.float32)
            inputs["x"].requires_grad_(x_needs_grad)
            run_fused(case, inputs, dy, seed=5, deterministic=True)
            assert (inputs["x"].grad is not None) == x_needs_grad
            da.append([a.grad for a in inputs["lora_a"]])
    for index, (without, with_dx) in enumerate(zip(*da, strict=True)):
        if without is None:  # adapter 3 owns no token
            assert with_dx is None
            continue
        torch.testing.assert_close(with_dx, without, rtol=0, atol=0, msg=f"dA of adapter {index}")


@pytest.mark.usefixtures("torch_path")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_reference(case: Case, dtype: torch.dtype) -> None:
    check_against_reference(case, dtype)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_zero_output_gradient_gives_exactly_zero_adapter_gradients(path: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    case = MIXED
    inputs = make_inputs(case, torch.float32)
    dy = torch.randn(case.t, case.n)
    start = 0
    for length, adapter in zip(case.lengths, case.adapters, strict=True):
        if adapter == 2:
            dy[start : start + length] = 0.0
        start += length
    run_fused(case, inputs, dy, seed=5)
    for t in (inputs["lora_a"][2], inputs["lora_b"][2]):
        assert t.grad is not None
        assert torch.count_nonzero(t.grad) == 0
    for t in (inputs["lora_a"][0], inputs["lora_b"][1]):
        assert t.grad is not None
        assert torch.count_nonzero(t.grad) > 0


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_adapter_without_tokens_gets_no_gradient(path: str, request: pytest.FixtureRequest) -> None:
    """Adapter 3 owns no token: its ``.grad`` stays None on every path (not zeros an optimizer would step on)."""
    request.getfixturevalue(path)
    inputs = make_inputs(MIXED, torch.float32)
    run_fused(MIXED, inputs, torch.randn(MIXED.t, MIXED.n), seed=5)
    assert inputs["lora_a"][3].grad is None
    assert inputs["lora_b"][3].grad is None
    assert all(inputs[key][a].grad is not None for key in ("lora_a", "lora_b") for a in range(3))


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_zero_b_with_dropout_is_exactly_the_frozen_layer() -> None:
    """Regression (authors' x / x_hat swap): dropout must touch only the LoRA branch."""
    case = dataclasses.replace(MIXED, dropout_p=(0.5, 0.5, 0.5, 0.5))
    inputs = make_inputs(case, torch.float32)
    inputs["lora_b"] = [torch.zeros_like(b) for b in inputs["lora_b"]]
    y = fused_multi_lora_linear(
        inputs["x"],
        inputs["weight"],
        inputs["lora_a"],
        inputs["lora_b"],
        segment_lengths=case.lengths,
        segment_adapters=case.adapters,
        scaling=case.scaling,
        dropout_p=case.dropout_p,
        bias=inputs["bias"],
        seed=3,
    )
    frozen = torch.nn.functional.linear(inputs["x"].double(), inputs["weight"].double(), inputs["bias"].double())
    assert rel_rms(y, frozen) < 1e-6


@INTERPRET
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_fp32_adapters_on_an_fp16_layer(deterministic: bool) -> None:
    """fp32 adapters (PEFT's autocast default) on fp16 activations, one adapter fp16: each gradient in its dtype.

    The adapters are stacked in fp32 and cast to fp16 inside the kernels; with values fp16 holds
    exactly, output and dx equal the all-fp16 run's, and dA/dB equal it once rounded to fp16.
    """
    case = MIXED
    dy = torch.randn(case.t, case.n, generator=torch.Generator().manual_seed(5)).half()
    half = make_inputs(case, torch.float16)
    mixed = detached(half, torch.float16)
    mixed["lora_a"] = [a.detach().float().requires_grad_() for a in half["lora_a"]]
    mixed["lora_b"] = [b.detach().float().requires_grad_() for b in half["lora_b"][:-1]]
    mixed["lora_b"].append(half["lora_b"][-1].detach().clone().requires_grad_())
    y_half = run_fused(case, half, dy, seed=21, deterministic=deterministic)
    y_mixed = run_fused(case, mixed, dy, seed=21, deterministic=deterministic)
    assert torch.equal(y_mixed, y_half)
    assert torch.equal(mixed["x"].grad, half["x"].grad)
    owners = [*mixed["lora_a"][:3], *mixed["lora_b"][:3]]  # adapter 3 owns no token (no gradient)
    for got, want in zip(owners, [*half["lora_a"][:3], *half["lora_b"][:3]], strict=True):
        assert got.grad.dtype == got.dtype
        assert torch.equal(got.grad.to(torch.float16), want.grad)


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_deterministic_mode_is_bitwise_reproducible() -> None:
    case = MIXED
    results = []
    for _ in range(2):
        inputs = make_inputs(case, torch.float32)
        dy = torch.ones(case.t, case.n)
        y = run_fused(case, inputs, dy, seed=11, deterministic=True)
        owners = [*inputs["lora_a"][:3], *inputs["lora_b"][:3]]  # adapter 3 owns no token (no gradient)
        results.append([y, inputs["x"].grad, *[t.grad for t in owners]])
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_many_segments_and_tiles() -> None:
    """60 segments, several per row tile and tiles of every adapter: every row is routed and written.

    (Tables sized to the batch, far beyond the authors' 192-tile cap, are checked in test_multi_lora_metadata.)
    """
    gen = torch.Generator().manual_seed(0)
    lengths = tuple(int(v) for v in torch.randint(1, 40, (60,), generator=gen))
    adapters = tuple(int(v) for v in torch.randint(0, 5, (60,), generator=gen))
    case = Case(
        name="many",
        lengths=lengths,
        adapters=adapters,
        ranks=(1, 2, 3, 5, 8),
        scaling=(1.0, 0.5, 2.0, 0.25, 1.0),
        dropout_p=(0.1, 0.0, 0.2, 0.05, 0.0),
        n=16,
        k=16,
    )
    check_against_reference(case, torch.float32)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_one_batch_reused_by_layers_of_different_ranks(path: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    batch = MultiLoRABatch.from_segments(MIXED.lengths, MIXED.adapters, num_adapters=4)
    for ranks in ((8, 16, 64, 4), (2, 2, 32, 1)):
        case = dataclasses.replace(MIXED, ranks=ranks)
        inputs = make_inputs(case, torch.float32)
        with torch.no_grad():
            y = fused_multi_lora_linear(
                inputs["x"],
                inputs["weight"],
                inputs["lora_a"],
                inputs["lora_b"],
                scaling=case.scaling,
                dropout_p=case.dropout_p,
                bias=inputs["bias"],
                seed=21,
                batch=batch,
            )
            ref = multi_lora_linear_reference(
                **detached(inputs, torch.float64),
                segment_lengths=case.lengths,
                segment_adapters=case.adapters,
                scaling=case.scaling,
                dropout_p=case.dropout_p,
                seed=21,
            )
        assert rel_rms(y, ref) < 1e-5


def test_single_adapter_batch_takes_the_fused_lora_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = multi_lora_module.fused_lora_linear

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(multi_lora_module, "fused_lora_linear", spy)
    case = dataclasses.replace(MIXED, lengths=(4, 0, 9), adapters=(1, 0, 1))
    inputs = make_inputs(case, torch.float32)
    y = fused_multi_lora_linear(
        inputs["x"],
        inputs["weight"],
        inputs["lora_a"],
        inputs["lora_b"],
        segment_lengths=case.lengths,
        segment_adapters=case.adapters,
        scaling=case.scaling,
        dropout_p=case.dropout_p,
        bias=inputs["bias"],
        seed=8,
    )
    assert len(calls) == 1
    assert calls[0]["scaling"] == case.scaling[1]
    assert calls[0]["dropout_p"] == case.dropout_p[1]
    ref = multi_lora_linear_reference(
        **detached(inputs, torch.float64),
        segment_lengths=case.lengths,
        segment_adapters=case.adapters,
        scaling=case.scaling,
        dropout_p=case.dropout_p,
        seed=8,
    )
    assert rel_rms(y, ref) < 1e-5


@INTERPRET
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    ("deterministic", "env", "expected"),
    [(True, "0", True), (False, "1", False), (None, "1", True)],
    ids=["flag-on", "flag-off-beats-env", "none-follows-env"],
)
def test_single_adapter_batch_passes_deterministic_on(
    deterministic: bool | None, env: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ``deterministic=`` was dropped when a one-adapter batch took the FusedLoRA path."""
    monkeypatch.setenv("LORAFUSION_DETERMINISTIC", env)
    calls = []
    real = lora_module.lora_dys_dyb

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_module, "lora_dys_dyb", spy)
    case = dataclasses.replace(MIXED, lengths=(4, 0, 9), adapters=(1, 0, 1), n=16, k=16)
    inputs = make_inputs(case, torch.float32)
    run_fused(case, inputs, torch.ones(case.t, case.n), seed=8, deterministic=deterministic)
    assert calls == [expected]


@INTERPRET
@pytest.mark.usefixtures("interpreter")
def test_torch_compile_traces_the_custom_ops() -> None:
    """A compiled function runs the ``lorafusion::fused_multi_lora_*`` ops: same output and gradients as eager.

    Three batches with different segments, with and without dropout: the second recompiles (Dynamo
    then makes the segment lengths dynamic), the third may reuse that graph.
    """
    case = dataclasses.replace(MIXED, n=20, k=24)
    inputs = make_inputs(case, torch.float32)
    weight, bias = inputs["weight"], inputs["bias"]
    leaves = [inputs["x"], *inputs["lora_a"], *inputs["lora_b"]]

    def fn(batch: MultiLoRABatch, dropout_p: float, x: torch.Tensor, *ab: torch.Tensor) -> torch.Tensor:
        a, b = list(ab[:4]), list(ab[4:])
        y = fused_multi_lora_linear(
            x, weight, a, b, scaling=case.scaling, dropout_p=dropout_p, bias=bias, seed=5, batch=batch
        )
        return y.sin()

    def op_calls() -> int:
        """Calls of the custom ops' implementations (only they look batches up by segment lists)."""
        info = batch_of_segments.cache_info()
        return info.hits + info.misses

    counter = CompileCounterWithBackend("aot_eager")
    compiled_fn = torch.compile(fn, backend=counter)
    batches = [(case.lengths, case.adapters, 0.2), ((20, 4, 19), (2, 1, 0), 0.0), ((9, 30, 4), (1, 3, 2), 0.1)]
    for lengths, adapters, p in batches:
        batch = MultiLoRABatch.from_segments(lengths, adapters, num_adapters=4)
        eager = fn(batch, p, *leaves)
        g_eager = torch.autograd.grad(eager.sum(), leaves, allow_unused=True)
        before = op_calls()
        compiled = compiled_fn(batch, p, *leaves)
        g_comp = torch.autograd.grad(compiled.sum(), leaves, allow_unused=True)
        assert op_calls() == before + 2, "the compiled forward and backward run the custom ops"
        torch.testing.assert_close(compiled, eager)
        owned = [a in batch.active_adapters for a in range(4)]
        assert [g is not None for g in g_comp] == [True, *owned, *owned]  # x, A_0..3, B_0..3
        for got, want in zip(g_comp, g_eager, strict=True):
            torch.testing.assert_close(got, want)
    assert any("lorafusion.fused_multi_lora_forward" in graph.code for graph in counter.graphs)


def test_custom_ops_are_registered() -> None:
    assert hasattr(torch.ops.lorafusion, "fused_multi_lora_forward")
    assert hasattr(torch.ops.lorafusion, "fused_multi_lora_backward")


def test_scaling_and_p_stay_fp32_values() -> None:
    """Regression (authors' bf16 tables): 1/3 and p = 0.1 reach the kernels unrounded."""
    params = AdapterParams(ranks=(8, 16), scaling=(1.0 / 3.0, 2.0), dropout_p=(0.1, 0.0))
    dev = device_params(params, torch.device("cpu"))
    assert dev.scaling.dtype == torch.float32
    assert dev.scaling[0].item() == pytest.approx(1.0 / 3.0, rel=1e-7)
    assert dev.inv_keep[0].item() == pytest.approx(1.0 / 0.9, rel=1e-7)
    assert dev.thresholds.tolist() == [math.ceil(0.1 * 2**16), 0]
    assert dev.ranks.tolist() == [[8, 0], [16, 8]]


def test_errors_name_the_problem() -> None:
    inputs = make_inputs(MIXED, torch.float32)
    common = {"scaling": MIXED.scaling, "dropout_p": MIXED.dropout_p}
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    with pytest.raises(LoRAFusionKernelsError, match="43 tokens but the segments add up to 42"):
        fused_multi_lora_linear(*args, segment_lengths=(7, 1, 19, 0, 11, 4), segment_adapters=MIXED.adapters, **common)
    with pytest.raises(LoRAFusionKernelsError, match="scaling has 2 entries for 4 adapters"):
        fused_multi_lora_linear(
            *args,
            segment_lengths=MIXED.lengths,
            segment_adapters=MIXED.adapters,
            scaling=(1.0, 2.0),
            dropout_p=0.0,
        )
    with pytest.raises(LoRAFusionKernelsError, match=r"\[0, 1\)"):
        fused_multi_lora_linear(
            *args, segment_lengths=MIXED.lengths, segment_adapters=MIXED.adapters, scaling=1.0, dropout_p=1.0
        )
    with pytest.raises(LoRAFusionKernelsError, match="refers to adapter 4, but lora_a and lora_b hold 4 adapters"):
        fused_multi_lora_linear(*args, segment_lengths=(43,), segment_adapters=(4,), scaling=1.0, dropout_p=0.0)
    with pytest.raises(LoRAFusionKernelsError, match="batch= or both"):
        fused_multi_lora_linear(*args, segment_lengths=MIXED.lengths, **common)
    batch = MultiLoRABatch.from_segments(MIXED.lengths, MIXED.adapters, num_adapters=4)
    with pytest.raises(LoRAFusionKernelsError, match="not both"):
        fused_multi_lora_linear(*args, batch=batch, segment_lengths=MIXED.lengths, **common)
    with pytest.raises(LoRAFusionKernelsError, match="weight dtype"):
        fused_multi_lora_linear(
            inputs["x"],
            inputs["weight"].half(),
            inputs["lora_a"],
            inputs["lora_b"],
            segment_lengths=MIXED.lengths,
            segment_adapters=MIXED.adapters,
            **common,
        )


def test_more_bad_inputs_are_named() -> None:
    inputs = make_inputs(MIXED, torch.float32)
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters}
    args = (inputs["x"], inputs["weight"])
    integer_a = [a.long() for a in inputs["lora_a"]]
    with pytest.raises(LoRAFusionKernelsError, match=r"lora_a\[0\] and lora_b\[0\] must be floating point"):
        fused_multi_lora_linear(*args, integer_a, inputs["lora_b"], scaling=1.0, **segments)
    with pytest.raises(LoRAFusionKernelsError, match="lora_a and lora_b are empty"):
        fused_multi_lora_linear(*args, [], [], scaling=1.0, segment_lengths=(43,), segment_adapters=(0,))
    with pytest.raises(LoRAFusionKernelsError, match="scaling must be a finite number, got nan"):
        fused_multi_lora_linear(*args, inputs["lora_a"], inputs["lora_b"], scaling=float("nan"), **segments)
    with pytest.raises(LoRAFusionKernelsError, match="bias must be floating point"):
        fused_multi_lora_linear(
            *args, inputs["lora_a"], inputs["lora_b"], scaling=1.0, bias=torch.zeros(MIXED.n, dtype=torch.int64),
            **segments,
        )  # fmt: skip


def test_per_adapter_mappings_and_generators() -> None:
    """Regression: a dict ``scaling`` was read as its keys (silently wrong), and a generator was read
    twice (so it looked empty). A mapping is refused; a generator is read once."""
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters, "seed": 3}
    with pytest.raises(LoRAFusionKernelsError, match=r"scaling must be one number or a sequence .* got a dict"):
        fused_multi_lora_linear(*args, scaling=dict(enumerate(MIXED.scaling)), **segments)
    with pytest.raises(LoRAFusionKernelsError, match=r"dropout_p must be one number .* got a set"):
        fused_multi_lora_linear(*args, scaling=1.0, dropout_p={0.1}, **segments)
    with torch.no_grad():
        from_generator = fused_multi_lora_linear(*args, scaling=(s for s in MIXED.scaling), **segments)
        from_tuple = fused_multi_lora_linear(*args, scaling=MIXED.scaling, **segments)
    torch.testing.assert_close(from_generator, from_tuple, rtol=0, atol=0)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_a_call_may_give_more_adapters_than_its_batch(path: str, request: pytest.FixtureRequest) -> None:
    """Regression: ``from_segments`` defaults ``num_adapters`` to ``max(adapters) + 1``, so a microbatch
    without the last adapter had a smaller batch than the call's lists, and the Triton path raised a
    raw ``ValueError`` from ``zip``. The adapters past the batch's own no tokens (no gradient)."""
    request.getfixturevalue(path)
    inputs = make_inputs(MIXED, torch.float32)
    batch = MultiLoRABatch.from_segments((20, 23), (1, 0))
    assert batch.num_adapters == 2
    y = fused_multi_lora_linear(
        inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"], scaling=MIXED.scaling,
        bias=inputs["bias"], batch=batch,
    )  # fmt: skip
    y.square().sum().backward()
    ref = multi_lora_linear_reference(
        **detached(inputs, torch.float64),
        segment_lengths=(20, 23),
        segment_adapters=(1, 0),
        scaling=MIXED.scaling,
        dropout_p=(0.0,) * 4,
    )
    assert rel_rms(y, ref) < 1e-5
    assert [a.grad is not None for a in inputs["lora_a"]] == [True, True, False, False]


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_float64_takes_the_torch_path_for_any_batch(path: str, request: pytest.FixtureRequest) -> None:
    """Regression: float64 ran on the torch path with several adapters, but a one-adapter batch went to
    FusedLoRA, which refused it then (and the interpreter took float64 for the kernels and refused it):
    whether a call ran depended on the batch's composition and the environment. FusedLoRA takes it
    now, on its torch path, as ``test_float64_is_computed_in_float64`` checks."""
    request.getfixturevalue(path)
    inputs = detached(make_inputs(MIXED, torch.float32), torch.float64)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    for adapters in ((0, 0, 0, 0, 0, 0), MIXED.adapters):
        y = fused_multi_lora_linear(
            *args, scaling=MIXED.scaling, segment_lengths=MIXED.lengths, segment_adapters=adapters
        )
        assert y.dtype == torch.float64


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "7"], ids=["negative", "over-63-bits", "float", "bool", "str"])
def test_bad_seeds_are_refused_on_every_path(seed: object, path: str, request: pytest.FixtureRequest) -> None:
    """Regression: the torch path took ``-1`` and ``2**64`` (the mask of seed 0) and raised a raw
    ``TypeError`` for ``1.5``; the Triton path truncated ``1.5`` to 1."""
    request.getfixturevalue(path)
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters}
    with pytest.raises(LoRAFusionKernelsError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        fused_multi_lora_linear(*args, scaling=1.0, dropout_p=MIXED.dropout_p, seed=seed, **segments)  # type: ignore[arg-type]


def test_integer_seeds_of_other_types_are_their_value() -> None:
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    kw = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters, "scaling": 1.0, "dropout_p": 0.3}
    with torch.no_grad():
        ys = [fused_multi_lora_linear(*args, seed=seed, **kw) for seed in (5, torch.tensor(5), np.int64(5))]  # type: ignore[arg-type]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=0, atol=0)


def test_flags_and_0d_inputs_are_refused() -> None:
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters, "scaling": 1.0}
    with pytest.raises(LoRAFusionKernelsError, match="deterministic must be None, True or False, got 'yes'"):
        fused_multi_lora_linear(*args, deterministic="yes", **segments)  # type: ignore[arg-type]
    with pytest.raises(LoRAFusionKernelsError, match=r"x must be .* got a 0-d tensor"):
        fused_multi_lora_linear(torch.tensor(1.0), *args[1:], **segments)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lora_a": torch.zeros(3, 16)}, r"lora_a must be a list or tuple with one tensor per adapter index, got one"),
        ({"lora_b": iter([])}, r"lora_b must be a list or tuple .* got list_iterator"),
        ({"lora_a": [None, None, None]}, r"lora_a\[0\] must be a tensor, got NoneType .* rank-0 tensor"),
        ({"dropout_p": [0.1, 1.0, 0.0]}, r"dropout_p must be in \[0, 1\), got 1.0 for adapter index 1"),
        ({"x": torch.zeros(5, 0), "weight": torch.zeros(8, 0)}, r"in_features must be at least 1, got weight \[8, 0\]"),
    ],
    ids=["a-tensor", "b-iterator", "a-none", "p-1", "k-0"],
)
def test_bad_adapter_lists_name_the_argument(change: dict, message: str) -> None:
    args = {
        "x": torch.zeros(5, 16),
        "weight": torch.zeros(8, 16),
        "lora_a": [torch.zeros(2, 16)] * 3,
        "lora_b": [torch.zeros(8, 2)] * 3,
        "dropout_p": 0.0,
    }
    args.update(change)
    with pytest.raises(LoRAFusionKernelsError, match=message):
        fused_multi_lora_linear(
            args["x"], args["weight"], args["lora_a"], args["lora_b"], segment_lengths=[2, 3],
            segment_adapters=[0, 1], scaling=1.0, dropout_p=args["dropout_p"],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("lengths", "adapters", "message"),
    [
        ((7, 1, 19, 0, 11, 5), (a for a in MIXED.adapters), None),
        (43, 0, "segment_lengths must be a list of integers or a 1-D integer tensor, got int 43"),
        ((20, 23), "01", "segment_adapters must be a list of integers or a 1-D integer tensor, got str '01'"),
        ((20, 23), (0, 1.0), r"segment_adapters must hold integers, got 1.0"),
    ],
    ids=["generator", "int", "str", "float"],
)
def test_segment_lists_are_read_once_and_named(lengths: object, adapters: object, message: str | None) -> None:
    """Regression: ``segment_adapters`` was read before it was checked. A generator was used up there
    (the error then blamed a length mismatch), an int or a string raised Python's own ``TypeError``."""
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    call = functools.partial(
        fused_multi_lora_linear, *args, segment_lengths=lengths, segment_adapters=adapters, scaling=MIXED.scaling
    )
    if message is None:
        with torch.no_grad():
            expected = fused_multi_lora_linear(
                *args, segment_lengths=MIXED.lengths, segment_adapters=MIXED.adapters, scaling=MIXED.scaling
            )
            torch.testing.assert_close(call(), expected, rtol=0, atol=0)
        return
    with pytest.raises(LoRAFusionKernelsError, match=message):
        call()


@pytest.mark.parametrize(
    "batch",
    [(MIXED.lengths, MIXED.adapters), [MIXED.lengths, MIXED.adapters], MIXED.lengths],
    ids=["tuple", "list", "lengths-only"],
)
def test_a_batch_that_is_no_multi_lora_batch_is_named(batch: object) -> None:
    """Regression: ``batch=(lengths, adapters)`` raised ``AttributeError: 'tuple' object has no attribute 'to'``."""
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    with pytest.raises(LoRAFusionKernelsError, match=r"batch must be a MultiLoRABatch, got .*from_segments"):
        fused_multi_lora_linear(*args, scaling=1.0, batch=batch)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["scaling", "dropout_p"])
@pytest.mark.parametrize("shape", [(), (4,)], ids=["one", "per-adapter"])
def test_a_trainable_scaling_or_p_tensor_is_refused(name: str, shape: tuple[int, ...]) -> None:
    """Regression: a per-adapter scaling tensor that requires grad was read as constants without a
    word, so a "learnable" scale got no gradient."""
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    value = torch.full(shape, 0.5 if name == "scaling" else 0.1, requires_grad=True)
    call = functools.partial(
        fused_multi_lora_linear, *args, segment_lengths=MIXED.lengths, segment_adapters=MIXED.adapters, seed=1
    )
    others = {"scaling": 1.0, "dropout_p": 0.0}
    with pytest.raises(LoRAFusionKernelsError, match=rf"{name} is a runtime constant; it gets no gradient"):
        call(**{**others, name: value})
    if not shape:  # one 0-d tensor per adapter
        with pytest.raises(LoRAFusionKernelsError, match=rf"{name} is a runtime constant"):
            call(**{**others, name: [value] * 4})
    with torch.no_grad():
        call(**{**others, name: value.detach()})


def test_a_dtype_mismatch_says_how_to_fix_it() -> None:
    inputs = make_inputs(MIXED, torch.float32)
    with pytest.raises(LoRAFusionKernelsError, match=r"must match x dtype torch.float32: cast x .* torch.autocast"):
        fused_multi_lora_linear(
            inputs["x"], inputs["weight"].half(), inputs["lora_a"], inputs["lora_b"], scaling=1.0,
            segment_lengths=MIXED.lengths, segment_adapters=MIXED.adapters,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ({"a", "b", "c"}, r"adapter_names must be a list or tuple .* got a set, whose iteration order"),
        ({"b": 1, "a": 0, "c": 2}, r"adapter_names must be a list or tuple .* got a dict, whose iteration order"),
        (frozenset({"a", "b", "c"}), r"got a frozenset"),
        (["a", 1, "c"], r"adapter_names\[1\] must be a PEFT adapter name \(a str\), got int 1"),
        (["a", None, "c"], r"adapter_names\[1\] must be a PEFT adapter name \(a str\), got NoneType"),
        ("abc", r"adapter_names must list one PEFT adapter name per adapter index \(3 needed\), got 'abc'"),
        (["a", "b"], r"\(3 needed\), got \['a', 'b'\]"),
    ],
    ids=["set", "dict", "frozenset", "int-entry", "none-entry", "str", "too-few"],
)
def test_multi_lora_batch_refuses_names_it_would_misroute(names: object, message: str) -> None:
    """Regression: a set's or a dict's iteration order became the index-to-name mapping (a set's
    depends on the string hash), so segments went to other adapters without a word."""
    batch = MultiLoRABatch.from_segments([5, 5, 5], [0, 1, 2])
    with pytest.raises(LoRAFusionKernelsError, match=message), multi_lora_batch(batch, names):  # type: ignore[arg-type]
        pytest.fail("the block must not run")


def test_multi_lora_batch_takes_names_of_any_sequence_once() -> None:
    batch = MultiLoRABatch.from_segments([5, 5], [0, 1])
    for names in (["a", "b"], ("a", "b"), (n for n in "ab")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LoRAFusionKernelsWarning)  # no patched module runs in the block
            with multi_lora_batch(batch, names) as entered:
                assert entered is batch


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((["a", "b"], "batch"), r"multi_lora_batch takes the batch first: multi_lora_batch\(batch, adapter_names\)"),
        ((((5, 5), (0, 1)), ["a", "b"]), r"batch must be a MultiLoRABatch, got tuple: build it with .*from_segments"),
        ((None, ["a", "b"]), r"batch must be a MultiLoRABatch, got NoneType"),
    ],
    ids=["swapped", "tuple", "none"],
)
def test_multi_lora_batch_names_a_wrong_batch_argument(args: tuple[object, object], message: str) -> None:
    """Regression: swapped arguments raised ``TypeError: 'MultiLoRABatch' object is not iterable`` and
    a tuple of lists ``AttributeError: ... no attribute 'num_adapters'``."""
    batch = MultiLoRABatch.from_segments([5, 5], [0, 1])
    first, second = (batch if a == "batch" else a for a in args)
    with pytest.raises(LoRAFusionKernelsError, match=message), multi_lora_batch(first, second):  # type: ignore[arg-type]
        pytest.fail("the block must not run")


def test_numpy_values_per_adapter_are_numbers() -> None:
    inputs = make_inputs(MIXED, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters}
    scaling = [float(s) for s in np.linspace(0.5, 2.0, len(inputs["lora_a"]))]
    expected = fused_multi_lora_linear(*args, scaling=scaling, **segments)
    got = fused_multi_lora_linear(*args, scaling=np.array(scaling), **segments)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(
        fused_multi_lora_linear(*args, scaling=np.float32(2.0), **segments),  # type: ignore[arg-type]
        fused_multi_lora_linear(*args, scaling=2.0, **segments),
    )


def test_a_host_batch_is_copied_to_a_device_once() -> None:
    batch = MultiLoRABatch.from_segments(MIXED.lengths, MIXED.adapters)
    assert batch.to("meta") is batch.to("meta")
    assert batch.to("cpu") is batch


@INTERPRET
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("square", [False, True], ids=["penalty", "double"])
def test_a_backward_with_create_graph_is_refused(square: bool) -> None:
    inputs = make_inputs(MIXED, torch.float32)
    y = fused_multi_lora_linear(
        inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"], segment_lengths=MIXED.lengths,
        segment_adapters=MIXED.adapters, scaling=MIXED.scaling,
    )  # fmt: skip
    with pytest.raises(LoRAFusionKernelsError, match="create_graph=True"):
        torch.autograd.grad((y.square() if square else y).sum(), [inputs["x"]], create_graph=True)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_a_strided_bias_is_read_as_its_values(path: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    inputs = make_inputs(MIXED, torch.float32)
    wide = torch.randn(2 * MIXED.n, generator=torch.Generator().manual_seed(4))
    lora = ([a.detach() for a in inputs["lora_a"]], [b.detach() for b in inputs["lora_b"]])
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters, "scaling": MIXED.scaling}
    outputs = [
        fused_multi_lora_linear(inputs["x"].detach(), inputs["weight"], *lora, bias=bias, **segments)
        for bias in (wide[::2], wide[::2].contiguous())
    ]
    torch.testing.assert_close(outputs[0], outputs[1])


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize("layout", ["transposed", "column_strided"])
def test_a_strided_weight_is_read_as_its_values(path: str, layout: str, request: pytest.FixtureRequest) -> None:
    """A weight whose K stride is not 1 (a Conv1D-style ``W.t()``, a column slice) gives the contiguous results.

    The multi-adapter kernels read ``W`` with unit stride along K; such a view used to be read as if
    it had one: wrong outputs and dx, no error. The trainable weight's gradient reaches the view.
    """
    request.getfixturevalue(path)
    inputs = make_inputs(MIXED, torch.float32)
    dense = inputs["weight"].detach()
    if layout == "transposed":
        stored = dense.t().contiguous().requires_grad_(True)  # [K, N], as GPT-2's Conv1D keeps it
        strided = stored.t()
    else:
        stored = torch.stack([dense, torch.zeros_like(dense)], dim=-1).requires_grad_(True)
        strided = stored[..., 0]
    packed = dense.clone().requires_grad_(True)
    segments = {"segment_lengths": MIXED.lengths, "segment_adapters": MIXED.adapters, "scaling": MIXED.scaling}
    dy = torch.randn(sum(MIXED.lengths), MIXED.n, generator=torch.Generator().manual_seed(5))
    as_nk = {"transposed": lambda g: g.t(), "column_strided": lambda g: g[..., 0]}[layout]
    grads = []
    for weight, leaf, to_nk in ((strided, stored, as_nk), (packed, packed, lambda g: g)):
        x = inputs["x"].detach().clone().requires_grad_(True)
        lora_a = [a.detach().clone().requires_grad_(True) for a in inputs["lora_a"]]
        lora_b = [b.detach().clone().requires_grad_(True) for b in inputs["lora_b"]]
        y = fused_multi_lora_linear(x, weight, lora_a, lora_b, **segments)
        y.backward(dy)
        grads.append([y.detach(), x.grad, *[a.grad for a in lora_a], *[b.grad for b in lora_b], to_nk(leaf.grad)])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
def test_empty_batch_is_the_frozen_layer(path: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    inputs = make_inputs(dataclasses.replace(MIXED, lengths=(0, 0, 0, 0, 0, 0)), torch.float32)
    y = fused_multi_lora_linear(
        inputs["x"],
        inputs["weight"],
        inputs["lora_a"],
        inputs["lora_b"],
        segment_lengths=(0, 0),
        segment_adapters=(0, 1),
        scaling=MIXED.scaling,
        bias=inputs["bias"],
    )
    assert y.shape == (0, MIXED.n)


# Adapter 1 has rank 0 ("no adapter": the frozen layer only); each batch gives it tokens.
RANK0 = Case(
    name="rank0",
    lengths=(6, 11, 4),
    adapters=(0, 1, 0),
    ranks=(8, 0, 4),
    scaling=(2.0, 1.0, 0.5),
    dropout_p=(0.2, 0.1, 0.0),
    bias=True,
)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize("adapters", [RANK0.adapters, (1, 1, 1)], ids=["mixed", "rank0-alone"])
def test_a_rank0_adapter_with_tokens_gets_empty_gradients(
    adapters: tuple[int, ...], path: str, request: pytest.FixtureRequest
) -> None:
    """Regression: a rank-0 adapter that owns tokens got ``[0, K]``/``[N, 0]`` gradients on the Triton
    path but None on the torch path and when it owned every token. It gets them on every path now;
    an adapter without tokens (here 2, and 0 when adapter 1 owns all) still gets None."""
    request.getfixturevalue(path)
    case = dataclasses.replace(RANK0, adapters=adapters)
    inputs = make_inputs(case, torch.float32)
    dy = torch.randn(case.t, case.n, generator=torch.Generator().manual_seed(2))
    y = run_fused(case, inputs, dy, seed=9)
    ref_in = detached(inputs, torch.float64)
    assert rel_rms(y, run_reference(case, ref_in, dy, seed=9)) < 1e-5
    owners = sorted(set(adapters))
    for key, empty in (("lora_a", (0, case.k)), ("lora_b", (case.n, 0))):
        assert [t.grad is not None for t in inputs[key]] == [a in owners for a in range(3)], key
        assert inputs[key][1].grad.shape == empty
        assert [t.grad is not None for t in ref_in[key]] == [a in owners for a in range(3)], "as the reference"


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize(
    "batch", [(MIXED.lengths, MIXED.adapters), ((43,), (1,)), ((0,), (0,)), ((43,), (3,))],
    ids=["mixed", "one-adapter", "no-tokens", "rank0-alone"],
)  # fmt: skip
@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"], ids=["negative", "over-63-bits", "float", "bool", "str"])
def test_a_bad_seed_is_refused_without_dropout(
    seed: object, batch: tuple[tuple[int, ...], tuple[int, ...]], path: str, request: pytest.FixtureRequest
) -> None:
    """Regression: at p = 0 the seed was never read, so a bad one passed until dropout was turned on."""
    request.getfixturevalue(path)
    lengths, adapters = batch
    case = dataclasses.replace(MIXED, lengths=lengths, adapters=adapters, ranks=(8, 16, 64, 0))
    inputs = make_inputs(case, torch.float32)
    args = (inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"])
    with pytest.raises(LoRAFusionKernelsError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        fused_multi_lora_linear(*args, scaling=1.0, segment_lengths=lengths, segment_adapters=adapters, seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize("adapters", [MIXED.adapters, (2,) * 6], ids=["mixed", "one-adapter"])
def test_float64_is_computed_in_float64(adapters: tuple[int, ...], path: str, request: pytest.FixtureRequest) -> None:
    """float64 (taken by FusedLoRA now too, which a one-adapter batch runs) matches the float64 reference
    to float64 rounding: output and every gradient, with dropout."""
    request.getfixturevalue(path)
    case = dataclasses.replace(MIXED, adapters=adapters)
    inputs = make_inputs(case, torch.float64)
    ref_in = detached(inputs, torch.float64)
    dy = torch.randn(case.t, case.n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y = run_fused(case, inputs, dy, seed=11)
    torch.testing.assert_close(y, run_reference(case, ref_in, dy, seed=11), rtol=1e-12, atol=1e-12)
    want = grads(ref_in)
    for name, grad in grads(inputs).items():
        assert grad.dtype == torch.float64, name
        torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=1e-12, msg=name)


def test_both_ops_take_the_same_input_dtypes() -> None:
    """Regression: FusedLoRA refused float64 and FusedMultiLoRA took it; FusedMultiLoRA took float8 and
    failed inside torch. Both take fp16, bf16, fp32 and fp64, and refuse the rest with one message."""
    inputs = make_inputs(NO_DROPOUT, torch.float32)
    x, weight, lora_a, lora_b = inputs["x"], inputs["weight"], inputs["lora_a"], inputs["lora_b"]
    segments = {"segment_lengths": NO_DROPOUT.lengths, "segment_adapters": NO_DROPOUT.adapters}

    def single(dtype: torch.dtype) -> torch.Tensor:
        return lora_module.fused_lora_linear(x.to(dtype), weight.to(dtype), lora_a[0], lora_b[0], scaling=1.0)

    def multi(dtype: torch.dtype) -> torch.Tensor:
        return fused_multi_lora_linear(x.to(dtype), weight.to(dtype), lora_a, lora_b, scaling=1.0, **segments)

    with torch.no_grad():
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            assert single(dtype).dtype == multi(dtype).dtype == dtype
    message = r"x must be float16, bfloat16, float32 or float64 \(float64 runs the plain torch path\), got torch.float8"
    for op in (single, multi):
        with pytest.raises(LoRAFusionKernelsError, match=message):
            op(torch.float8_e4m3fn)


@pytest.mark.parametrize("path", [pytest.param("interpreter", marks=INTERPRET), "torch_path"])
@pytest.mark.parametrize(
    ("dtype", "bias_dtype"),
    [(torch.float64, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float16)],
    ids=["fp64-x-fp32-bias", "fp16-x-fp32-bias", "fp32-x-fp16-bias"],
)
@pytest.mark.parametrize("lengths", [MIXED.lengths, (0,) * 6], ids=["tokens", "no-tokens"])
def test_a_bias_of_another_dtype_is_taken_on_every_path(
    lengths: tuple[int, ...], dtype: torch.dtype, bias_dtype: torch.dtype, path: str, request: pytest.FixtureRequest
) -> None:
    """Regression: the torch path (float64 included) and an empty batch raised torch's "self and mat2
    must have the same dtype" for a bias of another float dtype, which FusedLoRA and the kernels take."""
    request.getfixturevalue(path)
    case = dataclasses.replace(MIXED, lengths=lengths)
    inputs = make_inputs(case, dtype)
    inputs["bias"] = inputs["bias"].detach().to(bias_dtype).requires_grad_()
    ref_in = detached(inputs, torch.float64)
    dy = torch.randn(case.t, case.n, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = run_fused(case, inputs, dy, seed=3)
    assert y.dtype == dtype
    assert inputs["bias"].grad.dtype == bias_dtype
    if case.t:
        assert rel_rms(y, run_reference(case, ref_in, dy, seed=3)) < 1e-2
        assert rel_rms(inputs["bias"].grad, ref_in["bias"].grad) < 1e-2


@INTERPRET
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_backward_with_create_graph_is_refused(backend: str) -> None:
    """Regression: under ``torch.compile`` the custom ops' backward had no first-order guard. Without
    AOTAutograd it refuses a graph as the eager Function does; with it (inductor, aot_eager) nothing of
    ours runs at backward time: with aot_eager the first-order gradient is right and torch refuses the
    backward through it (``test_lora``'s test of the same name covers Inductor too)."""
    inputs = make_inputs(MIXED, torch.float32)
    leaves = [inputs["x"], *inputs["lora_a"], *inputs["lora_b"]]

    def fn(x: torch.Tensor, *ab: torch.Tensor) -> torch.Tensor:
        return fused_multi_lora_linear(
            x, inputs["weight"], list(ab[:4]), list(ab[4:]), segment_lengths=MIXED.lengths,
            segment_adapters=MIXED.adapters, scaling=MIXED.scaling, dropout_p=MIXED.dropout_p, seed=3,
        )  # fmt: skip

    torch._dynamo.reset()
    y = torch.compile(fn, backend=backend)(*leaves)
    if backend == "eager":
        with pytest.raises(LoRAFusionKernelsError, match="create_graph=True"):
            torch.autograd.grad(y.sum(), [inputs["x"]], create_graph=True)
        return
    (dx,) = torch.autograd.grad(y.sum(), [inputs["x"]], create_graph=True)
    (want,) = torch.autograd.grad(fn(*leaves).sum(), [inputs["x"]])
    torch.testing.assert_close(dx, want)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        dx.square().sum().backward()


# --------------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes (run on the device with LORAFUSION_REQUIRE_GPU=1)
# --------------------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param(
        Case(
            name="llama8b-o",
            lengths=(1500, 700, 1, 1895, 900, 1196),
            adapters=(0, 1, 2, 3, 1, 2),
            ranks=(8, 16, 64, 16),
            scaling=(2.0, 2.0, 0.5, 1.0),
            dropout_p=(0.1, 0.1, 0.05, 0.0),
            n=4096,
            k=4096,
        ),
        id="T6192-N4096-K4096-r8.16.64.16-bf16",
    ),
    pytest.param(
        Case(
            name="llama8b-qkv",
            lengths=(4096, 2048, 2048),
            adapters=(2, 0, 1),
            ranks=(16, 16, 16),
            scaling=(2.0, 2.0, 2.0),
            dropout_p=(0.1, 0.1, 0.1),
            n=6144,
            k=4096,
            bias=True,
        ),
        id="T8192-N6144-K4096-r16x3-bf16",
    ),
    pytest.param(
        Case(
            name="llama8b-down",
            lengths=(1000, 1048, 2048),
            adapters=(1, 0, 2),
            ranks=(16, 16, 16),
            scaling=(2.0, 2.0, 2.0),
            dropout_p=(0.1, 0.1, 0.1),
            n=4096,
            k=14336,
        ),
        id="T4096-N4096-K14336-r16x3-bf16",  # k > n: dx from the fused GEMM
    ),
    pytest.param(
        Case(
            name="llama8b-o-rank128",
            lengths=(3000, 4192, 1000),
            adapters=(0, 1, 2),
            ranks=(16, 128, 8),
            scaling=(2.0, 0.5, 1.0),
            dropout_p=(0.1, 0.1, 0.0),
            n=4096,
            k=4096,
        ),
        id="T8192-N4096-K4096-r16.128.8-bf16",  # rank tile 128: tuned tiles may not fit in shared memory
    ),
    pytest.param(
        Case(
            name="llama8b-gate_up-rank32",
            lengths=(2500, 1596, 2048, 2048),
            adapters=(3, 1, 0, 2),
            ranks=(32, 32, 32, 32),
            scaling=(2.0, 2.0, 1.0, 0.5),
            dropout_p=(0.1, 0.1, 0.1, 0.0),
            n=14336,
            k=4096,
        ),
        id="T8192-N14336-K4096-r32x4-bf16",  # the H100 file's rank-32 dS/dB entry of this width
    ),
]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")  # no config file for this GPU
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_bf16_real_shapes(case: Case) -> None:
    inputs = make_inputs(case, torch.float32)
    gpu = {
        k: ([t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in v] if isinstance(v, list) else v)
        for k, v in inputs.items()
    }
    for key in ("x", "weight", "bias"):
        if isinstance(inputs[key], torch.Tensor):
            src = inputs[key]
            gpu[key] = src.detach().cuda().to(torch.bfloat16).requires_grad_(src.requires_grad)
    ref_in = detached(gpu, torch.float64)
    eager_in = detached(gpu, torch.bfloat16)
    dy = torch.randn(case.t, case.n, device="cuda").to(torch.bfloat16)
    y = run_fused(case, gpu, dy, seed=77)
    y_ref = run_reference(case, ref_in, dy, 77)
    y_eager = run_reference(case, eager_in, dy, 77)
    assert_close_to_reference("y", y, y_ref, y_eager)
    ref_grads, eager_grads = grads(ref_in), grads(eager_in)
    for name, g in grads(gpu).items():
        assert_close_to_reference(name, g, ref_grads[name], eager_grads[name], factor=3.0)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")  # no config file for this GPU
@pytest.mark.parametrize("adapters", [1, 3], ids=["fusedlora", "multi"])
def test_gpu_a_transposed_weight_gives_the_contiguous_results(adapters: int) -> None:
    """A Conv1D-style ``W [K, N]`` passed as ``W.t()`` in bf16 at a real width, on both ops' GPU paths.

    One adapter takes FusedLoRA (whose kernels read any strides, without TMA); several take the
    multi-adapter kernels (which copy such a view to unit K stride first).
    """
    gen = torch.Generator(device="cuda").manual_seed(3)
    t, n, k, r = 2048, 1024, 4096, 16

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x, stored = rand(t, k, scale=1.0), rand(k, n, scale=k**-0.5)
    lora_a = [rand(r, k, scale=k**-0.5) for _ in range(adapters)]
    lora_b = [rand(n, r, scale=r**-0.5) for _ in range(adapters)]
    dy = rand(t, n, scale=1.0)
    lengths = [t // adapters] * (adapters - 1) + [t - (t // adapters) * (adapters - 1)]
    results = []
    for weight in (stored.t(), stored.t().contiguous()):
        leaves = [x.clone().requires_grad_(), *(p.clone().requires_grad_() for p in (*lora_a, *lora_b))]
        y = fused_multi_lora_linear(
            leaves[0], weight, leaves[1 : 1 + adapters], leaves[1 + adapters :], segment_lengths=lengths,
            segment_adapters=list(range(adapters)), scaling=2.0, dropout_p=0.1, seed=11,
        )  # fmt: skip
        y.backward(dy)
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
    for got, want in zip(*results, strict=True):
        assert rel_rms(got.float(), want.float()) < 1e-2


@pytest.mark.parametrize("interpreter", ["1", "0"], ids=["triton", "torch"])
def test_ranks_above_128_are_refused_on_every_path(interpreter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU torch path takes the kernels' limits, so code that runs here runs on a GPU too."""
    monkeypatch.setenv("TRITON_INTERPRET", interpreter)
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    a, b = [torch.randn(4, 8), torch.randn(200, 8)], [torch.randn(6, 4), torch.randn(6, 200)]
    with pytest.raises(LoRAFusionKernelsError, match="lora_a\\[1\\] has rank 200"):
        fused_multi_lora_linear(x, w, a, b, segment_lengths=[2, 3], segment_adapters=[0, 1], scaling=1.0)
