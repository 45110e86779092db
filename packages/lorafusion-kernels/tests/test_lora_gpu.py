"""GPU tests (marker ``gpu``): bf16 at real layer shapes, torch.compile, and a PEFT training loop."""

from __future__ import annotations

import pytest
import torch

import lorafusion_kernels._kernels._common as common
from lorafusion_kernels import FusedLoRALinear, fused_lora_linear, fused_multi_lora_linear
from lorafusion_kernels._kernels.dropout import dropout_keep_mask_triton
from lorafusion_kernels.dropout import dropout_keep_mask, keep_threshold, seed_tensor
from lorafusion_kernels.reference import lora_linear_reference_seeded
from lorafusion_kernels.testing import assert_close_to_reference, case_id, make_lora_inputs
from lorafusion_kernels.tuning import gpu_key
from lorafusion_kernels.tuning.config import KernelConfig, config_dir, load_config_file, override_configs

pytestmark = [
    pytest.mark.gpu,
    # A GPU without a shipped config file warns once (heuristic configs); that is not a failure here.
    pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning"),
]

REAL_SHAPES = [
    # (m, n, k, r, lead): LLaMa-3.1-8B o_proj and qkv, a ragged M, Qwen-32B down_proj, 3-D input.
    (4096, 4096, 4096, 16, None),
    (4133, 6144, 4096, 64, None),
    (2048, 5120, 27648, 16, None),
    (None, 8192, 8192, 32, (2, 1031)),
    # Rank 128 (the rank tile's largest): tiles tuned at smaller ranks may not fit in shared memory.
    (8192, 4096, 4096, 128, None),
]


def _run(inputs, *, scaling, p, seed, dy):
    y = fused_lora_linear(
        inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=scaling, dropout_p=p, bias=inputs.bias, seed=seed
    )
    leaves = inputs.leaves()
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    return y, dict(zip(leaves, grads, strict=True))


def _reference(inputs, *, scaling, p, seed, dy):
    y = lora_linear_reference_seeded(
        inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, scaling=scaling, dropout_p=p, bias=inputs.bias, seed=seed
    )
    leaves = inputs.leaves()
    grads = torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype))
    return y, dict(zip(leaves, grads, strict=True))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize(
    ("m", "n", "k", "r", "lead"),
    REAL_SHAPES,
    ids=[case_id(s[0] or "x".join(map(str, s[4])), *s[1:4], torch.bfloat16) for s in REAL_SHAPES],
)
def test_bf16_real_shapes_match_float64(m, n, k, r, lead, p, deterministic, monkeypatch):
    if deterministic:
        monkeypatch.setenv("LORAFUSION_DETERMINISTIC", "1")
    inputs = make_lora_inputs(
        m or 0, n, k, r, dtype=torch.bfloat16, device="cuda", lead=lead, bias=True, bias_grad=True
    )
    dy = torch.randn((*inputs.x.shape[:-1], n), device="cuda", dtype=torch.bfloat16)
    y, grads = _run(inputs, scaling=2.0, p=p, seed=1234, dy=dy)
    ref_y, ref_grads = _reference(inputs.to(torch.float64), scaling=2.0, p=p, seed=1234, dy=dy)
    eager_y, eager_grads = _reference(inputs, scaling=2.0, p=p, seed=1234, dy=dy)
    assert_close_to_reference("y", y, ref_y, eager_y)
    for name in grads:
        assert_close_to_reference(f"d{name}", grads[name], ref_grads[name], eager_grads[name], factor=3.0)


def test_triton_mask_equals_torch_mirror_on_gpu():
    seed = 2**40 + 17
    triton_mask = dropout_keep_mask_triton(seed_tensor(seed, "cuda"), 4099, 14336, keep_threshold(0.1))
    torch_mask = dropout_keep_mask(seed, 4099, 14336, 0.1, device="cuda")
    assert torch.equal(triton_mask, torch_mask)
    assert abs(torch_mask.float().mean().item() - 0.9) < 1e-3


def test_deterministic_backward_is_bitwise_reproducible(monkeypatch):
    monkeypatch.setenv("LORAFUSION_DETERMINISTIC", "1")
    inputs = make_lora_inputs(3000, 4096, 4096, 16, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(3000, 4096, device="cuda", dtype=torch.bfloat16)
    _, first = _run(inputs, scaling=2.0, p=0.1, seed=7, dy=dy)
    _, second = _run(inputs, scaling=2.0, p=0.1, seed=7, dy=dy)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_torch_compile_matches_eager_fused():
    layer = FusedLoRALinear(1024, 768, 16, lora_alpha=32, dropout_p=0.1, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.lora_b, std=0.02)

    def block(x: torch.Tensor) -> torch.Tensor:
        # An explicit seed: a compiled graph draws random numbers with Inductor's RNG, not eager torch's.
        y = fused_lora_linear(
            x, layer.weight, layer.lora_a, layer.lora_b, scaling=layer.scaling, dropout_p=0.1, bias=layer.bias, seed=11
        )
        return torch.nn.functional.gelu(y)

    compiled = torch.compile(block)
    x = torch.randn(4, 300, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_c = compiled(x)
    y_c.float().square().mean().backward()
    grads_c = (x.grad.clone(), layer.lora_a.grad.clone(), layer.lora_b.grad.clone())
    x.grad = layer.lora_a.grad = layer.lora_b.grad = None
    y_e = block(x)
    y_e.float().square().mean().backward()
    torch.testing.assert_close(y_c, y_e, rtol=2e-2, atol=2e-3)
    for got, want in zip(grads_c, (x.grad, layer.lora_a.grad, layer.lora_b.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)


@pytest.mark.together
def test_peft_training_loss_matches_unpatched():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import lorafusion_kernels

    def train(patched: bool) -> list[float]:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=256,
        )
        model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
        model = peft.get_peft_model(model, lora)
        if patched:
            assert lorafusion_kernels.patch_peft_model(model) == 14
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        gen = torch.Generator(device="cuda").manual_seed(1)
        # Eight fixed batches, visited in turn: learnable, so the loss curve has a shape to compare.
        batches = [torch.randint(0, 512, (4, 128), device="cuda", generator=gen) for _ in range(8)]
        losses = []
        for step in range(30):
            ids = batches[step % 8]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    plain = train(False)
    fused = train(True)
    assert plain[-1] < plain[0] - 0.1, "the reference run must learn something"
    for step, (a, b) in enumerate(zip(plain, fused, strict=True)):
        assert abs(a - b) <= 2e-2 * abs(a), (step, a, b)


@pytest.mark.usefixtures("fresh_fitting_memo")
def test_rank_128_runs_as_tuned_where_the_file_has_rank_128_entries():
    """Where this GPU's file was tuned at rank 128 (H100), no launch at rank 128 needs fewer stages to fit."""
    shipped = load_config_file(config_dir() / f"{gpu_key(torch.cuda.get_device_name())}.json")
    if shipped is None or not any(e.key.r == 128 for e in shipped.kernels["xw_sb"].entries):
        pytest.skip("this GPU's file has no rank-128 entries: its launches at rank 128 may run with fewer stages")
    m, n, k = 8192, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    a = [(torch.randn(r, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_() for r in (16, 128)]
    b = [(torch.randn(n, r, device="cuda", dtype=torch.bfloat16) / r**0.5).requires_grad_() for r in (16, 128)]
    fused_lora_linear(x, w, a[1], b[1], scaling=2.0, dropout_p=0.1).sum().backward()
    fused_multi_lora_linear(
        x, w, a, b, segment_lengths=[4000, 4192], segment_adapters=[0, 1], scaling=2.0, dropout_p=0.1
    ).sum().backward()
    torch.cuda.synchronize()
    assert common._FITTING_STAGES == {}, "launches that needed fewer stages than their rank-128 entry"


def _chunked_matmul(a: torch.Tensor, b: torch.Tensor, rows: int = 32768) -> torch.Tensor:
    """``a @ b`` in fp32, ``rows`` rows of ``a`` at a time (no fp32 copy of a tensor of 2**31 elements)."""
    return torch.cat([a[i : i + rows].float() @ b.float() for i in range(0, a.shape[0], rows)])


def _chunked_t_matmul(p: torch.Tensor, q: torch.Tensor, rows: int = 32768) -> torch.Tensor:
    """``p^T q`` in fp32, summed over ``rows`` rows at a time."""
    return sum(p[i : i + rows].float().T @ q[i : i + rows].float() for i in range(0, p.shape[0], rows))


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_tensors_past_2_to_the_31_elements(tma):
    """x, dy and dx of more than 2**31 elements: row offsets in 32 bits would wrap and read other rows.

    ``x`` is a view 1,024 rows into a larger buffer, as where the wrapped offsets landed in memory
    that exists (no fault, wrong rows): LLaMa-3.1-70B's down projection (K = 28,672) gets there from
    75,000 tokens. The rows on both sides of the 2**31st element, the last rows and the adapters'
    gradients are compared with fp32 references.
    """
    m, n, k, r, offset = 2**31 // 8192 + 1024, 256, 8192, 16, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    buffer = randn(offset + m, k).requires_grad_()
    x = buffer[offset:]
    w, a, b = randn(n, k, scale=k**-0.5), randn(r, k, scale=k**-0.5).requires_grad_(), randn(n, r).requires_grad_()
    gemm = KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tma=tma)
    with override_configs({"xw_sb": gemm, "dyw_dsa": gemm}):
        y = fused_lora_linear(x, w, a, b, scaling=2.0)
        dy = randn(m, n)
        d_buffer, da, db = torch.autograd.grad(y, [buffer, a, b], dy)
    dx = d_buffer[offset:]
    s, dys = _chunked_matmul(x.detach(), a.detach().T), _chunked_matmul(dy, b.detach())
    boundary = 2**31 // k
    for rows in (slice(0, 2048), slice(boundary - 2048, boundary + 1024), slice(m - 2048, m)):
        y_ref = x[rows].float() @ w.float().T + 2.0 * s[rows] @ b.detach().float().T
        dx_ref = dy[rows].float() @ w.float() + 2.0 * dys[rows] @ a.detach().float()
        for name, got, ref in (("y", y[rows], y_ref), ("dx", dx[rows], dx_ref)):
            error = (got.float() - ref).abs().max() / ref.abs().max()
            assert error < 0.02, (name, rows, error.item())
    da_ref, db_ref = 2.0 * _chunked_t_matmul(dys, x.detach()), 2.0 * _chunked_t_matmul(dy, s)
    for name, got, ref in (("dA", da, da_ref), ("dB", db, db_ref)):
        error = (got.float() - ref).abs().max() / ref.abs().max()
        assert error < 0.02, (name, error.item())
