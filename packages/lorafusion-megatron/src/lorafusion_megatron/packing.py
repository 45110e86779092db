"""Pack a plan microbatch into one token sequence whose samples never see each other.

The segments of a microbatch (one per adapter) are laid out back to back, each holding its samples
back to back: ``[a0 a1 | b0 b1 b2 | c0]``. Position ids restart at 0 for every sample, targets are
already shifted per sample (see :mod:`lorafusion_megatron.data.samples`), and attention is
block-diagonal causal: token ``t`` of sample ``s`` attends to tokens ``0..t`` of ``s`` only. The
variable-length kernels get the sample boundaries without a mask: ``lorafusion_varlen``
(:mod:`lorafusion_megatron.attention`) as cumulative lengths, flash-attn's kernel from where the
position ids restart; sdpa and eager attention get an explicit ``[1, 1, T, T]`` block mask.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from lorafusion_megatron.host_copy import to_device

if TYPE_CHECKING:
    import torch

    from lorafusion_kernels import MultiLoRABatch
    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_sched.models import Microbatch

__all__ = ["PackedBatch", "SegmentSpan", "attention_inputs", "block_causal_mask", "pack_microbatch"]


@dataclass(frozen=True)
class SegmentSpan:
    """One adapter's tokens inside a packed batch.

    Attributes:
        adapter: Job (adapter) name.
        global_batch: The adapter's global batch these samples belong to.
        start: Offset of the first token in the packed sequence.
        length: Tokens of the segment.
        num_samples: Samples in the segment.
        targets: Trained tokens of the segment, counted on the host by :func:`pack_microbatch` (so the
            runner needs no device read-back); ``None`` where the caller did not count them.
    """

    adapter: str
    global_batch: int
    start: int
    length: int
    num_samples: int
    targets: int | None = None


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """A packed microbatch, ready for the model.

    Attributes:
        input_ids: int64 ``[1, T]``.
        position_ids: int64 ``[1, T]``, restarting at 0 for every sample.
        targets: int64 ``[T]``, ``-100`` where the loss ignores the position.
        sample_lengths: Tokens per sample, in sequence order (sum ``T``).
        segments: Per-adapter spans, in sequence order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    sample_lengths: tuple[int, ...]
    segments: tuple[SegmentSpan, ...]

    @property
    def num_tokens(self) -> int:
        """``T``: tokens in the sequence."""
        return sum(self.sample_lengths)

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with its (host) tensors on ``device``; the host does not wait for the device."""
        return replace(
            self,
            input_ids=to_device(self.input_ids, device),
            position_ids=to_device(self.position_ids, device),
            targets=to_device(self.targets, device),
        )

    def multi_lora_routing(self, adapters: Sequence[str]) -> MultiLoRABatch:
        """FusedMultiLoRA's routing of this batch: its segments, adapters numbered by ``adapters``.

        Built once per microbatch, on the batch's device, and shared by every LoRA layer.
        """
        import lorafusion_kernels

        index = {name: i for i, name in enumerate(adapters)}
        return lorafusion_kernels.MultiLoRABatch.from_segments(
            [span.length for span in self.segments],
            [index[span.adapter] for span in self.segments],
            num_adapters=len(adapters),
            device=self.input_ids.device,
        )

    def segment(self, index: int) -> PackedBatch:
        """A batch holding only segment ``index`` (for running one adapter at a time)."""
        span = self.segments[index]
        first_sample = sum(s.num_samples for s in self.segments[:index])
        rows = slice(span.start, span.start + span.length)
        return PackedBatch(
            input_ids=self.input_ids[:, rows],
            position_ids=self.position_ids[:, rows],
            targets=self.targets[rows],
            sample_lengths=self.sample_lengths[first_sample : first_sample + span.num_samples],
            segments=(replace(span, start=0),),
        )


def pack_microbatch(microbatch: Microbatch, data: Mapping[str, JobData]) -> PackedBatch:
    """Lay out a plan microbatch's samples as one sequence (host tensors).

    Args:
        microbatch: A non-no-op microbatch of the plan.
        data: Every job's training data, by adapter name.
    """
    import torch

    ids: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    lengths: list[int] = []
    spans: list[SegmentSpan] = []
    offset = 0
    for segment in microbatch.segments:
        job = data[segment.adapter]
        start = offset
        trained = 0
        for position in segment.samples:
            sample = job.sample(position)
            ids.append(sample.input_ids)
            targets.append(sample.targets)
            lengths.append(len(sample))
            offset += len(sample)
            trained += sample.num_targets
        spans.append(
            SegmentSpan(
                adapter=segment.adapter,
                global_batch=segment.global_batch,
                start=start,
                length=offset - start,
                num_samples=len(segment.samples),
                targets=trained,
            )
        )
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate(ids)).unsqueeze(0),
        position_ids=torch.from_numpy(positions).unsqueeze(0),
        targets=torch.from_numpy(np.concatenate(targets)),
        sample_lengths=tuple(lengths),
        segments=tuple(spans),
    )


def block_causal_mask(sample_lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Boolean ``[T, T]``: ``True`` where query ``i`` may attend to key ``j`` (same sample, ``j <= i``)."""
    import torch

    counts = torch.tensor(sample_lengths, device=device)
    sample_of = torch.repeat_interleave(torch.arange(len(sample_lengths), device=device), counts)
    same = sample_of[:, None] == sample_of[None, :]
    total = int(counts.sum())
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril_()
    return same & causal


def attention_inputs(batch: PackedBatch, attn_implementation: str, dtype: torch.dtype) -> dict[str, Any]:
    """Model keyword arguments that keep attention inside each sample.

    Args:
        batch: The packed batch (on its device).
        attn_implementation: The model's attention kernel.
        dtype: The model's activation dtype (eager attention adds a float mask).

    Returns:
        ``position_ids``; the samples' cumulative lengths for ``lorafusion_varlen``; a 4-D
        ``attention_mask`` for sdpa and eager; nothing more for flash-attention.
    """
    import torch

    from lorafusion_megatron.attention import VARLEN

    inputs: dict[str, Any] = {"position_ids": batch.position_ids}
    if attn_implementation == "flash_attention_2":
        return inputs
    if attn_implementation == VARLEN:
        bounds = torch.tensor([0, *itertools.accumulate(batch.sample_lengths)], dtype=torch.int32)
        cu = to_device(bounds, batch.input_ids.device)
        longest = max(batch.sample_lengths)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return inputs
    allowed = block_causal_mask(batch.sample_lengths, batch.input_ids.device)[None, None]
    if attn_implementation == "sdpa":
        inputs["attention_mask"] = allowed
    else:
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        inputs["attention_mask"] = additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    return inputs
