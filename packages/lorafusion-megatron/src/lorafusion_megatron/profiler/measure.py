"""Time one stage's forward and backward on synthetic microbatches of given token counts.

Each measurement runs the stage alone (no pipeline transfers): the first stage embeds random token
ids, later stages take random activations, the last stage computes the loss. A microbatch of ``n``
tokens holds samples of ``sample_length`` tokens (attention cost depends on them) split evenly
over the run's adapters, so the multi-adapter LoRA path is what is timed. Peak memory is measured
on CUDA only (``None`` on the CPU). Token counts run smallest first; the first one that runs out
of device memory ends the measurements (every larger one would too), and is reported as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.packing import PackedBatch
    from lorafusion_megatron.pipeline.stage_model import StageModel

__all__ = ["Measurement", "StageMeasurements", "measure_stage", "synthetic_batch"]

_log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class StageMeasurements:
    """What :func:`measure_stage` found on one stage.

    Attributes:
        measurements: One per token count that fits, smallest first.
        out_of_memory_at: The smallest token count that ran out of device memory (larger ones are
            not tried), ``None`` when every count fits.
    """

    measurements: list[Measurement]
    out_of_memory_at: int | None = None


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
) -> StageMeasurements:
    """Median forward and backward seconds (and peak memory) of ``stage`` at each token count.

    Args:
        stage: The stage (its adapters' gradients are cleared after every run).
        token_counts: Microbatch sizes to measure (run smallest first).
        sample_length: Tokens per sample inside a microbatch.
        repeats: Timed runs per token count (the median is kept).
        warmup: Untimed runs before them.

    Returns:
        The measurements of the counts that fit and the first count that ran out of memory, if any.
    """
    import torch

    parameters = [p for a in stage.adapters for p in stage.lora_parameters(a).values()]
    out = []
    for tokens in sorted(token_counts):
        try:
            out.append(_measure(stage, parameters, tokens, sample_length=sample_length, runs=(warmup, repeats)))
            continue
        except torch.OutOfMemoryError:
            pass  # handled below, once the exception and the frames holding the run's tensors are gone
        finally:
            for p in parameters:
                p.grad = None
        torch.cuda.empty_cache()
        _log.warning(
            "stage %d: a microbatch of %d tokens runs out of device memory; larger ones are not measured",
            stage.spec.stage,
            tokens,
        )
        return StageMeasurements(out, out_of_memory_at=tokens)
    return StageMeasurements(out)


def _measure(
    stage: StageModel,
    parameters: list[torch.nn.Parameter],
    tokens: int,
    *,
    sample_length: int,
    runs: tuple[int, int],
) -> Measurement:
    """One token count: ``runs = (warm-up, timed)`` forward + backward passes, medians of the timed ones."""
    import statistics

    import torch

    device = stage.device
    batch = synthetic_batch(
        tokens, stage.adapters, sample_length=sample_length, vocab_size=int(stage.config.vocab_size), device=device
    )
    warmup, repeats = runs
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
    return Measurement(
        stage=stage.spec.stage,
        tokens=tokens,
        forward_s=statistics.median(forwards),
        backward_s=statistics.median(backwards),
        peak_bytes=peak,
    )
