"""The PEFT drop-in on a tiny random LLaMA: same outputs and gradients, fallbacks warned once, files unchanged."""

from __future__ import annotations

import copy
import functools
import io
import math
import types
import warnings

import pytest
import torch

import lorafusion_kernels
import lorafusion_kernels.lora as lora_module
import lorafusion_kernels.peft_integration as integration
from lorafusion_kernels.errors import LoRAFusionKernelsWarning
from lorafusion_kernels.instance_forward import INSTANCE_ATTRIBUTES

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.together,
    # transformers/peft deprecations raised inside their own code are not ours to fix.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def tiny_model(**lora_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    options = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": TARGETS} | lora_kwargs
    model = peft.get_peft_model(model, peft.LoraConfig(**options))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.fixture
def force_fused(monkeypatch):
    """Treat CPU tensors as fused-capable: Triton kernels under the interpreter, the torch path otherwise."""
    monkeypatch.setattr(integration, "runs_triton", lambda t, dtype=None: True)


@pytest.fixture
def fused_calls(monkeypatch):
    """``(x dtype, weight dtype)`` of each call the patched layers make to ``fused_lora_linear``."""
    calls = []
    fused = integration.fused_lora_linear

    def counting(x, weight, *args, **kwargs):
        calls.append((x.dtype, weight.dtype))
        return fused(x, weight, *args, **kwargs)

    monkeypatch.setattr(integration, "fused_lora_linear", counting)
    return calls


def test_patched_model_matches_peft(force_fused):
    model = tiny_model()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = loss_and_grads(model, ids)
    assert lorafusion_kernels.patch_peft_model(model) == 4
    assert lorafusion_kernels.patch_peft_model(model) == 4, "patching twice is harmless"
    logits, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert set(grads) == set(ref_grads)
    assert any("lora_A" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert lorafusion_kernels.unpatch_peft_model(model) == 4
    assert all(not INSTANCE_ATTRIBUTES & vars(m).keys() for m in model.modules())


def test_autocast_runs_fused_with_nn_linear_operands(force_fused, fused_calls):
    """Under torch.autocast (fp16 on the CPU here, bf16 or fp16 on GPUs) the fp32 model's layers run fused.

    Their operands are cast as nn.Linear's would be, so logits and gradients match PEFT's own path
    under the same autocast to fp16 rounding, with no fallback warning.
    """
    model = tiny_model()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.float16):
        ref_logits, ref_grads = loss_and_grads(model, ids)
    lorafusion_kernels.patch_peft_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoRAFusionKernelsWarning)
        with torch.autocast("cpu", dtype=torch.float16):
            logits, grads = loss_and_grads(model, ids)
    assert fused_calls == [(torch.float16, torch.float16)] * 4
    assert logits.dtype == ref_logits.dtype == torch.float16
    torch.testing.assert_close(logits, ref_logits, rtol=1e-2, atol=1e-3)
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert grads[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=2e-2, atol=2e-4, msg=name)


def test_hf_trainer_with_bf16_runs_every_layer_fused(monkeypatch, fused_calls, tmp_path):
    """Regression: the HF Trainer's ``bf16=True`` wraps the forward in torch.autocast, and every call fell back.

    Routed as on a GPU; the op takes its plain-torch path (bf16 on the CPU, where the interpreter
    cannot multiply bf16). Two steps of 4 patched layers: 8 fused calls on bf16 operands, no warning.
    """
    pytest.importorskip("accelerate")
    monkeypatch.setattr(integration, "runs_triton", lambda t, dtype=None: True)
    monkeypatch.setattr(lora_module, "runs_triton", lambda t, dtype=None: False)
    model = tiny_model(lora_dropout=0.1)
    lorafusion_kernels.patch_peft_model(model)
    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16), generator=generator)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, bf16=True, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoRAFusionKernelsWarning)
        result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert fused_calls == [(torch.bfloat16, torch.bfloat16)] * 8
    assert math.isfinite(result.training_loss)


def test_dropout_in_training_and_eval(force_fused):
    model = tiny_model(lora_dropout=0.3)
    lorafusion_kernels.patch_peft_model(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    model.eval()
    eval_logits = model(input_ids=ids).logits
    lorafusion_kernels.unpatch_peft_model(model)
    torch.testing.assert_close(eval_logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    lorafusion_kernels.patch_peft_model(model)
    model.train()
    torch.manual_seed(5)
    first = model(input_ids=ids).logits
    torch.manual_seed(5)
    second = model(input_ids=ids).logits
    assert torch.equal(first, second), "dropout seeds follow torch.manual_seed"
    assert not torch.allclose(first, eval_logits), "dropout is active in training mode"


def test_unsupported_cases_fall_back_with_one_warning(monkeypatch):
    """DoRA layers always take PEFT's path: left unpatched and not counted (they were counted as patched,
    and warned only at their first forward); mixed-adapter batches still refuse them."""
    model = tiny_model(use_dora=True)
    ids = torch.randint(0, 64, (1, 5))
    expected = model(input_ids=ids).logits
    monkeypatch.setattr(integration, "runs_triton", lambda t, dtype=None: True)
    with pytest.warns(LoRAFusionKernelsWarning, match="DoRA") as record:
        assert lorafusion_kernels.patch_peft_model(model) == 0
    assert sum("DoRA" in str(w.message) for w in record) == 1, "one warning per reason"
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoRAFusionKernelsWarning)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    batch = lorafusion_kernels.MultiLoRABatch.from_segments([5], [0])
    with lorafusion_kernels.multi_lora_batch(batch, ["default"]), pytest.raises(ValueError, match="DoRA"):
        model(input_ids=ids)


@pytest.mark.parametrize("function", ["patch_peft_model", "unpatch_peft_model"])
def test_a_non_module_is_refused_with_a_type_error(function):
    """Regression: ``patch_peft_model(LoraConfig(...))`` raised ``AttributeError: ... no attribute 'modules'``."""
    with pytest.raises(TypeError, match=rf"{function} takes the model \(an nn.Module\), got LoraConfig: pass the"):
        getattr(lorafusion_kernels, function)(peft.LoraConfig(r=8, target_modules=TARGETS))


@pytest.mark.parametrize("model", ["plain-module", "base-before-get_peft_model"])
def test_a_model_without_lora_layers_is_warned_about(model):
    """Regression: patching a model without PEFT LoRA layers (a plain module, or the base model before
    ``get_peft_model`` wrapped it) returned 0 silently, and the user trained unfused without knowing."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4)) if model == "plain-module" else tiny_model_base()
    no_layers = pytest.warns(
        LoRAFusionKernelsWarning,
        match=r"found no PEFT LoRA layer in this \w+, so nothing will run fused: call it on the model that "
        r"peft.get_peft_model returned",
    )
    with no_layers:
        assert lorafusion_kernels.patch_peft_model(module) == 0
    if model == "base-before-get_peft_model":
        peft_model = peft.get_peft_model(module, peft.LoraConfig(r=8, target_modules=TARGETS))
        with warnings.catch_warnings():
            warnings.simplefilter("error", LoRAFusionKernelsWarning)
            assert lorafusion_kernels.patch_peft_model(peft_model) == 4


def test_cpu_without_interpreter_falls_back(monkeypatch):
    monkeypatch.setattr(integration, "runs_triton", lambda t, dtype=None: False)
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 5))
    expected = model(input_ids=ids).logits
    lorafusion_kernels.patch_peft_model(model)
    with pytest.warns(LoRAFusionKernelsWarning, match="cpu tensors"):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected)


def test_a_fallback_warning_names_the_users_line(monkeypatch):
    """Found deep in PEFT's layer inside torch's module call; named at the line of this file that ran the model."""
    monkeypatch.setattr(integration, "runs_triton", lambda t, dtype=None: False)
    integration._WARNED.clear()
    model = tiny_model()
    lorafusion_kernels.patch_peft_model(model)
    with pytest.warns(LoRAFusionKernelsWarning, match="cpu tensors") as record:
        model(input_ids=torch.randint(0, 64, (1, 5)))
    assert [w.filename for w in record] == [__file__]


def test_disabled_adapters_run_the_base_model_silently(force_fused):
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 5))
    lorafusion_kernels.patch_peft_model(model)
    with model.disable_adapter():
        patched = model(input_ids=ids).logits
    lorafusion_kernels.unpatch_peft_model(model)
    with model.disable_adapter():
        torch.testing.assert_close(patched, model(input_ids=ids).logits)


def q_proj(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj


def test_a_trainable_base_weight_gets_its_gradient(force_fused):
    model = tiny_model()
    q_proj(model).base_layer.weight.requires_grad_(True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    _, ref_grads = loss_and_grads(model, ids)
    lorafusion_kernels.patch_peft_model(model)
    _, grads = loss_and_grads(model, ids)
    assert set(grads) == set(ref_grads)
    assert any(name.endswith("q_proj.base_layer.weight") for name in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("part", ["base_layer", "lora_A", "lora_B", "lora_dropout"])
def test_hooks_on_a_layers_parts_keep_peft_path(force_fused, part):
    """The fused op calls none of a layer's submodules, so their hooks would silently not run."""
    model = tiny_model()
    layer = q_proj(model)
    module = layer.base_layer if part == "base_layer" else getattr(layer, part)["default"]
    fired = []
    module.register_forward_hook(lambda *_: fired.append(part))
    ids = torch.randint(0, 64, (1, 5))
    expected = model(input_ids=ids).logits
    lorafusion_kernels.patch_peft_model(model)
    fired.clear()
    with pytest.warns(LoRAFusionKernelsWarning, match="forward hooks or a wrapped forward"):
        got = model(input_ids=ids).logits
    assert fired == [part]
    torch.testing.assert_close(got, expected)


def test_a_base_layer_wrapped_on_the_instance_is_left_alone():
    """accelerate's offloading replaces the base layer's forward on the instance (weights on meta until then)."""
    model = tiny_model()
    base = q_proj(model).base_layer
    base.forward = types.MethodType(type(base).forward, base)
    with pytest.warns(LoRAFusionKernelsWarning, match="already wrapped by hooks"):
        assert lorafusion_kernels.patch_peft_model(model) == len(TARGETS) - 1
    assert not integration.is_patched(q_proj(model))


def test_a_patched_model_pickles_and_copies(force_fused, fused_calls):
    """Regression: ``torch.load`` of a whole patched model raised ``AttributeError`` (the patched forward
    was a bound method, which pickles as a lookup of its name on the layer). The loaded model and a
    deep copy run their own layers fused, as PEFT; unpatching them removes what the patch installed."""
    model = tiny_model()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    lorafusion_kernels.patch_peft_model(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = {"loaded": torch.load(buffer, weights_only=False), "deepcopy": copy.deepcopy(model)}
    for param in model.parameters():  # the copies must not read the original's layers
        torch.nn.init.zeros_(param)
    for kind, other in copies.items():
        fused_calls.clear()
        with torch.no_grad():
            got = other(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=kind)
        assert len(fused_calls) == len(TARGETS), kind
        assert lorafusion_kernels.unpatch_peft_model(other) == len(TARGETS), kind
        assert all(not INSTANCE_ATTRIBUTES & vars(m).keys() for m in other.modules()), kind


def test_a_shallow_copy_of_a_patched_layer_runs_itself(force_fused, fused_calls):
    """Regression: ``copy.copy`` of a patched layer kept the original's instance forward, so the copy
    computed with the original's base layer and adapters. The copy's forward is bound to the copy."""
    model = tiny_model()
    lorafusion_kernels.patch_peft_model(model)
    layer = q_proj(model)
    clone = copy.copy(layer)
    # copy.copy shares the module table with the original: the clone gets its own, with its own base layer.
    own_base = copy.deepcopy(layer.base_layer)
    torch.nn.init.normal_(own_base.weight)
    clone._modules = {**layer._modules, "base_layer": own_base}
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, original = clone(x), layer(x)
        expected = type(clone).forward(clone, x)  # PEFT's own forward, on the clone's layers
    assert len(fused_calls) == 2, "both ran fused"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (got - original).abs().max() > 0.1, "the clone computed with the original's base layer"
    assert lorafusion_kernels.unpatch_peft_model(clone) == 1
    assert not INSTANCE_ATTRIBUTES & vars(clone).keys()
    assert integration.is_patched(layer), "unpatching the clone leaves the original patched"


def test_copies_keep_a_forward_that_hooks_installed_after_patching(force_fused):
    """A ``forward`` that hooks (accelerate's) put on a patched layer stays in its deep copies, bound to the copy."""
    model = tiny_model()
    lorafusion_kernels.patch_peft_model(model)
    layer = q_proj(model)
    hooked = functools.partial(hook_forward, layer)
    layer.forward = hooked
    clone = copy.deepcopy(layer)
    assert clone.forward.func is hook_forward
    assert clone.forward.args[0] is clone
    x = torch.randn(2, 48)
    torch.testing.assert_close(clone(x), layer(x))


def hook_forward(module, x):
    """A forward hook wrapper as accelerate installs one: the module's forward, then the hook's work."""
    return integration._patched_forward(module, x) * 2.0


def test_data_parallel_replicas_run_their_own_layers(force_fused):
    """Regression: ``nn.DataParallel`` (the HF Trainer's wrapper on several GPUs without torchrun) copies
    each module's ``__dict__``, so a replica's patched forward ran the original layer, whose weights
    sit on the first GPU. Each replica's forward is now bound to the replica itself."""
    model = tiny_model(modules_to_save=["lm_head"])
    lorafusion_kernels.patch_peft_model(model)
    routed = [m for m in model.modules() if "forward" in vars(m)]
    assert len(routed) == len(TARGETS) + 1, "the LoRA layers and the lm_head wrapper"
    for module in routed:
        replica = module._replicate_for_data_parallel()
        assert replica.forward.args[0] is replica
        assert replica._replicate_for_data_parallel().forward.args[0] is not module


@pytest.mark.multigpu(gpus=2)
@pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0:UserWarning")  # DataParallel's loss
def test_gpu_data_parallel_matches_one_gpu(fused_calls):
    """The patched model inside ``nn.DataParallel`` on two GPUs: fused on both, as on one GPU."""
    model = tiny_model().cuda()
    lorafusion_kernels.patch_peft_model(model)
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_logits, ref_grads = loss_and_grads(model, ids)
        fused_calls.clear()
        model.zero_grad()
        parallel = torch.nn.DataParallel(model, device_ids=[0, 1])
        out = parallel(input_ids=ids, labels=ids)
        out.loss.mean().backward()
    assert len(fused_calls) == 2 * len(TARGETS), "every layer fused on both GPUs"
    torch.testing.assert_close(out.logits.detach().float(), ref_logits.float(), rtol=2e-2, atol=2e-2)
    for name, param in model.named_parameters():
        if name in ref_grads:
            assert (param.grad - ref_grads[name]).norm() / ref_grads[name].norm() < 5e-2, name


def two_adapters_on_different_layers():
    model = tiny_model(target_modules=["q_proj"])
    model.add_adapter("other", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B.other" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def test_several_active_adapters_each_alone_on_its_layer_run_fused(force_fused, fused_calls):
    model = two_adapters_on_different_layers()
    model.base_model.set_adapter(["default", "other"])
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    ref_logits, ref_grads = loss_and_grads(model, ids)
    lorafusion_kernels.patch_peft_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoRAFusionKernelsWarning)
        logits, grads = loss_and_grads(model, ids)
    assert len(fused_calls) == 2, "q_proj with 'default', v_proj with 'other'"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_an_active_adapter_absent_from_a_layer_leaves_it_to_the_base_silently(force_fused):
    model = two_adapters_on_different_layers()
    model.base_model.set_adapter("other")  # q_proj holds only "default"
    ids = torch.randint(0, 64, (1, 5))
    expected = model(input_ids=ids).logits
    lorafusion_kernels.patch_peft_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoRAFusionKernelsWarning)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_saved_adapter_is_a_plain_peft_file(tmp_path, force_fused):
    safetensors = pytest.importorskip("safetensors.torch")
    plain, patched = tiny_model(), tiny_model()
    lorafusion_kernels.patch_peft_model(patched)
    plain.save_pretrained(tmp_path / "plain")
    patched.save_pretrained(tmp_path / "patched")
    a = safetensors.load_file(str(tmp_path / "plain" / "adapter_model.safetensors"))
    b = safetensors.load_file(str(tmp_path / "patched" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    loaded = peft.PeftModel.from_pretrained(tiny_model_base(), tmp_path / "patched")
    ids = torch.randint(0, 64, (1, 5))
    torch.testing.assert_close(loaded(input_ids=ids).logits, plain(input_ids=ids).logits)


def tiny_model_base() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("args", "kwargs"), [((0.5,), {}), ((), {"scale": 2.0})], ids=["positional-arg", "keyword-arg"]
)
def test_extra_arguments_go_to_peft_forward_and_the_base_layer(args, kwargs, force_fused):
    """Regression: a fused call dropped extra keyword arguments; with any extra argument PEFT's own
    forward runs (it passes them to the base layer), with one warning."""
    model = tiny_model()
    lorafusion_kernels.patch_peft_model(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.base_layer

    def base_forward(x: torch.Tensor, shift: float = 0.0, *, scale: float = 1.0) -> torch.Tensor:
        return torch.nn.functional.linear(x, base.weight, base.bias) * scale + shift

    base.forward = base_forward  # a base layer taking extra arguments, as a hook wrapper may
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = type(layer).forward(layer, x, *args, **kwargs)
        # The wrapped base forward is itself a reason for PEFT's path, named first.
        with pytest.warns(LoRAFusionKernelsWarning, match="a wrapped forward on their base layer"):
            got = layer(x, *args, **kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_autocast_bf16_runs_fused_and_matches_peft(fused_calls):
    """An fp32 model under autocast to bf16 on the GPU (HF Trainer's bf16=True): fused, as PEFT to bf16 rounding."""
    model = tiny_model().cuda()
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_logits, ref_grads = loss_and_grads(model, ids)
    lorafusion_kernels.patch_peft_model(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, grads = loss_and_grads(model, ids)
    assert fused_calls == [(torch.bfloat16, torch.bfloat16)] * 4
    assert (logits.float() - ref_logits.float()).norm() / ref_logits.float().norm() < 2e-2
    for name in grads:
        assert grads[name].dtype == torch.float32, name
        assert (grads[name] - ref_grads[name]).norm() / ref_grads[name].norm() < 5e-2, name
