from __future__ import annotations

import pytest
import torch

from lorafusion_megatron.packing import attention_inputs, block_causal_mask, pack_microbatch
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.testing import lora_grads, random_job
from lorafusion_megatron.testing import plan_microbatch as microbatch
from lorafusion_megatron.testing import tiny_peft_model as tiny_peft


def test_block_causal_mask_never_crosses_samples() -> None:
    mask = block_causal_mask((2, 3), torch.device("cpu")).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


def test_pack_lays_out_segments_and_restarts_positions() -> None:
    data = {"first": random_job("first", [3, 4], 2, seed=0), "second": random_job("second", [5], 1, seed=1)}
    batch = pack_microbatch(microbatch(("second", 0, (0,)), ("first", 0, (1, 0))), data)
    assert batch.sample_lengths == (5, 4, 3)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert [(s.adapter, s.start, s.length, s.num_samples) for s in batch.segments] == [
        ("second", 0, 5, 1),
        ("first", 5, 7, 2),
    ]
    assert batch.input_ids[0, 5:9].tolist() == data["first"].samples[1].input_ids.tolist()
    part = batch.segment(1)
    assert part.sample_lengths == (4, 3)
    assert part.segments[0].start == 0
    assert part.num_tokens == 7


def test_flash_attention_gets_position_ids_only() -> None:
    data = {"first": random_job("first", [3, 4], 2, seed=0)}
    batch = pack_microbatch(microbatch(("first", 0, (0, 1))), data)
    assert set(attention_inputs(batch, "flash_attention_2", torch.float32)) == {"position_ids"}
    eager = attention_inputs(batch, "eager", torch.float32)["attention_mask"]
    assert eager.shape == (1, 1, 7, 7)
    assert eager[0, 0, 3, 2] == torch.finfo(torch.float32).min


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_microbatch_equals_samples_one_by_one(attn: str) -> None:
    """Per-sample losses and LoRA gradients of a packed, mixed microbatch equal one pass per sample."""
    model, _ = tiny_peft(attn_implementation=attn)
    data = {
        "first": random_job("first", [9, 5, 12], 3, seed=0),
        "second": random_job("second", [7, 11], 2, seed=1),
    }
    denominators = {
        ("first", 0): data["first"].global_batch_targets(0),
        ("second", 0): data["second"].global_batch_targets(0),
    }
    runner = MicrobatchRunner(model, ["first", "second"], attn_implementation=attn, dtype=torch.float32, fused=False)

    packed = runner.forward_backward(
        pack_microbatch(microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1))), data), denominators
    ).get()
    packed_grads = lora_grads(model)
    model.zero_grad(set_to_none=True)

    alone = {}
    for name, job in data.items():
        for i in range(len(job)):
            [result] = runner.forward_backward(pack_microbatch(microbatch((name, 0, (i,))), data), denominators).get()
            alone[(name, i)] = result.loss_sum
    alone_grads = lora_grads(model)

    assert packed[0].loss_sum == pytest.approx(sum(alone[("first", i)] for i in range(3)), rel=1e-5)
    assert packed[1].loss_sum == pytest.approx(alone[("second", 0)] + alone[("second", 1)], rel=1e-5)
    assert set(packed_grads) == set(alone_grads)
    assert len(packed_grads) == 2 * 3 * 2 * 2
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_per_sample_logits_of_a_packed_sequence() -> None:
    """The logits of each sample inside a packed sequence equal those of the sample run alone."""
    model, _ = tiny_peft()
    data = {"first": random_job("first", [6, 9, 4], 3, seed=2)}
    batch = pack_microbatch(microbatch(("first", 0, (0, 1, 2))), data)
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, **attention_inputs(batch, "sdpa", torch.float32)).logits[0]
        start = 0
        for i, length in enumerate(batch.sample_lengths):
            ids = torch.from_numpy(data["first"].samples[i].input_ids)[None]
            alone = model(input_ids=ids).logits[0]
            torch.testing.assert_close(packed[start : start + length], alone, rtol=1e-4, atol=1e-5)
            start += length


def test_varlen_attention_matches_the_block_mask() -> None:
    """`varlen` (per-sample causal sdpa on the CPU, no mask) gives the masked sdpa's logits and gradients."""
    from lorafusion_megatron.attention import VARLEN
    from lorafusion_megatron.model import resolve_attn_implementation

    assert resolve_attn_implementation("varlen", torch.device("cpu")) == VARLEN
    data = {"first": random_job("first", [6, 9, 4], 3, seed=2), "second": random_job("second", [5, 8], 2, seed=3)}
    mb = microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    denominators = {(name, 0): job.global_batch_targets(0) for name, job in data.items()}
    results = []
    for requested, attn in (("sdpa", "sdpa"), ("varlen", VARLEN)):
        model, _ = tiny_peft(attn_implementation=requested)
        batch = pack_microbatch(mb, data)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, **attention_inputs(batch, attn, torch.float32)).logits
        runner = MicrobatchRunner(
            model, ["first", "second"], attn_implementation=attn, dtype=torch.float32, fused=False
        )
        runner.forward_backward(batch, denominators)
        results.append((logits, lora_grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
