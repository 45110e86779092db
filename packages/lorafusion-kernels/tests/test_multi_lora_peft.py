"""Mixed-adapter batches through a patched PEFT model: ``multi_lora_batch`` and PEFT's ``adapter_names=``.

A tiny random LLaMA with three LoRA adapters of different ranks and scalings (one rsLoRA). Every
row of the batch is one segment, so the reference is PEFT itself run row by row with that row's
adapter active (attention never crosses rows). CPU runs take the plain-torch path; the GPU case runs
the Triton kernels in bf16.
"""

from __future__ import annotations

import copy
import functools
import io
import warnings
from collections.abc import Iterator, Mapping, Sequence

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from lorafusion_kernels import (  # noqa: E402
    LoRAFusionKernelsError,
    LoRAFusionKernelsWarning,
    MultiLoRABatch,
    fuse_sibling_layers,
    multi_lora_batch,
    multi_lora_checkpoint_contexts,
    patch_peft_model,
    routed_checkpoint_function,
    unpatch_peft_model,
)
from lorafusion_kernels.instance_forward import INSTANCE_ATTRIBUTES  # noqa: E402

# peft 0.21 calls a property that transformers 5 deprecates; nothing for us to act on.
# The patched layers warn (once per reason) that CPU tensors take PEFT's own single-adapter path.
pytestmark = [
    pytest.mark.together,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:lorafusion. PEFT's own LoRA path is used for cpu tensors"),
]

ADAPTERS = {
    "alpha": {"r": 8, "lora_alpha": 16},
    "beta": {"r": 16, "lora_alpha": 8, "use_rslora": True},
    "gamma": {"r": 4, "lora_alpha": 4},
}
ROW_ADAPTERS = ["beta", "alpha", "alpha", "gamma", "__base__"]
SEQ = 7


def tiny_peft_model(
    dropout: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    modules_to_save: Mapping[str, list[str]] | None = None,
) -> torch.nn.Module:
    """``modules_to_save``: per adapter, the modules it trains whole; each copy is perturbed, so that it differs."""
    torch.manual_seed(0)
    saved = modules_to_save or {}
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    base = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = None
    for name, kw in ADAPTERS.items():
        cfg = peft.LoraConfig(
            target_modules=targets, lora_dropout=dropout, init_lora_weights=False, modules_to_save=saved.get(name), **kw
        )
        if model is None:
            model = peft.get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    assert model is not None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(torch.randn_like(param), alpha=0.5)
    model = model.to(device=device, dtype=dtype)
    train_all_adapters(model)
    return model


def train_all_adapters(model: torch.nn.Module) -> None:
    """PEFT makes only the active adapter trainable; a mixed-batch trainer trains all of them."""
    for param in adapter_params(model).values():
        param.requires_grad_(True)


def adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapters' own tensors: LoRA weights, ``modules_to_save`` copies and trainable-token rows."""
    own = ("lora_", ".modules_to_save.", "trainable_tokens_delta")
    return {n: p for n, p in model.named_parameters() if any(part in n for part in own)}


def input_ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 97, (len(ROW_ADAPTERS), SEQ), generator=torch.Generator().manual_seed(1)).to(device)


def per_row_reference(
    model: torch.nn.Module, ids: torch.Tensor, rows: Sequence[str] = tuple(ROW_ADAPTERS)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PEFT, one row at a time with its adapter (``rows``) active; gradients of the summed per-row losses."""

    model.zero_grad(set_to_none=True)
    outs = []
    for row, name in enumerate(rows):
        if name == "__base__":
            with model.disable_adapter():
                logits = model(input_ids=ids[row : row + 1]).logits
        else:
            model.set_adapter(name)
            logits = model(input_ids=ids[row : row + 1]).logits
        if logits.requires_grad:
            logits.float().square().mean().backward()
        outs.append(logits.detach())
    model.set_adapter(next(iter(ADAPTERS)))
    train_all_adapters(model)
    return torch.cat(outs), {n: p.grad.clone() for n, p in adapter_params(model).items() if p.grad is not None}


def row_batch(device: str = "cpu", rows: Sequence[str] = tuple(ROW_ADAPTERS)) -> tuple[MultiLoRABatch, list[str]]:
    """One segment per row, each row's adapter (``rows``) named in order of first appearance."""
    names = list(dict.fromkeys(rows))
    index = {n: i for i, n in enumerate(names)}
    batch = MultiLoRABatch.from_segments(
        [SEQ] * len(rows), [index[n] for n in rows], num_adapters=len(names), device=device
    )
    return batch, names


def summed_row_loss(logits: torch.Tensor) -> torch.Tensor:
    return sum(logits[row : row + 1].float().square().mean() for row in range(logits.shape[0]))  # type: ignore[return-value]


@pytest.fixture(params=["layers", "siblings"])
def patched_model(request: pytest.FixtureRequest) -> Iterator[torch.nn.Module]:
    """The patched model; ``siblings``: q/k/v and gate/up of both decoder layers fused (4 groups)."""
    model = tiny_peft_model()
    patch_peft_model(model)
    if request.param == "siblings":
        assert fuse_sibling_layers(model) == 4
    yield model
    unpatch_peft_model(model)


def assert_grads_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = {n: p.grad for n, p in adapter_params(model).items() if p.grad is not None and p.grad.abs().sum() > 0}
    want = {n: g for n, g in expected.items() if g.abs().sum() > 0}
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def assert_context_matches_rows(
    model: torch.nn.Module,
    ids: torch.Tensor,
    rows: Sequence[str],
    expected: tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> None:
    """One training forward + backward of ``ids`` in :func:`multi_lora_batch` (a row per adapter in
    ``rows``) gives the logits and gradients ``expected`` (:func:`per_row_reference`)."""
    model.zero_grad(set_to_none=True)
    with multi_lora_batch(*row_batch(rows=rows)):
        logits = model(input_ids=ids).logits
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), expected[0], rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, expected[1])


def test_context_in_training_matches_per_row_peft(patched_model: torch.nn.Module) -> None:
    model = patched_model
    model.train()
    ids = input_ids()
    ref_logits, ref_grads = per_row_reference(model, ids)
    model.zero_grad(set_to_none=True)
    batch, names = row_batch()
    with multi_lora_batch(batch, names):
        logits = model(input_ids=ids).logits
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, ref_grads)


def test_adapter_without_tokens_gets_no_gradient(patched_model: torch.nn.Module) -> None:
    """An adapter the batch names but gives no tokens takes no part: its ``.grad`` stays None (not zeros)."""
    model = patched_model
    model.train()
    model.zero_grad(set_to_none=True)
    names = list(ADAPTERS)  # alpha, beta, gamma; beta owns no token
    batch = MultiLoRABatch.from_segments([SEQ, 0, SEQ], [0, 1, 2], num_adapters=3)
    ids = input_ids()[:2]
    with multi_lora_batch(batch, names):
        logits = model(input_ids=ids.reshape(1, -1)).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad for n, p in adapter_params(model).items()}
    assert all(g is None for n, g in grads.items() if ".beta." in n)
    assert all(g is not None for n, g in grads.items() if ".beta." not in n)


def test_checkpointed_recompute_replays_the_segments(patched_model: torch.nn.Module) -> None:
    """Activation checkpointing recomputes in the backward, after the context has exited."""
    model = patched_model
    model.train()
    ids = input_ids()
    ref_logits, ref_grads = per_row_reference(model, ids)
    model.zero_grad(set_to_none=True)
    batch, names = row_batch()
    with multi_lora_batch(batch, names):
        logits = torch.utils.checkpoint.checkpoint(
            lambda t: model(input_ids=t).logits, ids, use_reentrant=False, context_fn=multi_lora_checkpoint_contexts
        )
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, ref_grads)


def enable_hf_checkpointing(model: torch.nn.Module, *, use_reentrant: bool) -> None:
    """HF's activation checkpointing on every decoder layer (``activation_checkpointing_enable`` in 5.x)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


@pytest.mark.parametrize("route", ["context", "adapter_names"])
@pytest.mark.parametrize("when", ["before_patching", "after_patching"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_checkpointing_replays_the_segments(route: str, when: str, use_reentrant: bool) -> None:
    """HF recomputes each decoder layer in the backward, after the routing has exited: same gradients."""
    model = tiny_peft_model()
    model.train()
    ids = input_ids()
    ref_logits, ref_grads = per_row_reference(model, ids)
    if when == "before_patching":
        enable_hf_checkpointing(model, use_reentrant=use_reentrant)
    patch_peft_model(model)
    if when == "after_patching":
        enable_hf_checkpointing(model, use_reentrant=use_reentrant)
    model.zero_grad(set_to_none=True)
    if route == "context":
        batch, names = row_batch()
        with multi_lora_batch(batch, names):
            logits = model(input_ids=ids).logits
    else:
        logits = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, ref_grads)
    unpatch_peft_model(model)
    assert not any(hasattr(m.__dict__.get("_gradient_checkpointing_func"), "_lorafusion_unrouted_checkpoint")
                   for m in model.modules()), "unpatching restores HF's checkpoint functions"  # fmt: skip


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_routed_checkpoint_function_replays_the_segments(use_reentrant: bool) -> None:
    """A direct ``torch.utils.checkpoint`` call around a routed function, reentrant or not."""
    model = tiny_peft_model()
    model.train()
    ids = input_ids()
    ref_logits, ref_grads = per_row_reference(model, ids)
    patch_peft_model(model)
    model.zero_grad(set_to_none=True)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    with multi_lora_batch(*row_batch()):
        logits = torch.utils.checkpoint.checkpoint(
            routed_checkpoint_function(lambda h: model(inputs_embeds=h).logits), embeddings, use_reentrant=use_reentrant
        )
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, ref_grads)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hf_checkpointing_replays_modules_to_save_per_row(use_reentrant: bool) -> None:
    """Regression: a ``modules_to_save`` copy inside a decoder layer (o_proj here) lost PEFT's per-call
    ``adapter_names`` when HF recomputed the layer in the backward, and applied the active adapter to
    every row (reentrant: wrong gradients, silently; non-reentrant: ``CheckpointError``)."""
    model = tiny_peft_model(modules_to_save={name: ["o_proj"] for name in ADAPTERS})
    model.train()
    ids = input_ids()
    ref_logits, ref_grads = per_row_reference(model, ids)
    assert any(".o_proj.modules_to_save.beta." in name for name in ref_grads)
    enable_hf_checkpointing(model, use_reentrant=use_reentrant)
    patch_peft_model(model)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, ref_grads)


def test_adapter_names_in_training_matches_per_row_peft(patched_model: torch.nn.Module) -> None:
    """PEFT itself refuses ``adapter_names=`` in training; the patched model routes it through segments."""
    model = patched_model
    model.train()
    ids = input_ids()
    ref_logits, ref_grads = per_row_reference(model, ids)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
    summed_row_loss(logits).backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-4, atol=1e-5)
    assert_grads_equal(model, ref_grads)


def test_adapter_names_under_autocast_matches_per_row_peft(
    patched_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.autocast the fp32 model's mixed batch still runs FusedMultiLoRA, in autocast's dtype.

    Sibling groups run their members one by one there (each cast as nn.Linear's operands would be).
    Logits and gradients match PEFT run row by row under the same autocast, to fp16 rounding.
    """
    import lorafusion_kernels.multi_lora_routing as routing

    model = patched_model
    model.train()
    ids = input_ids()
    with torch.autocast("cpu", dtype=torch.float16):
        ref_logits, ref_grads = per_row_reference(model, ids)
    dtypes = []
    fused = routing.fused_multi_lora_linear

    def counting(x: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        dtypes.append((x.dtype, weight.dtype))
        return fused(x, weight, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(routing, "fused_multi_lora_linear", counting)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
        summed_row_loss(logits).backward()
    assert dtypes == [(torch.float16, torch.float16)] * 14, "every targeted layer of both decoder layers, fused"
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-2, atol=1e-3)
    got = {n: p.grad for n, p in adapter_params(model).items() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got.keys() == {n for n, g in ref_grads.items() if g.abs().sum() > 0}
    for name, g in got.items():
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g, ref_grads[name], rtol=2e-2, atol=2e-4, msg=name)


def test_adapter_names_in_eval_matches_peft_mixed_batch() -> None:
    model = tiny_peft_model()
    model.eval()
    ids = input_ids()
    with torch.no_grad():
        expected = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
        patch_peft_model(model)
        got = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
        unpatch_peft_model(model)
        again = model(input_ids=ids, adapter_names=ROW_ADAPTERS).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_failed_adapter_names_call_leaves_no_hooks_behind(mode: str) -> None:
    """PEFT removes its per-call hooks after a ``yield`` without ``finally``: after an error inside an
    eval call they stayed, and every later call of the model failed on the old ``adapter_names``."""
    model = tiny_peft_model()
    patch_peft_model(model)
    model.train(mode == "train")
    ids = input_ids()

    def fail(module: torch.nn.Module, args: object, output: object) -> None:
        raise RuntimeError("failed inside the call")

    handle = model.get_output_embeddings().register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="failed inside the call"):
        model(input_ids=ids, adapter_names=ROW_ADAPTERS)
    handle.remove()
    with torch.no_grad():
        one_row = model(input_ids=ids[:1]).logits
    assert one_row.shape[0] == 1


def test_adapter_names_on_rows_a_model_flattened_name_the_layer_and_the_way_out() -> None:
    """OPT runs fc1/fc2 on ``[batch x tokens, hidden]``: PEFT's message named neither layer nor remedy."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=97, hidden_size=32, ffn_dim=48, num_hidden_layers=1, num_attention_heads=4, word_embed_proj_dim=32
    )
    model = peft.get_peft_model(
        transformers.OPTForCausalLM(config), peft.LoraConfig(target_modules=["fc1"], r=4), adapter_name="one"
    )
    model.add_adapter("two", peft.LoraConfig(target_modules=["fc1"], r=4))
    patch_peft_model(model)
    model.eval()
    flattened = r"got 2 and 10 respectively, at .*layers\.0\.fc1 \(input \(10, 32\)\)\. The model flattens"
    with torch.no_grad(), pytest.raises(LoRAFusionKernelsError, match=flattened + ".*with multi_lora_batch instead"):
        model(input_ids=torch.randint(0, 97, (2, 5)), adapter_names=["one", "two"])
    no_hint = r"got 3 and 10 respectively, at \S+ \(input \(10, 32\)\)$"  # not whole rows per name
    with torch.no_grad(), pytest.raises(LoRAFusionKernelsError, match=no_hint):
        model(input_ids=torch.randint(0, 97, (2, 5)), adapter_names=["one", "two", "one"])


def test_unpatched_model_still_refuses_adapter_names_in_training() -> None:
    model = tiny_peft_model()
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model(input_ids=input_ids(), adapter_names=ROW_ADAPTERS)


def test_context_with_dropout_trains(patched_model: torch.nn.Module) -> None:
    """p > 0 in training: finite gradients for every used adapter, and the seeded masks differ per layer call."""
    model = patched_model
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleDict):
            for name, sub in module.items():
                if isinstance(sub, torch.nn.Identity) and name in ADAPTERS:
                    module[name] = torch.nn.Dropout(0.3)
    model.train()
    batch, names = row_batch()
    with multi_lora_batch(batch, names):
        first = model(input_ids=input_ids()).logits
        second = model(input_ids=input_ids()).logits
    summed_row_loss(first).backward()
    assert not torch.equal(first, second)
    grads = {n: p.grad for n, p in adapter_params(model).items()}
    for adapter in ("alpha", "beta", "gamma"):
        used = [g for n, g in grads.items() if f".{adapter}." in n]
        assert used
        assert all(g is not None and torch.isfinite(g).all() for g in used)


def test_context_checks_the_token_count(patched_model: torch.nn.Module) -> None:
    batch = MultiLoRABatch.from_segments([5, 6], [0, 1])
    with multi_lora_batch(batch, ["alpha", "beta"]), pytest.raises(LoRAFusionKernelsError, match="holds 11") as error:
        patched_model(input_ids=input_ids())
    assert "model.layers.0.self_attn." in str(error.value), "the message names the layer by its path"


def test_an_adapter_that_cannot_train_is_named_once(
    patched_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT makes only the active adapter trainable; a mixed batch would leave the others without gradients."""
    from lorafusion_kernels import multi_lora_routing
    from lorafusion_kernels.errors import OnceWarnings

    monkeypatch.setattr(multi_lora_routing, "_WARNED_FROZEN", OnceWarnings())
    model = patched_model
    model.train()
    for name, param in adapter_params(model).items():
        param.requires_grad_(".beta." not in name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LoRAFusionKernelsWarning)
        for _ in range(2):
            with multi_lora_batch(*row_batch()):
                model(input_ids=input_ids())
    frozen = [str(w.message) for w in caught if "do not require grad" in str(w.message)]
    assert len(frozen) == 1
    assert "adapter 'beta'" in frozen[0]


def test_a_name_no_layer_holds_raises_at_the_end_of_every_block(patched_model: torch.nn.Module) -> None:
    """Regression: a misspelt adapter name left its tokens on the frozen model (and its adapter
    untrained) with one warning per process, so every later step of a training loop was silent.
    PEFT's own ``adapter_names=`` raises for an unknown adapter; so does the block, each time."""
    batch, names = row_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoRAFusionKernelsWarning)
        with multi_lora_batch(batch, names):  # the right names and "__base__": neither error nor warning
            patched_model(input_ids=input_ids())
    misspelt = [n.replace("gamma", "gama") for n in names]
    for _ in range(2):
        unheld = pytest.raises(LoRAFusionKernelsError, match=r"adapter 'gama' \(index 2\) has 7 tokens")
        with unheld as caught, multi_lora_batch(batch, misspelt):
            patched_model(input_ids=input_ids())
        assert "they hold ['alpha', 'beta', 'gamma']" in str(caught.value)
        assert "fix adapter_names" in str(caught.value)


def test_an_error_inside_the_block_is_not_replaced(patched_model: torch.nn.Module) -> None:
    """Only a normal exit checks the names: an exception raised in the block reaches the caller as it is."""
    batch, names = row_batch()

    def failing_step() -> None:
        with multi_lora_batch(batch, ["nobody", *names[1:]]):
            patched_model(input_ids=input_ids())
            raise RuntimeError("the user's own error")

    with pytest.raises(RuntimeError, match="the user's own error"):
        failing_step()


def test_a_block_on_an_unpatched_model_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's own layers ignore the block: every token got the active adapter, silently.

    A warning, not an error: a pipeline stage that holds no LoRA layer runs such blocks on purpose.
    """
    from lorafusion_kernels import multi_lora_context
    from lorafusion_kernels.errors import OnceWarnings

    monkeypatch.setattr(multi_lora_context, "_WARNED_UNREACHED", OnceWarnings())
    model = tiny_peft_model()
    unpatched = pytest.warns(LoRAFusionKernelsWarning, match="no patched module ran inside multi_lora_batch")
    with unpatched, multi_lora_batch(*row_batch()):
        model(input_ids=input_ids())


@pytest.mark.parametrize(
    ("saved", "rows"),
    [(["lm_head"], ROW_ADAPTERS), (["embed_tokens", "lm_head"], ["alpha", "beta", "alpha", "__base__", "beta"])],
    ids=["lm_head-a-run-per-copy", "embed_and_head-interleaved-copies"],
)
def test_modules_to_save_route_each_segment_to_its_adapters_copy(saved: list[str], rows: list[str]) -> None:
    """Per-adapter heads and embeddings (``modules_to_save``, as SEQ_CLS heads or added tokens bring):
    each segment's tokens go through its adapter's copy, the original module for ``__base__`` and
    adapters without one (gamma); interleaved segments of one copy are gathered into one call. Logits
    and every gradient, copies included, match PEFT row by row; so do a deep copy's and a
    ``torch.load``-ed copy's (checked once: the interpreter makes each run slow), and unpatching
    restores PEFT's forward."""
    model = tiny_peft_model(modules_to_save={"alpha": saved, "beta": saved})
    model.train()
    ids = input_ids()
    expected = per_row_reference(model, ids, rows)
    assert any(".lm_head.modules_to_save.beta." in name for name in expected[1])
    patch_peft_model(model)
    assert_context_matches_rows(model, ids, rows, expected)
    if len(saved) > 1:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            assert_context_matches_rows(other, ids, rows, expected)
    unpatch_peft_model(model)
    assert all(not INSTANCE_ATTRIBUTES & vars(m).keys() for m in model.modules())


def test_sequence_classification_heads_train_per_adapter_in_one_batch() -> None:
    """``task_type="SEQ_CLS"``: PEFT gives each adapter its own ``score`` head (modules_to_save). A padded
    batch, one segment per row, trains both adapters' heads at once: logits and gradients as PEFT row
    by row (the pooling reads each row's last token)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    base = transformers.LlamaForSequenceClassification(config)
    lora = {"task_type": "SEQ_CLS", "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, **lora), adapter_name="alpha")
    model.add_adapter("beta", peft.LoraConfig(r=8, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(torch.randn_like(param), alpha=0.1)  # heads that differ, logits of fp32-exact size
    train_all_adapters(model)
    model.train()
    rows = ["beta", "alpha", "__base__", "beta"]
    ids = input_ids()[: len(rows)].clamp(min=1)  # no padding: every row pools its last token
    expected = per_row_reference(model, ids, rows)
    assert any(".score.modules_to_save.beta." in name for name in expected[1])
    patch_peft_model(model)
    assert_context_matches_rows(model, ids, rows, expected)


def test_trainable_tokens_route_each_segment_to_its_adapters_rows() -> None:
    """PEFT's trainable tokens (per-adapter rows of the embedding) route per segment like modules_to_save:
    logits and gradients (the rows' deltas included) as PEFT row by row."""
    model = tiny_peft_model()
    for name in ("alpha", "beta"):
        model.add_adapter(f"{name}_tokens", peft.LoraConfig(target_modules=["q_proj"], trainable_token_indices=[3, 5]))
    model.train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name:
                param.normal_()
    train_all_adapters(model)
    rows = ["alpha_tokens", "beta", "beta_tokens", "__base__", "alpha_tokens"]
    ids = input_ids()
    ids[:, 0] = 3  # every row reads a trainable token
    expected = per_row_reference(model, ids, rows)
    assert any("trainable_tokens_delta.beta_tokens" in name for name in expected[1])
    patch_peft_model(model)
    assert_context_matches_rows(model, ids, rows, expected)


def test_modules_to_save_of_other_modules_that_differ_per_segment_are_refused() -> None:
    """Only copies of nn.Linear and nn.Embedding act on each token alone; a wrapper of another module
    (the RMS norms here) whose one copy is wrong for some segment is refused, naming it and why."""
    model = tiny_peft_model(modules_to_save={"alpha": ["norm"], "beta": ["norm"]})
    patch_peft_model(model)
    model.train()
    wrapper = r"model\.layers\.0\.input_layernorm is a PEFT ModulesToSaveWrapper .* adapters \['alpha', 'beta'\]"
    why = r"it wraps a LlamaRMSNorm, and only copies of nn\.Linear and nn\.Embedding route per segment"
    wronged = r"the copy of adapter 'alpha' to every token, wrong for the tokens of \['beta', 'gamma', '__base__'\]"
    with multi_lora_batch(*row_batch()), pytest.raises(LoRAFusionKernelsError, match=f"{wrapper}.*{why}.*{wronged}"):
        model(input_ids=input_ids())


def test_a_routed_wrapper_checks_the_token_count() -> None:
    model = tiny_peft_model(modules_to_save={"alpha": ["lm_head"], "beta": ["lm_head"]})
    patch_peft_model(model)
    with multi_lora_batch(*row_batch()), pytest.raises(LoRAFusionKernelsError, match="lm_head got 6 tokens"):
        model.base_model.model.lm_head(torch.randn(2, 3, 32))


def test_an_explicit_adapter_names_none_is_no_names() -> None:
    """Regression: ``head(h, adapter_names=None)`` (which PEFT accepts) reached the copy's forward
    inside the block (``TypeError``), or was refused as an extra argument."""
    model = tiny_peft_model(modules_to_save={"alpha": ["lm_head"], "beta": ["lm_head"]})
    patch_peft_model(model)
    head = model.base_model.model.lm_head
    h = torch.randn(len(ROW_ADAPTERS), SEQ, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), multi_lora_batch(*row_batch()):
        torch.testing.assert_close(head(h, adapter_names=None), head(h), rtol=0, atol=0)
    rows = ["beta"] * len(ROW_ADAPTERS)  # one copy, not the active one: called once with the arguments
    with torch.no_grad(), multi_lora_batch(*row_batch(rows=rows)):
        torch.testing.assert_close(head(h, adapter_names=None), head.modules_to_save["beta"](h), rtol=0, atol=0)


def test_unpatching_leaves_a_forward_that_hooks_installed_later() -> None:
    """``unpatch_peft_model`` removes its own instance forwards only, not one that (say) accelerate put
    on a wrapper or a layer after patching: removing that hook later restores the wrapper's forward."""
    model = tiny_peft_model(modules_to_save={"alpha": ["lm_head"]})
    patch_peft_model(model)
    head = model.base_model.model.lm_head
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    for module in (head, q_proj):
        module.forward = functools.partial(lambda m, *a, **k: type(m).forward(m, *a, **k), module)
    hooked = {id(module): module.forward for module in (head, q_proj)}
    unpatch_peft_model(model)
    assert all(vars(module).get("forward") is hooked[id(module)] for module in (head, q_proj))


def test_a_wrapper_wrapped_before_patching_is_refused_when_copies_differ() -> None:
    """A wrapper whose forward hooks replaced (accelerate) keeps that forward: it is guarded, not routed."""
    model = tiny_peft_model(modules_to_save={"alpha": ["lm_head"], "beta": ["lm_head"]})
    head = model.base_model.model.lm_head
    head.forward = functools.partial(type(head).forward, head)
    patch_peft_model(model)
    with multi_lora_batch(*row_batch()), pytest.raises(LoRAFusionKernelsError, match="wrapped by hooks"):
        model(input_ids=input_ids())


def test_modules_to_save_right_for_every_segment_run_in_the_context() -> None:
    """A wrapper whose one copy is right for every adapter with tokens runs: here the original lm_head
    (only alpha, absent from the batch, holds a copy; beta is active). Same as PEFT row by row."""
    model = tiny_peft_model(modules_to_save={"alpha": ["lm_head"]})
    model.train()
    rows = ["beta", "__base__", "gamma"]
    ids = input_ids()[: len(rows)]
    expected = per_row_reference(model, ids, rows)
    patch_peft_model(model)
    model.set_adapter("beta")
    train_all_adapters(model)
    assert_context_matches_rows(model, ids, rows, expected)


def test_merged_adapters_are_refused_even_when_disabled() -> None:
    """Regression: with a merged adapter and the adapters disabled, a mixed-adapter call returned the
    merged output (the disabled check came first); PEFT refuses merged adapters, and so does the patch."""
    model = tiny_peft_model()
    model.eval()
    model.merge_adapter()
    model.base_model.disable_adapter_layers()
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), pytest.raises(ValueError, match="merged adapters"):
        q_proj(x, adapter_names=["alpha", "beta"])  # unpatched PEFT
    patch_peft_model(model)
    with torch.no_grad(), pytest.raises(LoRAFusionKernelsError, match="q_proj has merged adapters"):
        q_proj(x, adapter_names=["alpha", "beta"])
    batch = MultiLoRABatch.from_segments([SEQ, SEQ], [0, 1])
    with torch.no_grad(), multi_lora_batch(batch, ["alpha", "beta"]), pytest.raises(LoRAFusionKernelsError):
        q_proj(x)


def test_layers_created_after_patching_are_refused_until_patched_again() -> None:
    """Regression: a LoRA layer that ``add_adapter`` created after ``patch_peft_model`` (lm_head here, which
    no other adapter targets) was neither patched nor guarded, and applied the active adapter to every
    segment, silently. Mixed-adapter calls now say to patch again; patched again, they match PEFT."""
    model = tiny_peft_model()
    model.train()
    patch_peft_model(model)
    delta = peft.LoraConfig(target_modules=["q_proj", "lm_head"], r=8, lora_alpha=8, init_lora_weights=False)
    model.add_adapter("delta", delta)
    model.set_adapter("delta")
    train_all_adapters(model)
    rows = ["alpha", "delta"]
    ids = input_ids()[: len(rows)]
    late = r"1 PEFT LoRA layer\(s\) .* \(base_model\.model\.lm_head\) .*: call lorafusion_kernels\.patch_peft_model"
    with multi_lora_batch(*row_batch(rows=rows)), pytest.raises(LoRAFusionKernelsError, match=late):
        model(input_ids=ids)
    with pytest.raises(LoRAFusionKernelsError, match=late):
        model(input_ids=ids, adapter_names=rows)
    expected = per_row_reference(model, ids, rows)
    patch_peft_model(model)
    assert_context_matches_rows(model, ids, rows, expected)


def test_the_late_layer_walk_runs_again_only_when_the_adapters_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk over every module costs milliseconds on a real model: once per set of adapters, not per call."""
    from lorafusion_kernels import multi_lora_routing

    walks: list[int] = []
    real_walk = multi_lora_routing._unrouted_modules
    monkeypatch.setattr(multi_lora_routing, "_unrouted_modules", lambda model: walks.append(1) or real_walk(model))
    model = tiny_peft_model()
    model.train()
    patch_peft_model(model)
    rows = ["alpha", "beta"]
    ids = input_ids()[: len(rows)]
    for _ in range(3):
        with multi_lora_batch(*row_batch(rows=rows)):
            model(input_ids=ids)
    assert len(walks) == 1
    model.add_adapter("delta", peft.LoraConfig(target_modules=["q_proj", "lm_head"], r=8, lora_alpha=8))
    with multi_lora_batch(*row_batch(rows=rows)), pytest.raises(LoRAFusionKernelsError, match="created after"):
        model(input_ids=ids)
    patch_peft_model(model)
    with multi_lora_batch(*row_batch(rows=rows)):
        model(input_ids=ids)
    assert len(walks) == 3


def test_context_needs_a_name_per_adapter() -> None:
    batch = MultiLoRABatch.from_segments([5, 6], [0, 2])
    with pytest.raises(LoRAFusionKernelsError, match="3 needed"), multi_lora_batch(batch, ["alpha", "beta"]):
        pass


def test_outside_the_context_the_active_adapter_is_used(patched_model: torch.nn.Module) -> None:
    model = patched_model
    model.eval()
    model.set_adapter("beta")
    ids = input_ids()
    with torch.no_grad():
        patched = model(input_ids=ids).logits
        unpatch_peft_model(model)
        plain = model(input_ids=ids).logits
    torch.testing.assert_close(patched, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")  # no config file for this GPU
@pytest.mark.parametrize("siblings", [False, True], ids=["layers", "siblings"])
def test_gpu_bf16_context_matches_per_row_peft(siblings: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_peft_model(dtype=torch.bfloat16, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch_peft_model(model)
    model.train()
    ids = input_ids("cuda")
    unpatch_peft_model(model)
    ref_logits, _ = per_row_reference(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch_peft_model(model)
    calls = count_sibling_calls(monkeypatch)
    if siblings:
        assert fuse_sibling_layers(model) == 4
    batch, names = row_batch("cuda")
    with multi_lora_batch(batch, names):
        logits = model(input_ids=ids).logits
    summed_row_loss(logits).backward()
    assert calls[0] == (4 if siblings else 0)
    err = (logits.float() - ref_logits.float()).norm() / ref_logits.float().norm()
    assert err < 2e-2


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(12, 20)
        self.down = torch.nn.Linear(20, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def two_layer_model(**first: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = peft.get_peft_model(
        TwoLayers(), peft.LoraConfig(target_modules=["up", "down"], r=4, init_lora_weights=False, **first)
    )
    model.add_adapter("other", peft.LoraConfig(target_modules=["up", "down"], r=8, init_lora_weights=False))
    train_all_adapters(model)
    return model


@pytest.mark.filterwarnings("ignore:lorafusion. PEFT's own LoRA path is used for adapters with lora_bias")
def test_unfusable_layers_route_per_segment_with_peft_modules() -> None:
    """``lora_bias`` cannot be fused: those layers run PEFT's own modules one segment at a time."""
    model = two_layer_model(lora_bias=True)
    patch_peft_model(model)
    model.train()
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(2))
    rows = ["other", "default", "other"]
    got = model(x, adapter_names=rows)
    expected = []
    for i, name in enumerate(rows):
        model.set_adapter(name)
        expected.append(model(x[i : i + 1]))
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-6)


def test_dora_adapters_are_refused_in_mixed_batches() -> None:
    model = two_layer_model(use_dora=True)
    patch_peft_model(model)
    batch = MultiLoRABatch.from_segments([5, 10], [0, 1])
    with (
        multi_lora_batch(batch, ["default", "other"]),
        pytest.raises(LoRAFusionKernelsError, match="DoRA"),
    ):
        model(torch.randn(15, 12))


def per_segment_reference(
    model: torch.nn.Module, call: object, x: torch.Tensor, batch: MultiLoRABatch, names: list[str]
) -> torch.Tensor:
    """``call(x_segment)`` with the segment's adapter active, outside the context: PEFT's own result."""
    pieces = []
    for start, length, adapter in batch.nonempty_segments():
        model.set_adapter(names[adapter])
        pieces.append(call(x[start : start + length]))  # type: ignore[operator]
    return torch.cat(pieces)


# The instance-level base forward below is itself a wrapped base layer (named once, per process).
@pytest.mark.filterwarnings("ignore:lorafusion. mixed-adapter batches run per segment")
@pytest.mark.parametrize(
    ("args", "kwargs"), [((0.5,), {}), ((), {"scale": 2.0})], ids=["positional-arg", "keyword-arg"]
)
def test_extra_arguments_inside_the_context_route_per_segment(
    args: tuple[float, ...], kwargs: dict[str, float]
) -> None:
    """Regression: extra arguments made the patched layer fall back to PEFT's forward (one adapter for
    every segment) or were dropped; they go to the base layer, as in PEFT, and segments keep their adapter."""
    model = two_layer_model()
    patch_peft_model(model)
    layer = model.base_model.model.up
    base = layer.base_layer

    def base_forward(x: torch.Tensor, shift: float = 0.0, *, scale: float = 1.0) -> torch.Tensor:
        return torch.nn.functional.linear(x, base.weight, base.bias) * scale + shift

    base.forward = base_forward  # a base layer taking extra arguments, as a hook wrapper may
    x = torch.randn(15, 12, generator=torch.Generator().manual_seed(3))
    batch, names = MultiLoRABatch.from_segments([5, 10], [1, 0]), ["default", "other"]
    with torch.no_grad():
        with multi_lora_batch(batch, names):
            got = layer(x, *args, **kwargs)
        peft_forward = type(layer).forward  # PEFT's own, not the patched instance forward
        expected = per_segment_reference(model, lambda xs: peft_forward(layer, xs, *args, **kwargs), x, batch, names)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_layers_wrapped_before_patching_route_per_segment() -> None:
    """Regression: a layer left unpatched because hooks already wrapped its ``forward`` computed PEFT's
    active adapter for every token inside the context; its output is now the per-segment result."""
    model = two_layer_model()
    up = model.base_model.model.up
    up.forward = functools.partial(type(up).forward, up)  # an instance-level forward, as accelerate's hooks set
    with pytest.warns(LoRAFusionKernelsWarning, match="already wrapped by hooks"):
        patch_peft_model(model)
    x = torch.randn(15, 12, generator=torch.Generator().manual_seed(4))
    batch, names = MultiLoRABatch.from_segments([6, 4, 5], [1, 0, 1]), ["default", "other"]
    with torch.no_grad():
        with multi_lora_batch(batch, names):
            got = model(x)
        expected = per_segment_reference(model, model, x, batch, names)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_hooks_on_a_layers_parts_run_in_mixed_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook on a LoRA module (activation capture, say): the layer runs per segment with PEFT's
    modules, so the hook fires once per segment, and the output is the per-segment result."""
    from lorafusion_kernels import multi_lora_routing
    from lorafusion_kernels.errors import OnceWarnings

    monkeypatch.setattr(multi_lora_routing, "_WARNED_HOOKED", OnceWarnings())  # warned once per process
    model = two_layer_model()
    patch_peft_model(model)
    fired: list[int] = []
    model.base_model.model.up.lora_A["other"].register_forward_hook(lambda _m, inputs, _o: fired.append(len(inputs[0])))
    x = torch.randn(15, 12, generator=torch.Generator().manual_seed(4))
    batch, names = MultiLoRABatch.from_segments([6, 4, 5], [1, 0, 1]), ["default", "other"]
    hooked = "per segment with PEFT's modules on layers with forward"
    with torch.no_grad(), pytest.warns(LoRAFusionKernelsWarning, match=hooked), multi_lora_batch(batch, names):
        got = model(x)
    assert fired == [6, 5], "once per segment of 'other'"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", LoRAFusionKernelsWarning)  # the reference's own single-adapter calls
        expected = per_segment_reference(model, model, x, batch, names)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Sibling layers (q/k/v, gate/up) fused into one call per group
# --------------------------------------------------------------------------------------------------


def count_sibling_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import lorafusion_kernels.peft_siblings as siblings

    calls = [0]
    real = siblings.fused_multi_lora_siblings

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(siblings, "fused_multi_lora_siblings", counted)
    return calls


def test_fused_siblings_run_one_call_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_peft_model()
    patch_peft_model(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_sibling_layers(model) == 4
    assert fuse_sibling_layers(model) == 4  # twice is harmless
    attn = model.base_model.model.model.layers[0].self_attn
    q, k = attn.q_proj.get_base_layer().weight, attn.k_proj.get_base_layer().weight
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()  # row views of one buffer
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    calls = count_sibling_calls(monkeypatch)
    batch, names = row_batch()
    with multi_lora_batch(batch, names):
        model(input_ids=input_ids())
    assert calls[0] == 4  # 2 decoder layers x (q/k/v, gate/up)
    unpatch_peft_model(model)
    assert not hasattr(attn.q_proj, "_lorafusion_sibling")


def test_replaced_weights_run_siblings_alone_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_peft_model()
    patch_peft_model(model)
    fuse_sibling_layers(model)
    for decoder in model.base_model.model.model.layers:  # as model.to(...) does: a new parameter each
        for layer in (decoder.self_attn.q_proj, decoder.mlp.up_proj):
            base = layer.get_base_layer()
            base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
    model.train()
    ids = input_ids()
    ref_logits, _ = per_row_reference(model, ids)
    calls = count_sibling_calls(monkeypatch)
    batch, names = row_batch()
    with pytest.warns(LoRAFusionKernelsWarning, match="weights were replaced"), multi_lora_batch(batch, names):
        logits = model(input_ids=ids).logits
    assert calls[0] == 0
    torch.testing.assert_close(logits.detach(), ref_logits)


def test_adapter_on_some_members_only_runs_them_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_peft_model()
    cfg = peft.LoraConfig(target_modules=["q_proj", "gate_proj"], r=8, lora_alpha=8, init_lora_weights=False)
    model.add_adapter("delta", cfg)
    train_all_adapters(model)
    patch_peft_model(model)
    fuse_sibling_layers(model)
    calls = count_sibling_calls(monkeypatch)
    names = ["delta", "alpha"]
    batch = MultiLoRABatch.from_segments([SEQ, SEQ], [0, 1], num_adapters=2)
    ids = input_ids()[:2].reshape(1, -1)
    with multi_lora_batch(batch, names):
        fused = model(input_ids=ids).logits
    assert calls[0] == 0
    unpatch_peft_model(model)
    patch_peft_model(model)
    with multi_lora_batch(batch, names):
        alone = model(input_ids=ids).logits
    torch.testing.assert_close(fused, alone)


def test_trainable_base_biases_are_not_fused() -> None:
    """A base bias that trains (PEFT's ``bias="all"``) keeps its own parameter: the group runs alone."""
    model = tiny_peft_model()
    attn = model.base_model.model.model.layers[0].self_attn
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
        base = layer.get_base_layer()
        base.bias = torch.nn.Parameter(torch.zeros(base.out_features))
    patch_peft_model(model)
    assert fuse_sibling_layers(model) == 3  # layer 0's q/k/v stays unfused
    assert not hasattr(attn.q_proj, "_lorafusion_sibling")
