"""Several LoRA adapters trained in a loop of your own: lorafusion-sched plans, lorafusion-kernels computes.

For a trainer that is not the ``lorafusion-megatron`` launcher. Three adapters of one PEFT model
share every microbatch of a plan; each adapter ends where training it alone, sample by sample,
would have taken it (with dropout 0, to rounding: ``integration-tests/test_own_training_loop.py``):

1. ``lorafusion_sched.plan`` packs each adapter's global batches into microbatches of at most
   ``capacity`` tokens, mixing adapters, and says after which microbatch each adapter steps.
2. A microbatch is one packed row: its samples back to back, positions restarting at 0 for each
   sample (transformers then keeps attention inside each sample), one kernel segment per sample.
3. ``lorafusion_kernels.multi_lora_batch`` routes each segment to its adapter in every PEFT LoRA layer
   (one fused op per layer, after ``patch_peft_model``).
4. Each sample's loss (the mean over its tokens) is divided by the number of samples in its adapter's
   global batch, so an adapter's gradient sums to that of the global batch alone; its optimizer steps
   at the plan's ``step_after``.

Run ``python examples/own_training_loop.py`` (a tiny random-weight LLaMA, about 20 s on a CPU;
``--device cuda`` on a GPU). Needs ``lorafusion-kernels``, ``lorafusion-sched``, ``transformers``, ``peft``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.nn import functional
from transformers import LlamaConfig, LlamaForCausalLM

import lorafusion_kernels as lk
from lorafusion_sched import AdapterJob, Microbatch, Plan, PlanOptions, plan

GLOBAL_BATCH_SIZES = {"math": 4, "code": 3, "chat": 2}
"""Adapter name -> samples per optimizer step."""


@dataclass(frozen=True)
class Workload:
    """The example's inputs: the model's size, each adapter's samples, and the training settings."""

    samples: Mapping[str, Sequence[torch.Tensor]]
    """Per adapter, its samples' token ids (int64 ``[L]``, ``L >= 2``), in training order."""
    capacity: int = 256
    learning_rate: float = 1e-2
    lora_dropout: float = 0.1
    dtype: torch.dtype = torch.float32
    seed: int = 0


def synthetic_workload(samples_per_adapter: int = 24, *, lora_dropout: float = 0.1, seed: int = 0) -> Workload:
    """``samples_per_adapter`` samples of 8 to 96 tokens per adapter, each adapter with a rule to learn.

    Adapter ``i``'s samples count up from a random token in steps of ``2 i + 1`` (modulo 256), so each
    adapter's loss falls as it learns its own step.
    """
    gen = torch.Generator().manual_seed(seed)

    def sample(step: int) -> torch.Tensor:
        length, start = int(torch.randint(8, 97, (1,), generator=gen)), int(torch.randint(0, 256, (1,), generator=gen))
        return (start + step * torch.arange(length)) % 256

    samples = {
        name: [sample(2 * i + 1) for _ in range(samples_per_adapter)] for i, name in enumerate(GLOBAL_BATCH_SIZES)
    }
    return Workload(samples=samples, lora_dropout=lora_dropout, seed=seed)


def build_model(workload: Workload, device: torch.device) -> PeftModel:
    """A two-layer LLaMA with random weights and one LoRA adapter per job, every adapter trainable."""
    torch.manual_seed(workload.seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=workload.capacity,
        attn_implementation="sdpa",
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=workload.lora_dropout, target_modules="all-linear")
    first, *others = GLOBAL_BATCH_SIZES
    model = get_peft_model(LlamaForCausalLM(config), lora, adapter_name=first)
    for name in others:
        model.add_adapter(name, lora)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)  # PEFT leaves added adapters frozen
    return model.to(device, workload.dtype)


def adapter_parameters(model: torch.nn.Module, adapter: str) -> list[torch.nn.Parameter]:
    """The LoRA weights of one adapter (PEFT names them ``...lora_A.<adapter>.weight``)."""
    return [p for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n]


def make_plan(workload: Workload) -> Plan:
    """The scheduler's plan: only lengths go in, never tokens (lorafusion-sched has no torch)."""
    jobs = [
        AdapterJob(name=name, sample_tokens=tuple(len(s) for s in samples), global_batch_size=GLOBAL_BATCH_SIZES[name])
        for name, samples in workload.samples.items()
    ]
    return plan(jobs, PlanOptions(capacity=workload.capacity))


def microbatch_loss(
    model: PeftModel, workload: Workload, microbatch: Microbatch, samples_in_batch: Mapping[tuple[str, int], int]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward of one packed microbatch: the loss to differentiate, and each adapter's share of it.

    Each sample contributes its mean token loss divided by the number of samples in its global
    batch, so an adapter's shares over the microbatches of a global batch add up to that global
    batch's mean sample loss, and its gradients to that loss's gradient.

    Args:
        model: The patched PEFT model.
        workload: The samples.
        microbatch: A plan microbatch (not a no-op).
        samples_in_batch: ``(adapter, global batch) -> samples`` of that global batch (the last may be short).
    """
    device = model.device
    names = list(GLOBAL_BATCH_SIZES)
    rows = [(seg.adapter, seg.global_batch, i) for seg in microbatch.segments for i in seg.samples]
    tokens = [workload.samples[adapter][i] for adapter, _, i in rows]
    lengths = [len(t) for t in tokens]
    ids = torch.cat(tokens).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    batch = lk.MultiLoRABatch.from_segments(
        lengths, [names.index(adapter) for adapter, _, _ in rows], num_adapters=len(names), device=device
    )
    with lk.multi_lora_batch(batch, names):
        logits = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    # Token t predicts token t + 1 of its own sample; a sample's last token predicts nothing.
    targets = torch.roll(ids, -1)
    targets[torch.tensor((*batch.segment_starts[1:], len(ids)), device=device) - 1] = -100
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in fp32 at least
    token_loss = functional.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    sample_of_token = torch.repeat_interleave(
        torch.arange(len(rows), device=device), torch.tensor(lengths, device=device)
    )
    per_sample = token_loss.new_zeros(len(rows)).index_add_(0, sample_of_token, token_loss)
    weights = per_sample.new_tensor(
        [1.0 / ((n - 1) * samples_in_batch[a, g]) for (a, g, _), n in zip(rows, lengths, strict=True)]
    )
    weighted = per_sample * weights
    shares = {seg.adapter: 0.0 for seg in microbatch.segments}
    for (adapter, _, _), value in zip(rows, weighted.tolist(), strict=True):
        shares[adapter] += value
    return weighted.sum(), shares


def samples_per_global_batch(the_plan: Plan) -> dict[tuple[str, int], int]:
    """``(adapter, global batch) -> samples`` in it, from the plan's segments."""
    counts: dict[tuple[str, int], int] = {}
    for microbatch in the_plan.microbatches:
        for seg in microbatch.segments:
            key = (seg.adapter, seg.global_batch)
            counts[key] = counts.get(key, 0) + len(seg.samples)
    return counts


def train(workload: Workload, device: torch.device) -> tuple[PeftModel, dict[str, list[float]]]:
    """Train every adapter together along the plan; returns the model and each adapter's loss per step."""
    model = build_model(workload, device)
    lk.patch_peft_model(model)
    model.train()
    the_plan = make_plan(workload)
    counts = samples_per_global_batch(the_plan)
    optimizers = {
        name: torch.optim.AdamW(adapter_parameters(model, name), lr=workload.learning_rate)
        for name in GLOBAL_BATCH_SIZES
    }
    losses: dict[str, list[float]] = {name: [] for name in GLOBAL_BATCH_SIZES}
    running = dict.fromkeys(GLOBAL_BATCH_SIZES, 0.0)
    torch.manual_seed(workload.seed)  # dropout masks
    for microbatch in the_plan.microbatches:
        if microbatch.noop:  # a pipeline's bubble filler; nothing to compute in one process
            continue
        loss, shares = microbatch_loss(model, workload, microbatch, counts)
        loss.backward()
        for name, share in shares.items():
            running[name] += share
        for name in microbatch.step_after:
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(running[name])
            running[name] = 0.0
    return model, losses


def main(argv: Sequence[str] | None = None) -> None:
    """Plan, train and print each adapter's loss at its first and last step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--samples", type=int, default=24, help="samples per adapter")
    args = parser.parse_args(argv)
    workload = synthetic_workload(args.samples)
    stats = make_plan(workload).stats
    print(
        f"plan: {stats.num_microbatches} microbatches ({workload.capacity} tokens at most), {stats.fill_ratio:.0%} full"
    )
    _, losses = train(workload, torch.device(args.device))
    for name, values in losses.items():
        print(f"{name}: {len(values)} steps, mean sample loss {values[0]:.3f} (first step) -> {values[-1]:.3f} (last)")


if __name__ == "__main__":
    main()
