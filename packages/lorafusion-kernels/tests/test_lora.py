"""FusedLoRA on CPU: under TRITON_INTERPRET=1 these run the Triton kernels themselves, otherwise the torch path.

Every output and gradient is compared with the float64 reference (``lorafusion_kernels.reference``)
under the flash-attention rule (at most 2x / 3x the error of eager torch in the same dtype, plus a
relative-RMS floor). Shapes are small and odd (the interpreter runs a 1024x512x512 GEMM in ~2 s).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lorafusion_kernels.lora as lora_module
from lorafusion_kernels import FusedLoRALinear, LoRAFusionKernelsError, fused_lora_linear
from lorafusion_kernels._kernels._common import interpreting
from lorafusion_kernels._kernels.lora_dys_dyb import lora_dys_dyb
from lorafusion_kernels.reference import lora_linear_reference_seeded
from lorafusion_kernels.testing import assert_close_to_reference, case_id, make_lora_inputs
from lorafusion_kernels.tuning import KernelConfig, override_configs

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("nan_poison")]


def run_fused(inputs, *, scaling, p, seed, dy):
    y = fused_lora_linear(
        inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=scaling, dropout_p=p, bias=inputs.bias, seed=seed
    )
    leaves = inputs.leaves()
    return y, dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy), strict=True))


def run_reference(inputs, *, scaling, p, seed, dy):
    y = lora_linear_reference_seeded(
        inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=scaling, dropout_p=p, bias=inputs.bias, seed=seed
    )
    leaves = inputs.leaves()
    return y, dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype)), strict=True))


def check_against_reference(inputs, *, scaling=1.7, p=0.0, seed=5):
    n = inputs.weight.shape[0]
    dy = torch.randn((*inputs.x.shape[:-1], n), generator=torch.Generator().manual_seed(99)).to(inputs.x.dtype)
    y, grads = run_fused(inputs, scaling=scaling, p=p, seed=seed, dy=dy)
    ref_y, ref_grads = run_reference(inputs.to(torch.float64), scaling=scaling, p=p, seed=seed, dy=dy)
    eager_y, eager_grads = run_reference(inputs, scaling=scaling, p=p, seed=seed, dy=dy)
    assert set(grads) == set(ref_grads)
    assert_close_to_reference("y", y, ref_y, eager_y)
    for name in grads:
        assert_close_to_reference(f"d{name}", grads[name], ref_grads[name], eager_grads[name], factor=3.0)


# (m, n, k, r, lead): M, N, K are multiples of no block size; ranks 1/8/16/64; 2-D and 3-D.
SHAPES = [
    (37, 45, 29, 8, None),
    (70, 33, 90, 1, None),
    (19, 64, 48, 16, None),
    (33, 40, 72, 64, None),
    (None, 37, 52, 16, (2, 19)),
]
SHAPE_IDS = [case_id(s[0] or "x".join(map(str, s[4])), *s[1:4], torch.float32).removesuffix("-fp32") for s in SHAPES]


@pytest.mark.parametrize("p", [0.0, 0.25], ids=["p0", "p0.25"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "n", "k", "r", "lead"), SHAPES, ids=SHAPE_IDS)
def test_matches_float64_reference(m, n, k, r, lead, dtype, p):
    inputs = make_lora_inputs(m or 0, n, k, r, dtype=dtype, lead=lead, seed=m or 3)
    check_against_reference(inputs, p=p)


@pytest.mark.parametrize("bias_grad", [False, True], ids=["bias-frozen", "bias-grad"])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
def test_bias_with_and_without_grad(p, bias_grad):
    inputs = make_lora_inputs(29, 35, 41, 8, dtype=torch.float32, bias=True, bias_grad=bias_grad)
    check_against_reference(inputs, p=p)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
def test_a_trainable_base_weight_gets_its_gradient(p):
    inputs = make_lora_inputs(29, 35, 41, 8, dtype=torch.float32, bias=True, bias_grad=True)
    inputs.weight.requires_grad_(True)
    check_against_reference(inputs, p=p)


def test_a_strided_bias_is_read_as_its_values():
    """The kernels read the bias at unit stride; a view with another stride is copied, not misread."""
    inputs = make_lora_inputs(29, 35, 41, 8, dtype=torch.float32)
    wide = torch.randn(70, generator=torch.Generator().manual_seed(4))
    strided, packed = wide[::2], wide[::2].contiguous()
    args = (inputs.x.detach(), inputs.weight, inputs.lora_a.detach(), inputs.lora_b.detach())
    torch.testing.assert_close(
        fused_lora_linear(*args, scaling=1.5, bias=strided), fused_lora_linear(*args, scaling=1.5, bias=packed)
    )


@pytest.mark.parametrize("loss", [torch.sum, lambda y: y.square().sum()], ids=["penalty", "double"])
def test_a_backward_with_create_graph_is_refused(loss):
    """A gradient penalty's dy (from y.sum()) does not require grad: once_differentiable alone let it
    through, and the penalty silently lost its second-order term."""
    inputs = make_lora_inputs(9, 12, 16, 4, dtype=torch.float32)
    y = fused_lora_linear(inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=1.0)
    with pytest.raises(LoRAFusionKernelsError, match="create_graph=True"):
        torch.autograd.grad(loss(y), [inputs.x], create_graph=True)


TORCH_REFUSES_DOUBLE_BACKWARD = "does not currently support double backward|requires create_graph=False"
"""torch's refusals of a double backward through an AOTAutograd-compiled function (docs/kernels/index.md)."""


def second_backward(loss, x, first_order):
    """The gradient with ``create_graph=True`` (checked against ``first_order``), then a backward through it."""
    (dx,) = torch.autograd.grad(loss, [x], create_graph=True)
    torch.testing.assert_close(dx, first_order)
    dx.square().sum().backward()


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("loss", [torch.sum, lambda y: y.square().sum()], ids=["penalty", "double"])
def test_a_compiled_backward_with_create_graph_is_refused(backend, loss):
    """Regression: under ``torch.compile`` the custom ops' backward had no first-order guard.

    Without AOTAutograd (``backend="eager"``) the backward runs when asked, and refuses a graph as the
    eager Function does (it used to return a gradient whose backward failed with torch's "no autograd
    formula" error). AOTAutograd backends (inductor, aot_eager) trace the backward ahead of time, so
    nothing of ours runs then: torch refuses, at the backward through the gradient (which is right to
    first order), or at the ``create_graph=True`` call where Inductor's backward donates its buffers.
    """
    inputs = make_lora_inputs(9, 12, 16, 4, dtype=torch.float32, bias=True, bias_grad=True)
    leaves = list(inputs.leaves().values())

    def fn(x, a, b, bias):
        return fused_lora_linear(x, inputs.weight, a, b, scaling=1.5, dropout_p=0.2, bias=bias, seed=4)

    torch._dynamo.reset()
    y = torch.compile(fn, backend=backend)(*leaves)
    if backend == "eager":
        with pytest.raises(LoRAFusionKernelsError, match="create_graph=True"):
            torch.autograd.grad(loss(y), [inputs.x], create_graph=True)
        return
    (want,) = torch.autograd.grad(loss(fn(*leaves)), [inputs.x])
    with pytest.raises(RuntimeError, match=TORCH_REFUSES_DOUBLE_BACKWARD):
        second_backward(loss(y), inputs.x, want)


def test_the_custom_op_called_directly_refuses_create_graph():
    inputs = make_lora_inputs(9, 12, 16, 4, dtype=torch.float32)
    seed = torch.zeros(1, dtype=torch.int64)
    y, _ = torch.ops.lorafusion.fused_lora_forward(
        inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, None, seed, 1.0, 0.0, None
    )
    with pytest.raises(LoRAFusionKernelsError, match="create_graph=True"):
        torch.autograd.grad(y.sum(), [inputs.x], create_graph=True)
    (dx,) = torch.autograd.grad(y.sum(), [inputs.x])  # first order, as ever
    assert dx.shape == inputs.x.shape


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"], ids=["negative", "over-63-bits", "float", "bool", "str"])
def test_a_bad_seed_is_refused_whatever_p(seed, p):
    """Regression: at p = 0 the seed was never read, so a bad one passed until dropout was turned on."""
    inputs = make_lora_inputs(5, 16, 8, 4, dtype=torch.float32)
    with pytest.raises(LoRAFusionKernelsError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        fused_lora_linear(inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=1.0, dropout_p=p, seed=seed)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["p0", "p0.3"])
def test_float64_runs_the_torch_path_in_float64(p):
    """Regression: FusedLoRA refused float64 where FusedMultiLoRA took it; both now compute it in float64.

    The plain torch path used to compute in fp32 whatever the dtype, so it must match the float64
    reference to float64 rounding, output and every gradient (bias included).
    """
    inputs = make_lora_inputs(23, 19, 31, 8, dtype=torch.float64, bias=True, bias_grad=True)
    dy = torch.randn(23, 19, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y, grads = run_fused(inputs, scaling=1.7, p=p, seed=5, dy=dy)
    ref_y, ref_grads = run_reference(inputs, scaling=1.7, p=p, seed=5, dy=dy)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    for name, grad in grads.items():
        assert grad.dtype == torch.float64, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-12, atol=1e-12, msg=name)
    layer = FusedLoRALinear(31, 19, 8, dtype=torch.float64)
    assert layer(inputs.x.detach()).dtype == torch.float64


def test_bf16_on_the_cpu_takes_the_torch_path():
    """The interpreter's tl.dot is wrong on bf16, so bf16 CPU tensors never reach the kernels."""
    inputs = make_lora_inputs(21, 30, 40, 4, dtype=torch.bfloat16)
    check_against_reference(inputs, p=0.1)


def test_x_without_grad_skips_dx():
    inputs = make_lora_inputs(21, 30, 40, 4, dtype=torch.float32)
    inputs.x.requires_grad_(False)
    check_against_reference(inputs, p=0.1)


@pytest.mark.parametrize(
    "configs",
    [
        {
            "xa": KernelConfig(block_m=16, block_n=16, block_k=16, split=3, num_stages=1),
            "dys_dyb": KernelConfig(block_m=16, block_n=16, block_k=16, split=2, num_stages=1),
            "dsx": KernelConfig(block_m=16, block_n=16, block_k=16, split=3, num_stages=1),
        },
        {
            "xw_sb": KernelConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=1, tma=True),
            "dyw_dsa": KernelConfig(block_m=32, block_n=16, block_k=16, group_m=2, num_stages=1, tma=True),
        },
    ],
    ids=["split-reductions", "tma-descriptors"],
)
def test_other_kernel_paths(configs):
    inputs = make_lora_inputs(45, 48, 56, 16, dtype=torch.float32, bias=True, bias_grad=True)
    with override_configs(configs):
        check_against_reference(inputs, p=0.2)


@pytest.mark.parametrize(("a_dtype", "b_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.float16)])
def test_lora_parameters_in_another_dtype(a_dtype, b_dtype):
    """fp32 adapters on an fp16 layer (PEFT's autocast_adapter_dtype): gradients come back in each parameter's dtype.

    The kernels cast A and B to x's dtype, so with parameters that fp16 holds exactly the result must be
    the all-fp16 run's, except that dA and dB skip the final rounding to fp16.
    """
    inputs = make_lora_inputs(37, 45, 29, 8, dtype=torch.float16)
    dy = torch.randn(37, 45, generator=torch.Generator().manual_seed(2)).half()
    results = []
    for dtypes in ((a_dtype, b_dtype), (torch.float16, torch.float16)):
        a, b = (t.detach().to(d).requires_grad_() for t, d in zip((inputs.lora_a, inputs.lora_b), dtypes, strict=True))
        y = fused_lora_linear(inputs.x, inputs.weight, a, b, scaling=1.7, dropout_p=0.25, seed=5)
        results.append((y, *torch.autograd.grad(y, [inputs.x, a, b], dy)))
    (y, dx, da, db), (y16, dx16, da16, db16) = results
    assert (da.dtype, db.dtype) == (a_dtype, b_dtype)
    assert torch.equal(y, y16)
    assert torch.equal(dx, dx16)
    torch.testing.assert_close(da.half(), da16, rtol=0, atol=0)
    torch.testing.assert_close(db.half(), db16, rtol=0, atol=0)


def test_deterministic_mode_is_reproducible_and_matches(monkeypatch):
    inputs = make_lora_inputs(45, 40, 56, 8, dtype=torch.float32)
    dy = torch.randn(45, 40, generator=torch.Generator().manual_seed(1))
    split = {"dys_dyb": KernelConfig(block_m=16, block_n=16, block_k=16, split=2, num_stages=1)}
    with override_configs(split):
        _, atomic = run_fused(inputs, scaling=2.0, p=0.2, seed=3, dy=dy)
        monkeypatch.setenv("LORAFUSION_DETERMINISTIC", "1")
        _, first = run_fused(inputs, scaling=2.0, p=0.2, seed=3, dy=dy)
        _, second = run_fused(inputs, scaling=2.0, p=0.2, seed=3, dy=dy)
    for name in first:
        assert torch.equal(first[name], second[name]), name
        torch.testing.assert_close(first[name], atomic[name], rtol=1e-4, atol=1e-5)


def test_same_seed_same_output_and_different_seed_differs():
    inputs = make_lora_inputs(24, 20, 36, 8, dtype=torch.float32)
    args = (inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b)
    a = fused_lora_linear(*args, scaling=1.0, dropout_p=0.5, seed=42)
    b = fused_lora_linear(*args, scaling=1.0, dropout_p=0.5, seed=42)
    c = fused_lora_linear(*args, scaling=1.0, dropout_p=0.5, seed=43)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(7)
    d = fused_lora_linear(*args, scaling=1.0, dropout_p=0.5)
    torch.manual_seed(7)
    e = fused_lora_linear(*args, scaling=1.0, dropout_p=0.5)
    assert torch.equal(d, e), "an unseeded call must follow torch.manual_seed"


def test_finite_differences_agree_with_backward():
    """The loss is linear in each of x, A and B alone, so a central difference is exact up to rounding."""
    inputs = make_lora_inputs(23, 31, 27, 8, dtype=torch.float32)
    w = torch.randn(23, 31, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)

    def loss(x, a, b):
        return (fused_lora_linear(x, inputs.weight, a, b, scaling=1.5, dropout_p=0.3, seed=11) * w).sum()

    x, a, b = inputs.x, inputs.lora_a, inputs.lora_b
    grads = torch.autograd.grad(loss(x, a, b), [x, a, b])
    with torch.no_grad():
        for i, (g, base) in enumerate(zip(grads, (x, a, b), strict=True)):
            v = torch.randn(base.shape, generator=gen)
            plus = [t.detach().clone() for t in (x, a, b)]
            minus = [t.detach().clone() for t in (x, a, b)]
            plus[i] += v
            minus[i] -= v
            fd = (loss(*plus) - loss(*minus)).double() / 2
            analytic = (g.double() * v).sum()
            assert abs(fd - analytic) <= 1e-4 * max(1.0, abs(float(analytic))), (i, float(fd), float(analytic))


def test_zero_b_gives_exactly_the_frozen_layer():
    """Dropout acts on the LoRA branch only: with B = 0, any p gives the same bits as p = 0."""
    inputs = make_lora_inputs(37, 45, 29, 8, dtype=torch.float16, bias=True, zero_b=True)
    args = (inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b)
    dy = torch.randn(37, 45, generator=torch.Generator().manual_seed(2)).half()
    ys, dxs = [], []
    for p in (0.0, 0.5, 0.9):
        y = fused_lora_linear(*args, scaling=4.0, dropout_p=p, bias=inputs.bias, seed=1)
        (dx,) = torch.autograd.grad(y, [inputs.x], dy)
        ys.append(y)
        dxs.append(dx)
    frozen = torch.nn.functional.linear(inputs.x.float(), inputs.weight.float(), inputs.bias.float())
    for y, dx in zip(ys, dxs, strict=True):
        assert torch.equal(y, ys[0])
        assert torch.equal(dx, dxs[0])
    torch.testing.assert_close(ys[0].float(), frozen, rtol=2e-3, atol=2e-3)


def test_torch_path_matches_reference(monkeypatch):
    """The plain torch path (CPU without the interpreter) is exercised even when interpreting."""
    monkeypatch.setattr(lora_module, "runs_triton", lambda t: False)
    inputs = make_lora_inputs(31, 26, 34, 8, dtype=torch.float32, bias=True, bias_grad=True)
    check_against_reference(inputs, p=0.2)


@pytest.mark.skipif(not interpreting(), reason="checks that the interpreter path runs the Triton kernels")
def test_interpreter_runs_the_triton_kernels(monkeypatch):
    calls = []
    real = lora_module.lora_xw_sb
    monkeypatch.setattr(lora_module, "lora_xw_sb", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = make_lora_inputs(17, 18, 19, 4, dtype=torch.float32)
    fused_lora_linear(inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=1.0)
    assert calls == [1]


def test_torch_compile_traces_the_custom_ops():
    inputs = make_lora_inputs(20, 24, 28, 8, dtype=torch.float32)

    def fn(x, a, b):
        return fused_lora_linear(x, inputs.weight, a, b, scaling=2.0, dropout_p=0.2, seed=3).sin()

    eager = fn(inputs.x, inputs.lora_a, inputs.lora_b)
    compiled_fn = torch.compile(fn, backend="aot_eager", fullgraph=False)
    compiled = compiled_fn(inputs.x, inputs.lora_a, inputs.lora_b)
    torch.testing.assert_close(compiled, eager)
    g_eager = torch.autograd.grad(eager.sum(), [inputs.lora_a, inputs.lora_b])
    g_comp = torch.autograd.grad(compiled.sum(), [inputs.lora_a, inputs.lora_b])
    for got, want in zip(g_comp, g_eager, strict=True):
        torch.testing.assert_close(got, want)


def test_custom_ops_are_registered():
    assert hasattr(torch.ops.lorafusion, "fused_lora_forward")
    assert hasattr(torch.ops.lorafusion, "fused_lora_backward")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lora_a": torch.zeros(129, 16), "lora_b": torch.zeros(8, 129)}, "rank"),
        ({"lora_b": torch.zeros(9, 4)}, "lora_b must be"),
        ({"weight": torch.zeros(8, 16, dtype=torch.float16)}, "dtype"),
        ({"x": torch.zeros(3, 15)}, "in_features"),
        ({"bias": torch.zeros(7)}, "bias must be"),
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"x": torch.zeros(3, 16, dtype=torch.int32), "weight": torch.zeros(8, 16, dtype=torch.int32)}, "float16"),
        ({"bias": torch.zeros(8, dtype=torch.int64)}, "bias must be floating point"),
        ({"x": torch.zeros(3, 0), "weight": torch.zeros(8, 0), "lora_a": torch.zeros(4, 0)}, "in_features"),
        ({"scaling": None}, "scaling must be a finite number, got None"),
        ({"scaling": float("nan")}, "scaling must be a finite number, got nan"),
        ({"dropout_p": None}, "dropout_p must be a finite number, got None"),
        ({"dropout_p": "0.1"}, "dropout_p must be a finite number, got '0.1'"),
        ({"x": torch.tensor(1.0)}, "got a 0-d tensor"),
        ({"deterministic": "yes"}, "deterministic must be None, True or False"),
        ({"seed": 1.5, "dropout_p": 0.1}, "seed must be an integer"),
        (
            {"lora_a": [torch.zeros(4, 16)]},
            r"lora_a must be a tensor, got list \(several adapters: fused_multi_lora_linear\)",
        ),
        ({"bias": [0.0] * 8}, "bias must be a tensor or None, got list"),
    ],
    ids=[
        "rank-129",
        "b-shape",
        "weight-dtype",
        "in-features",
        "bias-shape",
        "p-1",
        "int-input",
        "int-bias",
        "k-0",
        "scaling-none",
        "scaling-nan",
        "p-none",
        "p-str",
        "x-0d",
        "deterministic-str",
        "seed-float",
        "a-list",
        "bias-list",
    ],
)
def test_bad_inputs_raise_one_error_type(change, message):
    args = {
        "x": torch.zeros(3, 16),
        "weight": torch.zeros(8, 16),
        "lora_a": torch.zeros(4, 16),
        "lora_b": torch.zeros(8, 4),
        "bias": None,
        "dropout_p": 0.0,
        "scaling": 1.0,
        "seed": None,
        "deterministic": None,
    }
    args.update(change)
    with pytest.raises(LoRAFusionKernelsError, match=message):
        fused_lora_linear(
            args["x"], args["weight"], args["lora_a"], args["lora_b"], scaling=args["scaling"],
            dropout_p=args["dropout_p"], bias=args["bias"], seed=args["seed"], deterministic=args["deterministic"],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"x": (3, 15)}, r"x has 15 features where weight has 16: x must be \[\.\.\., 16\]"),
        ({"lora_a": (4, 15)}, r"lora_a has 15 columns where x and weight have 16: lora_a must be \[r, 16\]"),
        ({"lora_a": (16, 4), "lora_b": (8, 16)}, r"lora_a has 4 columns .* lora_a must be \[r, 16\]"),
        ({"weight": (8, 15)}, r"weight has 15 in_features where x and lora_a have 16: weight must be \[N, 16\]"),
    ],
    ids=["x", "lora_a", "lora_a-transposed", "weight"],
)
def test_an_in_features_mismatch_names_the_odd_tensor(shapes, message):
    """Regression: a wrong ``x`` was reported as "lora_a must be [r, K]", pointing at the wrong tensor."""
    args = {"x": (3, 16), "weight": (8, 16), "lora_a": (4, 16), "lora_b": (8, 4)} | shapes
    tensors = {name: torch.zeros(shape) for name, shape in args.items()}
    with pytest.raises(LoRAFusionKernelsError, match=message):
        fused_lora_linear(tensors["x"], tensors["weight"], tensors["lora_a"], tensors["lora_b"], scaling=1.0)


def test_a_dtype_mismatch_says_how_to_fix_it():
    with pytest.raises(
        LoRAFusionKernelsError,
        match=r"weight dtype torch.float16 must match x dtype torch.float32: cast x \(or the weight\) .*torch.autocast",
    ):
        fused_lora_linear(
            torch.zeros(3, 16), torch.zeros(8, 16, dtype=torch.float16), torch.zeros(4, 16), torch.zeros(8, 4),
            scaling=1.0,
        )  # fmt: skip


@pytest.mark.parametrize("name", ["scaling", "dropout_p"])
def test_a_scaling_or_p_tensor_that_requires_grad_is_refused(name):
    """Regression: ``scaling=torch.tensor(2.0, requires_grad=True)`` was read with ``.item()``: the
    output did not require grad and the "learnable" scale silently got no gradient."""
    inputs = make_lora_inputs(5, 16, 8, 4, dtype=torch.float32)
    args = (inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b)
    kw = {"scaling": 2.0, "dropout_p": 0.25, "seed": 3}
    trainable = torch.tensor(kw[name], requires_grad=True)
    with pytest.raises(LoRAFusionKernelsError, match=rf"{name} is a runtime constant; it gets no gradient"):
        fused_lora_linear(*args, **{**kw, name: trainable})
    torch.testing.assert_close(
        fused_lora_linear(*args, **{**kw, name: trainable.detach()}), fused_lora_linear(*args, **kw)
    )


def test_numpy_scalars_and_0d_tensors_are_numbers():
    inputs = make_lora_inputs(5, 16, 8, 4, dtype=torch.float32)
    args = (inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b)
    expected = fused_lora_linear(*args, scaling=2.0, dropout_p=0.25, seed=3)
    for scaling, p in ((np.float32(2.0), np.float64(0.25)), (torch.tensor(2.0), torch.tensor(0.25))):
        torch.testing.assert_close(fused_lora_linear(*args, scaling=scaling, dropout_p=p, seed=3), expected)


@pytest.mark.parametrize("kwargs", [{"dropout_p": 1.5}, {"dropout_p": None}, {"lora_alpha": float("inf")}])
def test_the_module_refuses_bad_hyperparameters_when_built(kwargs):
    """Regression: ``dropout_p=1.5`` was accepted and failed only at the first training-mode forward."""
    with pytest.raises(LoRAFusionKernelsError):
        FusedLoRALinear(8, 8, 4, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((8, 8, 8.0), {}, "r must be an integer, got float 8.0"),
        ((8, 8, "8"), {}, "r must be an integer, got str '8'"),
        ((8, 8, True), {}, "r must be an integer, got bool True"),
        ((8, 8, 0), {}, "r must be at least 1, got 0"),
        ((8, 8, 129), {}, r"LoRA rank must be in \[1, 128\], got 129"),
        ((0, 8, 4), {}, "in_features must be at least 1, got 0"),
        ((8, -1, 4), {}, "out_features must be at least 1, got -1"),
        ((8.0, 8, 4), {}, "in_features must be an integer, got float 8.0"),
        ((8, 8, 4), {"dtype": torch.int64}, r"dtype must be a floating-point torch.dtype .* got torch.int64"),
        ((8, 8, 4), {"dtype": "float16"}, r"dtype must be a floating-point torch.dtype .* got 'float16'"),
    ],
    ids=["r-float", "r-str", "r-bool", "r-0", "r-129", "in-0", "out-negative", "in-float", "int-dtype", "str-dtype"],
)
def test_the_module_refuses_bad_shapes_and_dtypes_when_built(args, kwargs, message):
    """Regression: ``r=8.0`` raised ``TypeError`` from ``torch.empty``, ``in_features=0`` a
    ``ZeroDivisionError`` in ``reset_parameters`` and an integer dtype torch's "only floating point
    tensors can require gradients"."""
    with pytest.raises(LoRAFusionKernelsError, match=message):
        FusedLoRALinear(*args, **kwargs)


def test_numpy_integer_widths_and_rank_are_taken():
    layer = FusedLoRALinear(np.int64(8), np.int32(6), np.int64(4))
    assert (layer.in_features, layer.out_features, layer.r) == (8, 6, 4)
    assert layer.lora_a.shape == (4, 8)


@pytest.mark.parametrize(
    "module",
    [torch.nn.Conv1d(8, 8, 1), torch.nn.Embedding(10, 8), torch.nn.Identity()],
    ids=["conv1d", "embedding", "identity"],
)
def test_from_linear_refuses_other_modules(module):
    """Regression: ``from_linear(nn.Conv1d(...))`` raised ``AttributeError: ... no attribute 'in_features'``."""
    with pytest.raises(LoRAFusionKernelsError, match=rf"from_linear wraps an nn.Linear, got {type(module).__name__}"):
        FusedLoRALinear.from_linear(module, 4)


def test_module_starts_as_the_frozen_layer_and_trains():
    base = torch.nn.Linear(24, 20)
    layer = FusedLoRALinear.from_linear(base, 8, lora_alpha=16, dropout_p=0.1)
    assert layer.scaling == 2.0
    assert "r=8" in repr(layer)
    x = torch.randn(3, 5, 24)
    layer.eval()
    torch.testing.assert_close(layer(x), base(x), rtol=1e-6, atol=1e-6)
    layer.train()
    layer(x).square().mean().backward()
    assert layer.lora_b.grad is not None
    assert layer.lora_b.grad.abs().sum() > 0
    assert layer.weight.grad is None
    assert FusedLoRALinear(4, 4, 16, lora_alpha=8, use_rslora=True).scaling == pytest.approx(2.0)
    with pytest.raises(LoRAFusionKernelsError):
        FusedLoRALinear(4, 4, 0)


def test_module_under_autocast_computes_as_nn_linear_would():
    """fp32 parameters under autocast to fp16: the op runs on fp16 input, weight and bias, the adapters as they are."""
    layer = FusedLoRALinear(24, 20, 8, lora_alpha=16)
    torch.nn.init.normal_(layer.lora_b, std=0.1)
    x = torch.randn(3, 5, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16
    expected = fused_lora_linear(
        x.half(), layer.weight.half(), layer.lora_a, layer.lora_b, scaling=2.0, bias=layer.bias.half()
    )
    assert torch.equal(y, expected)
    y.float().square().sum().backward()
    assert x.grad is not None
    assert x.grad.dtype == layer.lora_a.grad.dtype == torch.float32


def test_a_float64_module_under_autocast_stays_float64_as_nn_linear_does():
    """Autocast casts no float64 tensor: nn.Linear computes in float64 there, and so does the module."""
    layer = FusedLoRALinear(24, 20, 8, lora_alpha=16, dtype=torch.float64)
    torch.nn.init.normal_(layer.lora_b, std=0.1)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    linear = torch.nn.Linear(24, 20, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        assert linear(x).dtype == torch.float64
    assert y.dtype == torch.float64
    assert torch.equal(y, layer(x))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    ("block_n", "split"),
    [(64, 1), (64, 3), (16, 1), (16, 4)],
    ids=["one-block", "one-block-3-groups", "blocks", "blocks-4-groups"],
)
def test_dys_dyb_column_blocks_and_row_groups(block_n: int, split: int) -> None:
    """dS stored (one column block covers N) or summed by atomics (several); dB from one row group or several."""
    m, n, r = 53, 40, 8
    gen = torch.Generator().manual_seed(4)
    dy, b, s = (torch.randn(shape, generator=gen) for shape in ((m, n), (n, r), (m, r)))
    config = KernelConfig(block_m=16, block_n=block_n, block_k=16, split=split, num_stages=1)
    ds, db = lora_dys_dyb(dy, b, s, scaling=0.5, config=config)
    torch.testing.assert_close(ds.double(), 0.5 * dy.double() @ b.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.double(), 0.5 * dy.double().T @ s.double(), rtol=1e-5, atol=1e-5)
