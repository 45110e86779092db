"""Several LoRA adapters trained in a loop of your own: lorafusion-sched plans, lorafusion-kernels computes.

For a trainer that is not the ``lorafusion-megatron`` launcher. Three adapters of one PEFT model
share the microbatches of a plan; each adapter ends where training it alone, sample by sample,
would have taken it (with dropout 0, to rounding: ``integration-tests/test_own_training_loop.py``):

1. ``lorafusion_sched.plan`` packs each adapter's global batches into microbatches of at most
   ``capacity`` tokens, mixing adapters, and says after which microbatch each adapter steps.
2. A microbatch is one packed row: its samples back to back, positions restarting at 0 for each
   sample, one kernel segment per sample. With no attention mask and no cache, transformers
   (4.57 or newer) reads the sample boundaries from the positions and keeps attention inside each
   sample; older versions attend across samples.
3. ``lorafusion_kernels.multi_lora_batch`` routes each segment to its adapter in every PEFT LoRA layer
   (one fused op per layer, after ``patch_peft_model``).
4. Each sample's loss (the mean over its predicted tokens) is divided by the number of samples in its
   adapter's global batch, so an adapter's gradients sum to those of its global batch; its optimizer
   steps at the plan's ``step_after`` (clip and schedule per adapter there too).

One process, no data parallelism (``docs/sched/index.md`` says what changes with replicas). The
loop itself does not wait for the GPU: each microbatch's index tensors are built on the host and
copied without blocking, and the losses are read once, at the end (transformers' detection of the
packed samples waits once per forward; with sdpa it also builds a ``[T, T]`` mask).

Run ``python examples/own_training_loop.py`` (a tiny random-weight LLaMA, about 20 s on a CPU;
``--device cuda`` on a GPU). Needs ``lorafusion-kernels``, ``lorafusion-sched``, ``transformers``, ``peft``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence

import torch
import transformers
from packaging.version import Version
from peft import LoraConfig, PeftModel, get_peft_model
from torch.nn import functional
from transformers import LlamaConfig, LlamaForCausalLM

import lorafusion_kernels as lk
from lorafusion_sched import AdapterJob, Microbatch, Plan, PlanOptions, plan

GLOBAL_BATCH_SIZES = {"math": 4, "code": 3, "chat": 2}
"""Adapter name -> samples per optimizer step."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """The example's inputs: each adapter's samples and the training settings."""

    samples: Mapping[str, Sequence[torch.Tensor]]
    """Per adapter, its samples' token ids (int64 ``[L]``, ``L >= 2``), in training order."""
    capacity: int = 256
    learning_rate: float = 1e-2
    lora_dropout: float = 0.1
    dtype: torch.dtype = torch.float32
    truncate: bool = False
    """Cut samples longer than ``capacity`` to it (the plan's ``truncate``) instead of refusing them."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name, samples in self.samples.items():
            short = [i for i, tokens in enumerate(samples) if len(tokens) < 2]
            if short:
                raise ValueError(
                    f"adapter {name!r}: samples {short[:5]} have fewer than 2 tokens; a sample needs one token "
                    "to predict from and one to predict: drop them before planning"
                )


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
    if Version(transformers.__version__) < Version("4.57"):
        raise RuntimeError(
            f"transformers {transformers.__version__} attends across the samples of a packed row: use 4.57 or newer"
        )
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
    return plan(jobs, PlanOptions(capacity=workload.capacity, truncate=workload.truncate))


@dataclasses.dataclass(frozen=True)
class PackedMicrobatch:
    """One microbatch's inputs, built on the host: ``T`` tokens of ``n`` samples back to back."""

    ids: torch.Tensor
    """int64 ``[T]``."""
    positions: torch.Tensor
    """int64 ``[T]``: 0, 1, ... within each sample."""
    targets: torch.Tensor
    """int64 ``[T]``: the next token of the same sample; -100 at each sample's last token."""
    sample_of_token: torch.Tensor
    """int64 ``[T]``: the sample each token belongs to."""
    weights: torch.Tensor
    """fp64 ``[n]``: ``1 / (predicted tokens x samples in the sample's global batch)``."""
    adapter_of_sample: torch.Tensor
    """int64 ``[n]``: the adapter index of each sample."""
    lengths: tuple[int, ...]
    """Tokens per sample: the kernel segments."""
    adapters: tuple[int, ...]
    """The adapter index of each sample, on the host (``adapter_of_sample`` is the same on the device)."""

    def to(self, device: torch.device) -> PackedMicrobatch:
        """The tensors on ``device``, copied without waiting for the device (pinned, non-blocking)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

        tensors = ("ids", "positions", "targets", "sample_of_token", "weights", "adapter_of_sample")
        return dataclasses.replace(self, **{name: move(getattr(self, name)) for name in tensors})


def pack(
    workload: Workload, the_plan: Plan, microbatch: Microbatch, counts: Mapping[tuple[str, int], int]
) -> PackedMicrobatch:
    """The host tensors of one microbatch (not a no-op); samples are cut to the plan's lengths.

    Args:
        workload: The samples.
        the_plan: The plan (its ``adapters`` hold each sample's length as scheduled, after truncation).
        microbatch: One of ``the_plan``'s microbatches.
        counts: ``(adapter, global batch) -> samples`` of that global batch (the last may be short).
    """
    names = list(GLOBAL_BATCH_SIZES)
    planned = {info.name: info.sample_tokens for info in the_plan.adapters}
    rows = [(seg.adapter, seg.global_batch, i) for seg in microbatch.segments for i in seg.samples]
    tokens = [workload.samples[a][i][: planned[a][i]] for a, _, i in rows]
    lengths = tuple(len(t) for t in tokens)
    adapters = tuple(names.index(a) for a, _, _ in rows)
    ids = torch.cat(tokens)
    targets = torch.roll(ids, -1)
    targets[torch.tensor(lengths).cumsum(0) - 1] = -100  # a sample's last token predicts nothing
    return PackedMicrobatch(
        ids=ids,
        positions=torch.cat([torch.arange(n) for n in lengths]),
        targets=targets,
        sample_of_token=torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths)),
        weights=torch.tensor(
            [1.0 / ((n - 1) * counts[a, g]) for (a, g, _), n in zip(rows, lengths, strict=True)], dtype=torch.float64
        ),
        adapter_of_sample=torch.tensor(adapters),
        lengths=lengths,
        adapters=adapters,
    )


def microbatch_loss(model: PeftModel, packed: PackedMicrobatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of one packed microbatch: the loss to differentiate, and each adapter's share of it.

    Each sample contributes its mean token loss divided by the number of samples in its global
    batch, so an adapter's shares over the microbatches of a global batch add up to that global
    batch's mean sample loss, and its gradients to that loss's gradient.

    Args:
        model: The patched PEFT model.
        packed: The microbatch, on the model's device.

    Returns:
        The scalar loss, and the detached shares ``[num_adapters]`` (zero for adapters not in it).
    """
    names = list(GLOBAL_BATCH_SIZES)
    batch = lk.MultiLoRABatch.from_segments(
        packed.lengths, packed.adapters, num_adapters=len(names), device=packed.ids.device
    )
    with lk.multi_lora_batch(batch, names):
        logits = model(input_ids=packed.ids[None], position_ids=packed.positions[None], use_cache=False).logits[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in fp32 at least
    token_loss = functional.cross_entropy(logits, packed.targets, ignore_index=-100, reduction="none")
    per_sample = token_loss.new_zeros(len(packed.lengths)).index_add_(0, packed.sample_of_token, token_loss)
    weighted = per_sample * packed.weights.to(per_sample.dtype)
    shares = weighted.new_zeros(len(names)).index_add_(0, packed.adapter_of_sample, weighted.detach())
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
    names = list(GLOBAL_BATCH_SIZES)
    optimizers = {name: torch.optim.AdamW(adapter_parameters(model, name), lr=workload.learning_rate) for name in names}
    running = torch.zeros(len(names), dtype=torch.float64, device=device)  # each adapter's loss in its global batch
    steps: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    torch.manual_seed(workload.seed)  # dropout masks
    for microbatch in the_plan.microbatches:
        if not microbatch.noop:  # a no-op fills a pipeline bubble: nothing to compute in one process
            loss, shares = microbatch_loss(model, pack(workload, the_plan, microbatch, counts).to(device))
            loss.backward()
            running += shares
        for name in microbatch.step_after:  # on a no-op too, should a plan put one there
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            steps[name].append(running[names.index(name)].clone())
            running[names.index(name)] = 0.0
    return model, {name: [float(v) for v in values] for name, values in steps.items()}  # the one wait


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
