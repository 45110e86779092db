"""Dropout draws keyed by layer and samples: the same in any process and in any order."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from lorafusion_megatron.dropout_seeds import (
    current_draws,
    drawing_for,
    drawing_segment,
    install_dropout_seeding,
    samples_key,
    with_draws_restored,
)
from lorafusion_megatron.testing import plan_microbatch
from lorafusion_sched.models import Microbatch

M0 = plan_microbatch(("first", 0, (0, 1)), ("second", 0, (0,)))
M1 = plan_microbatch(("first", 0, (2,)))


class _Draws(torch.nn.Module):
    """A layer that only draws: an ``nn.Dropout`` mask and a kernel-style integer seed."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.nn.functional.dropout(torch.ones_like(hidden), p=0.5, training=True)
        seed = torch.randint(0, 2**62, (1,), device=hidden.device)
        return mask, seed


def _layers() -> dict[int, torch.nn.Module]:
    layers: dict[int, torch.nn.Module] = {0: _Draws(), 1: _Draws()}
    install_dropout_seeding(layers, run_seed=7)
    return layers


def _run(layers: dict[int, torch.nn.Module], order: list[tuple[Microbatch, int | None, int]]) -> dict[Any, Any]:
    """Call the layers in ``order`` (microbatch, segment or whole, layer), drawing in between; the draws."""
    hidden = torch.zeros(8, 16)
    out = {}
    for microbatch, segment, layer in order:
        torch.rand(3)  # an unrelated draw must not shift the layer's
        with drawing_for(microbatch), contextlib.nullcontext() if segment is None else drawing_segment(segment):
            out[(samples_key(microbatch.segments), segment, layer)] = layers[layer](hidden)
    return out


def test_a_layers_draws_do_not_depend_on_the_order_or_the_process() -> None:
    keys = [(M0, s, layer) for s in (None, 0, 1) for layer in (0, 1)] + [(M1, None, layer) for layer in (0, 1)]
    in_order = _run(_layers(), keys)
    # Another "process": fresh layers, a different generator state, reversed and interleaved order.
    torch.manual_seed(12345)
    shuffled = _run(_layers(), keys[::-1][::2] + keys[::-1][1::2])
    assert in_order.keys() == shuffled.keys()
    for key, (mask, seed) in in_order.items():
        assert torch.equal(mask, shuffled[key][0]), key
        assert torch.equal(seed, shuffled[key][1]), key
    seeds = [int(seed) for _, seed in in_order.values()]
    assert len(set(seeds)) == len(seeds), "every (microbatch, segment, layer) draws afresh"


def test_the_run_seed_changes_the_draws() -> None:
    other: dict[int, torch.nn.Module] = {0: _Draws()}
    install_dropout_seeding(other, run_seed=8)
    with drawing_for(M0):
        assert not torch.equal(_layers()[0](torch.zeros(1))[1], other[0](torch.zeros(1))[1])


def test_outside_a_microbatch_the_generator_is_left_alone() -> None:
    hidden = torch.zeros(8, 16)
    torch.manual_seed(3)
    mask, seed = _Draws()(hidden)
    torch.manual_seed(3)
    with drawing_segment(1):  # no microbatch: nothing to draw for
        assert current_draws() is None
        hooked_mask, hooked_seed = _layers()[0](hidden)
    assert torch.equal(hooked_mask, mask)
    assert torch.equal(hooked_seed, seed)


def test_the_key_names_the_samples_not_the_slot() -> None:
    moved = M0.model_copy(update={"step_after": ("first",), "replica": 1})
    assert samples_key(moved.segments) == samples_key(M0.segments)
    assert samples_key(M1.segments) != samples_key(M0.segments)
    swapped = plan_microbatch(("second", 0, (0,)), ("first", 0, (0, 1)))
    assert samples_key(swapped.segments) != samples_key(M0.segments)


def test_a_segment_run_alone_draws_the_same_whatever_it_is_packed_with() -> None:
    """Plain PEFT: segment ``second/0/(0,)`` is segment 1 of ``M0`` and segment 0 of another microbatch."""
    layers = _layers()
    hidden = torch.zeros(8, 16)
    with drawing_for(M0), drawing_segment(1):
        in_m0 = layers[0](hidden)
    with drawing_for(plan_microbatch(("second", 0, (0,)), ("first", 1, (3,)))), drawing_segment(0):
        elsewhere = layers[0](hidden)
    assert torch.equal(in_m0[0], elsewhere[0])
    assert torch.equal(in_m0[1], elsewhere[1])


def test_a_recomputation_draws_for_its_own_microbatch() -> None:
    """Checkpointed forward of ``M0``, backward while ``M1`` is current: the gradient of ``M0``'s masks."""
    import torch.utils.checkpoint

    class Dropout(torch.nn.Module):
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            # Draws a seed and rebuilds the mask from it, as the fused ops do in their backward.
            generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
            return hidden * (torch.rand(hidden.shape, generator=generator) > 0.5)

    layer = Dropout()
    install_dropout_seeding({0: layer}, run_seed=0)
    x = torch.ones(32, requires_grad=True)
    with drawing_for(M0):
        expected = layer(x).detach()

    def nothing() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        return contextlib.nullcontext(), contextlib.nullcontext()

    with drawing_for(M0):
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=with_draws_restored(nothing))
    assert torch.equal(y.detach(), expected)
    with drawing_for(M1):
        y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, expected)


@pytest.mark.gpu
def test_on_a_gpu_the_cuda_draws_do_not_depend_on_the_order() -> None:
    """The layer's CUDA generator is reseeded: ``nn.Dropout`` masks and the fused Triton op's dropout."""
    import lorafusion_kernels

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(1)
    weight, lora_a, lora_b = (
        torch.randn(*shape, device=device, generator=generator) for shape in ((64, 32), (4, 32), (64, 4))
    )

    class Fused(torch.nn.Module):
        def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            fused = lorafusion_kernels.fused_lora_linear(hidden, weight, lora_a, lora_b, scaling=2.0, dropout_p=0.3)
            return fused, torch.nn.functional.dropout(hidden, p=0.3, training=True)

    def run(order: list[tuple[Microbatch, int]]) -> dict[tuple[bytes, int], tuple[torch.Tensor, torch.Tensor]]:
        layers: dict[int, torch.nn.Module] = {0: Fused(), 1: Fused()}
        install_dropout_seeding(layers, run_seed=7)
        hidden = torch.ones(128, 32, device=device)
        out = {}
        for microbatch, layer in order:
            torch.rand(5, device=device)  # an unrelated draw must not shift the layer's
            with drawing_for(microbatch):
                out[(samples_key(microbatch.segments), layer)] = layers[layer](hidden)
        return out

    keys = [(m, layer) for m in (M0, M1) for layer in (0, 1)]
    in_order = run(keys)
    torch.manual_seed(12345)
    shuffled = run(keys[::-1])
    for key, (fused, dropped) in in_order.items():
        assert torch.equal(fused, shuffled[key][0])
        assert torch.equal(dropped, shuffled[key][1])
    assert not torch.equal(in_order[(samples_key(M0.segments), 0)][1], in_order[(samples_key(M0.segments), 1)][1])


@pytest.fixture(scope="module")
def three_layer_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer tiny LLaMA saved as a local folder (stages of unequal size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion_megatron.presets import PRESETS

    folder = tmp_path_factory.mktemp("three-layer")
    preset = PRESETS["tiny"]
    config = AutoConfig.for_model(preset.model_type, **{**preset.config, "num_hidden_layers": 3})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain-peft"])
@pytest.mark.parametrize(
    "activation_checkpointing",
    # Without recomputation the draws are those of the recompute run's forward (slow on two cores: about 8 s each).
    [pytest.param(False, marks=pytest.mark.slow, id="keep"), pytest.param(True, id="recompute")],
)
def test_stages_run_out_of_order_give_the_full_models_gradients(
    three_layer_base: Path, tmp_path: Path, fused: bool, activation_checkpointing: bool
) -> None:
    """Two stages in one process, 1F1B order (backwards after the next forward), ``lora_dropout = 0.3``."""
    from lorafusion_megatron.config import parse_config
    from lorafusion_megatron.model import attach_adapters, build_base_model, load_model_config
    from lorafusion_megatron.packing import pack_microbatch
    from lorafusion_megatron.pipeline.partition import partition_model
    from lorafusion_megatron.pipeline.stage_model import build_stage_model
    from lorafusion_megatron.runner import MicrobatchRunner
    from lorafusion_megatron.testing import random_job

    cpu = torch.device("cpu")
    jobs = [
        {"name": n, "dataset": {"synthetic": "xsum"}, "r": 4, "lora_alpha": 8, "lora_dropout": 0.3}
        for n in ("first", "second")
    ]
    runtime = {"device": "cpu", "activation_checkpointing": activation_checkpointing, "fused_kernels": fused}
    config = parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {
                "model_name_or_path": str(three_layer_base),
                "dtype": "float32",
                "attn_implementation": "sdpa",
            },
            "jobs": jobs,
            "runtime": runtime,
        }
    )
    data = {"first": random_job("first", [5, 7, 4], 3, seed=1), "second": random_job("second", [6, 3], 2, seed=2)}
    microbatches = [M0, plan_microbatch(("first", 0, (2,)), ("second", 0, (1,)))]
    batches = [pack_microbatch(m, data) for m in microbatches]
    denominators = {("first", 0): 13, ("second", 0): 7}

    base = build_base_model(
        config.base_model, device=cpu, seed=0, recomputed_layers=3 if activation_checkpointing else 0
    )
    reference = attach_adapters(base, config.jobs, seed=0, name_or_path=str(three_layer_base))
    if fused:
        import lorafusion_kernels

        lorafusion_kernels.patch_peft_model(reference)
    install_dropout_seeding(dict(enumerate(base.model.layers)), run_seed=config.runtime.seed)
    runner = MicrobatchRunner(
        reference, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=fused
    )
    for microbatch, batch in zip(microbatches, batches, strict=True):
        with drawing_for(microbatch):
            runner.forward_backward(batch, denominators)

    specs = partition_model(load_model_config(config.base_model).to_dict(), 2)
    first, last = (build_stage_model(config, spec, cpu) for spec in specs)
    torch.manual_seed(99)  # the stages' processes start from other generator states

    def forward_first(k: int) -> torch.Tensor:
        with drawing_for(microbatches[k]):
            return first.forward(batches[k], None)

    def forward_backward_last(k: int, hidden: torch.Tensor) -> torch.Tensor:
        received = hidden.detach().requires_grad_(True)
        with drawing_for(microbatches[k]):
            token_loss = last.forward(batches[k], received)
        objective = sum(
            token_loss[s.start : s.start + s.length].sum() / denominators[(s.adapter, 0)] for s in batches[k].segments
        )
        assert isinstance(objective, torch.Tensor)
        objective.backward()
        assert received.grad is not None
        return received.grad

    hidden = [forward_first(0), forward_first(1)]
    grads = [forward_backward_last(1, hidden[1]), forward_backward_last(0, hidden[0])]
    hidden[1].backward(grads[0])
    with drawing_for(microbatches[1]):  # another microbatch current: a recomputation must not see it
        hidden[0].backward(grads[1])

    full = dict(reference.named_parameters())
    checked = 0
    for stage in (first, last):
        for name in ("first", "second"):
            for key, param in stage.lora_parameters(name).items():
                torch.testing.assert_close(param.grad, full[key].grad, rtol=1e-5, atol=1e-7, msg=key)
                checked += 1
    assert checked == sum(1 for k in full if ".lora_" in k)
