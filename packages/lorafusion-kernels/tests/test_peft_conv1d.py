"""GPT-2's Conv1D layers (``y = x W + b``, ``W [K, N]``, PEFT's ``fan_in_fan_out=True``) run fused.

The fused ops take the base weight as the view ``W^T``; these tests check a patched GPT-2 against
PEFT's own path, single-adapter and mixed-adapter, forward and every gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lorafusion_kernels
import lorafusion_kernels.multi_lora_routing as routing
import lorafusion_kernels.peft_integration as integration

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.together,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # PEFT says it turned fan_in_fan_out on for Conv1D targets.
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning"),
]

TARGETS = ["c_attn", "c_proj", "c_fc"]  # c_proj: the attention's and the MLP's
ADAPTERS = {"alpha": {"r": 8, "lora_alpha": 16}, "beta": {"r": 4, "lora_alpha": 4}}


def tiny_gpt2(device: str = "cpu", adapters: tuple[str, ...] = ("alpha",)) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=48, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = None
    for name in adapters:
        cfg = peft.LoraConfig(target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False, **ADAPTERS[name])
        if model is None:
            model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    assert model is not None
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.requires_grad_(True)
    return model.to(device)


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **kwargs).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_same(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def force_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat CPU tensors as fused-capable: the Triton kernels under the interpreter, the torch path otherwise."""
    monkeypatch.setattr(integration, "runs_triton", lambda t, dtype=None: True)


@pytest.mark.usefixtures("force_fused")
def test_conv1d_layers_are_patched_and_match_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gpt2()
    model.base_model.model.transformer.h[0].attn.c_attn.base_layer.weight.requires_grad_(True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = loss_and_grads(model, ids)
    assert any(name.endswith("c_attn.base_layer.weight") for name in reference[1])
    calls: list[tuple[int, ...]] = []
    fused = integration.fused_lora_linear

    def counting(x: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(weight.stride()))
        return fused(x, weight, *args, **kwargs)

    monkeypatch.setattr(integration, "fused_lora_linear", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lorafusion_kernels.LoRAFusionKernelsWarning)
        assert lorafusion_kernels.patch_peft_model(model) == 4
        assert_same(loss_and_grads(model, ids), reference)
    assert len(calls) == 4
    assert all(stride[0] == 1 for stride in calls), "the weights are W^T views, not copies"


def test_mixed_adapter_batches_on_conv1d_match_per_row_peft() -> None:
    model = tiny_gpt2(adapters=("alpha", "beta"))
    model.train()
    rows = ["beta", "alpha", "__base__", "alpha"]
    ids = torch.randint(0, 64, (len(rows), 7), generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    want_logits = []
    for row, name in enumerate(rows):
        if name == "__base__":
            with model.disable_adapter():
                logits = model(input_ids=ids[row : row + 1]).logits
        else:
            model.set_adapter(name)
            logits = model(input_ids=ids[row : row + 1]).logits
        if logits.requires_grad:  # the base row trains nothing
            logits.float().square().mean().backward()
        want_logits.append(logits.detach())
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.requires_grad_(True)
    lorafusion_kernels.patch_peft_model(model)
    fused_layers: list[object] = []
    forward = routing._fused_layer_forward
    routing_calls = lambda layer, *args: fused_layers.append(layer) or forward(layer, *args)  # noqa: E731
    model.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routing, "_fused_layer_forward", routing_calls)
        logits = model(input_ids=ids, adapter_names=rows).logits
    sum(logits[row : row + 1].float().square().mean() for row in range(len(rows))).backward()
    assert len(fused_layers) == 4, "every Conv1D layer took the fused multi-adapter op"
    torch.testing.assert_close(logits.detach(), torch.cat(want_logits), rtol=1e-4, atol=1e-5)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got.keys() == {n for n, g in want.items() if g.abs().sum() > 0}
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_gpu_bf16_autocast_conv1d_runs_fused_and_matches_peft() -> None:
    """GPT-2 under autocast to bf16 (HF Trainer's bf16=True): every Conv1D layer fused, as PEFT to bf16 rounding."""
    model = tiny_gpt2("cuda")
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_logits, ref_grads = loss_and_grads(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lorafusion_kernels.LoRAFusionKernelsWarning)
        assert lorafusion_kernels.patch_peft_model(model) == 4
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, grads = loss_and_grads(model, ids)
    assert (logits.float() - ref_logits.float()).norm() / ref_logits.float().norm() < 2e-2
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert (grads[name] - ref_grads[name]).norm() / ref_grads[name].norm() < 5e-2, name
