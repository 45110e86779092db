"""Time one stage's forward and backward on synthetic microbatches of given token counts.

Each measurement runs the stage alone (no pipeline transfers): the first stage embeds random token
ids, later stages take random activations, the last stage computes the loss. A microbatch of ``n``
tokens holds samples of ``sample_length`` tokens (attention cost depends on them) split evenly
over the run's adapters, so the multi-adapter LoRA path is what is timed. Peak memory is measured
on CUDA only (``None`` on the CPU).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.packing import PackedBatch
    from lorafusion_megatron.pipeline.stage_model import StageModel

__all__ = ["Measurement", "measure_stage", "synthetic_batch"]


@dataclass(frozen=True)
class Measurement:
    """Median times of one stage at one token count.

    Attributes:
        stage: Pipeline stage.
        tokens: Tokens of the microbatch.
        forward_s: Forward seconds.
        backward_s: Backward seconds.
        peak_bytes: Peak device memory of a forward + backward, ``None`` on the CPU.
    """

    stage: int
    tokens: int
    forward_s: float
    backward_s: float
    peak_bytes: int | None


def synthetic_batch(
    tokens: int, adapters: Sequence[str], *, sample_length: int, vocab_size: int, device: torch.device
) -> PackedBatch:
    """A packed microbatch of random tokens: ``tokens`` in samples of ``sample_length``, adapters in turn."""
    import torch

    from lorafusion_megatron.packing import PackedBatch, SegmentSpan

    lengths = [sample_length] * (tokens // sample_length)
    if tokens % sample_length:
        lengths.append(tokens % sample_length)
    per_adapter = [lengths[i :: len(adapters)] for i in range(len(adapters))]
    spans, ordered, start = [], [], 0
    for adapter, own in zip(adapters, per_adapter, strict=True):
        if own:
            spans.append(
                SegmentSpan(adapter=adapter, global_batch=0, start=start, length=sum(own), num_samples=len(own))
            )
            ordered.extend(own)
            start += sum(own)
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab_size, (1, tokens), generator=generator)
    positions = torch.cat([torch.arange(n) for n in ordered]).unsqueeze(0)
    batch = PackedBatch(
        input_ids=ids,
        position_ids=positions,
        targets=ids[0].roll(-1),
        sample_lengths=tuple(ordered),
        segments=tuple(spans),
    )
    return batch.to(device)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_stage(
    stage: StageModel, token_counts: Sequence[int], *, sample_length: int, repeats: int = 3, warmup: int = 1
) -> list[Measurement]:
    """Median forward and backward seconds (and peak memory) of ``stage`` at each token count.

    Args:
        stage: The stage (its adapters' gradients are cleared after every run).
        token_counts: Microbatch sizes to measure.
        sample_length: Tokens per sample inside a microbatch.
        repeats: Timed runs per token count (the median is kept).
        warmup: Untimed runs before them.

    Returns:
        One measurement per token count, in the given order.
    """
    import statistics

    import torch

    device = stage.device
    vocab = int(stage.config.vocab_size)
    parameters = [p for a in stage.adapters for p in stage.lora_parameters(a).values()]
    out = []
    for tokens in token_counts:
        batch = synthetic_batch(tokens, stage.adapters, sample_length=sample_length, vocab_size=vocab, device=device)
        forwards, backwards = [], []
        peak: int | None = None
        for run in range(warmup + repeats):
            hidden = None
            if not stage.spec.is_first:
                hidden = torch.randn(1, tokens, stage.hidden_size, dtype=stage.dtype, device=device, requires_grad=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            begin = time.perf_counter()
            output = stage.forward(batch, hidden)
            _sync(device)
            middle = time.perf_counter()
            if stage.spec.is_last:
                output.sum().backward()  # type: ignore[no-untyped-call]
            else:
                output.backward(torch.ones_like(output))  # type: ignore[no-untyped-call]
            _sync(device)
            end = time.perf_counter()
            if device.type == "cuda":
                peak = max(peak or 0, int(torch.cuda.max_memory_allocated(device)))
            for p in parameters:
                p.grad = None
            if run >= warmup:
                forwards.append(middle - begin)
                backwards.append(end - middle)
        out.append(
            Measurement(
                stage=stage.spec.stage,
                tokens=tokens,
                forward_s=statistics.median(forwards),
                backward_s=statistics.median(backwards),
                peak_bytes=peak,
            )
        )
    return out
