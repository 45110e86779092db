from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from lorafusion_megatron.token_loss import causal_lm_token_losses, chunked_token_losses, default_chunk_tokens

VOCAB, WIDTH = 37, 8


def _inputs(
    tokens: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, ignored: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded hidden [T, H], weight [V, H], bias [V] and targets [T] with about ``ignored`` of them -100."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    weight = torch.randn(VOCAB, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    bias = torch.randn(VOCAB, generator=generator, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator)
    targets[torch.rand(tokens, generator=generator) < ignored] = -100
    return hidden, weight, bias, targets


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias).double(), targets, reduction="none")


@pytest.mark.parametrize(
    ("tokens", "chunk"), [(50, 16), (50, 64), (50, 1), (48, 16)], ids=["T50-c16", "T50-c64", "T50-c1", "T48-c16"]
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_losses_and_gradients_match_full_logits(tokens: int, chunk: int, with_bias: bool) -> None:
    """Chunks that do not divide T, one chunk larger than T, chunks of one row: all equal full logits."""
    hidden, weight, bias, targets = _inputs(tokens)
    bias_or_none = bias if with_bias else None
    upstream = torch.rand(tokens, generator=torch.Generator().manual_seed(1))
    hidden_64 = hidden.double().requires_grad_(True)
    weight_64 = weight.double().requires_grad_(True)
    bias_64 = bias.double().requires_grad_(True) if with_bias else None
    expected = _reference(hidden_64, weight_64, bias_64, targets)
    (expected * upstream).sum().backward()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    bias.requires_grad_(with_bias)

    losses = chunked_token_losses(hidden, weight, targets, bias=bias_or_none, chunk_tokens=chunk)
    (losses * upstream).sum().backward()

    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), hidden_64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), weight_64.grad, rtol=1e-5, atol=1e-6)
    if bias_64 is not None:
        torch.testing.assert_close(bias.grad.double(), bias_64.grad, rtol=1e-5, atol=1e-6)


def test_ignored_rows_have_zero_loss_and_no_gradient() -> None:
    hidden, weight, _, targets = _inputs(20, ignored=0.5)
    ignored = targets == -100
    assert 0 < int(ignored.sum()) < 20
    hidden.requires_grad_(True)
    losses = chunked_token_losses(hidden, weight, targets, chunk_tokens=6)
    losses.sum().backward()
    assert torch.equal(losses[ignored], torch.zeros(int(ignored.sum())))
    assert bool((losses[~ignored] > 0).all())
    assert torch.equal(hidden.grad[ignored], torch.zeros(int(ignored.sum()), WIDTH))


def test_frozen_head_gets_no_gradient() -> None:
    hidden, weight, bias, targets = _inputs(20)
    hidden.requires_grad_(True)
    chunked_token_losses(hidden, weight, targets, bias=bias, chunk_tokens=7).sum().backward()
    assert hidden.grad is not None
    assert weight.grad is None
    assert bias.grad is None


def test_bf16_matches_eager_bf16_logits() -> None:
    """In a 2-byte dtype the chunked loss rounds the logits exactly as the HF path does."""
    hidden, weight, _, targets = _inputs(30, dtype=torch.bfloat16)
    expected = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")
    torch.testing.assert_close(chunked_token_losses(hidden, weight, targets, chunk_tokens=8), expected)


def test_saved_tensors_do_not_grow_with_the_logits() -> None:
    """Autograd keeps O(T (H + 1)) bytes for the backward, not the T x V logits."""
    tokens, vocab = 256, 4096
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, WIDTH, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, WIDTH, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    logits_bytes = tokens * vocab * 4

    def saved_bytes(loss_fn: object) -> int:
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss_fn()  # type: ignore[operator]
        return sum(seen.values())

    full = saved_bytes(lambda: F.cross_entropy(F.linear(hidden, weight), targets, reduction="none"))
    chunked = saved_bytes(lambda: chunked_token_losses(hidden, weight, targets, chunk_tokens=32))
    inputs = hidden.nbytes + weight.nbytes + targets.nbytes
    assert full >= logits_bytes
    assert hidden.nbytes + weight.nbytes <= chunked  # the hooks do see what the function saves
    assert chunked <= inputs + 2 * tokens * 4 + tokens  # + log-sum-exp, picked ids, trained mask
    assert chunked < logits_bytes / 10


def test_default_chunk_tokens_follows_the_vocabulary() -> None:
    assert default_chunk_tokens(128_256) == 1_046
    assert default_chunk_tokens(32_000) == 4_194
    assert default_chunk_tokens(2**40) == 1


@pytest.mark.parametrize("error", ["hidden", "targets", "bias", "chunk"])
def test_bad_arguments_are_refused(error: str) -> None:
    hidden, weight, bias, targets = _inputs(10)
    kwargs = {"bias": bias, "chunk_tokens": 4}
    if error == "hidden":
        hidden = hidden[:, :-1]
    elif error == "targets":
        targets = targets[:-1]
    elif error == "bias":
        kwargs["bias"] = bias[:-1]
    else:
        kwargs["chunk_tokens"] = 0
    with pytest.raises(ValueError, match=error if error != "chunk" else "chunk_tokens"):
        chunked_token_losses(hidden, weight, targets, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_causal_lm_losses_equal_hf_logits(tied: bool) -> None:
    """From the decoder's hidden state, the loss of the HF model's own logits; tied heads too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    ids = torch.randint(0, VOCAB, (1, 12))
    targets = torch.randint(0, VOCAB, (12,))
    targets[:3] = -100

    expected = F.cross_entropy(model(input_ids=ids).logits[0].float(), targets, reduction="none")
    expected.sum().backward()
    expected_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    losses = causal_lm_token_losses(model, model.model(input_ids=ids).last_hidden_state, targets)
    losses.sum().backward()

    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, expected_grad)


def _gemma2(vocab: int) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=vocab,
        final_logit_softcapping=0.5,  # small, so that the capping changes the losses
    )
    return Gemma2ForCausalLM(config)


def _granite(vocab: int) -> Any:
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=vocab,
        logits_scaling=4.0,
    )
    return GraniteForCausalLM(config)


@pytest.mark.parametrize("build", [_gemma2, _granite], ids=["softcapping", "logits_scaling"])
def test_models_that_transform_their_logits_get_hf_s_losses(build: Callable[[int], Any]) -> None:
    torch.manual_seed(0)
    model = build(VOCAB).float()
    ids = torch.randint(0, VOCAB, (1, 6))
    targets = torch.randint(0, VOCAB, (6,))
    expected = F.cross_entropy(model(input_ids=ids).logits[0].float(), targets, reduction="none")
    hidden = model.model(input_ids=ids).last_hidden_state
    got = causal_lm_token_losses(model, hidden, targets)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_lora_on_the_lm_head_runs_the_module_itself() -> None:
    """A wrapped output layer (PEFT LoRA on ``lm_head``) is not bypassed: its adapter gets gradients."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorafusion_megatron.model import quiet_peft_deprecations

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=VOCAB
    )
    with quiet_peft_deprecations():
        model = get_peft_model(
            LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False)
        )
    causal_lm = model.base_model.model
    ids = torch.randint(0, VOCAB, (1, 9))
    targets = torch.randint(0, VOCAB, (9,))

    expected = F.cross_entropy(model(input_ids=ids).logits[0].float(), targets, reduction="none")
    losses = causal_lm_token_losses(causal_lm, causal_lm.model(input_ids=ids).last_hidden_state, targets)
    losses.sum().backward()

    torch.testing.assert_close(losses, expected)
    assert causal_lm.lm_head.lora_B["default"].weight.grad is not None
