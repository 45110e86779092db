"""Forward and backward of one packed microbatch through the multi-adapter model.

The loss of adapter ``a`` for its global batch ``g`` is the mean next-token cross-entropy over the
``N(a, g)`` trained tokens of that whole global batch. A microbatch holding part of ``g`` therefore
contributes ``sum of its token losses / N(a, g)``, and the gradients accumulated over all
microbatches of ``g`` equal those of one pass over ``g`` alone, however the scheduler packed it.
(Normalising by the microbatch's own token count, as a plain HF loss does, would weigh a token by
how its microbatch happened to be filled.)

Two ways to run a mixed microbatch, same result:

* fused: one pass over the whole sequence inside :func:`lorafusion_kernels.multi_lora_batch`, so
  every LoRA layer routes each segment's tokens to that segment's adapter;
* plain PEFT: one pass per segment with that adapter active (PEFT refuses mixed batches in training).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorafusion_megatron.dropout_seeds import drawing_segment
from lorafusion_megatron.model import set_active_adapters
from lorafusion_megatron.packing import PackedBatch, attention_inputs

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

__all__ = ["MicrobatchRunner", "PendingResults", "SegmentResult"]


@dataclass(frozen=True)
class SegmentResult:
    """What one segment of a microbatch contributed.

    Attributes:
        adapter: Job name.
        global_batch: The job's global batch.
        loss_sum: Sum of the segment's token losses (not normalised).
        targets: Trained tokens in the segment.
        tokens: All tokens in the segment.
    """

    adapter: str
    global_batch: int
    loss_sum: float
    targets: int
    tokens: int


class PendingResults:
    """A microbatch's segment results, whose loss sums stay on the device until :meth:`get` reads them.

    The read-back is the microbatch's one wait for the device. Reading a microbatch's results only
    after the next microbatch's work is queued lets the host run up to a microbatch ahead of the
    device instead of leaving it an empty queue at every microbatch boundary.

    Args:
        batch: The packed batch the results belong to.
        sums: Per segment, the sum of its token losses (0-d tensors, on the device).
    """

    def __init__(self, batch: PackedBatch, sums: Sequence[torch.Tensor]) -> None:
        import torch

        self._batch = batch
        self._sums: torch.Tensor | None = torch.stack([value.detach() for value in sums])
        self._results: list[SegmentResult] | None = None

    def get(self) -> list[SegmentResult]:
        """One result per segment, in sequence order (waits for the device the first time)."""
        if self._results is None:
            assert self._sums is not None
            values = self._sums.tolist()
            self._sums = None
            batch = self._batch
            counted = [
                span.targets
                if span.targets is not None
                else int((batch.targets[span.start : span.start + span.length] != -100).sum())
                for span in batch.segments
            ]
            self._results = [
                SegmentResult(
                    adapter=span.adapter,
                    global_batch=span.global_batch,
                    loss_sum=float(value),
                    targets=targets,
                    tokens=span.length,
                )
                for span, value, targets in zip(batch.segments, values, counted, strict=True)
            ]
        return self._results


class MicrobatchRunner:
    """Runs forward + backward of packed microbatches, accumulating each adapter's gradient.

    Args:
        model: The PEFT model holding one adapter per job (all trainable).
        adapters: Adapter names; the index of a name is its index in the fused kernels' tables.
        attn_implementation: The model's attention kernel.
        dtype: The model's activation dtype.
        fused: Route mixed microbatches through ``lorafusion_kernels`` in one pass.
    """

    def __init__(
        self,
        model: PeftModel,
        adapters: Sequence[str],
        *,
        attn_implementation: str,
        dtype: torch.dtype,
        fused: bool,
    ) -> None:
        self.model = model
        self.adapters = tuple(adapters)
        self.attn_implementation = attn_implementation
        self.dtype = dtype
        self.fused = fused
        self._active: tuple[str, ...] | None = None

    def forward_backward(self, batch: PackedBatch, denominators: Mapping[tuple[str, int], int]) -> PendingResults:
        """Accumulate the gradients of ``batch`` into the adapters' ``.grad``; nothing waits for the device.

        Dropout draws as :mod:`lorafusion_megatron.dropout_seeds` says: the caller names the microbatch
        with ``drawing_for``, and a plain-PEFT pass over one segment draws for that segment.

        Args:
            batch: The packed microbatch, on the model's device.
            denominators: Trained tokens of each ``(adapter, global batch)`` in the whole global batch.

        Returns:
            The segments' results, one per segment in sequence order, read back by ``get()``.
        """
        if self.fused:
            self._set_active(self.adapters)
            with self._routing(batch):
                return PendingResults(batch, self._pass(batch, denominators))
        sums = []
        for index, span in enumerate(batch.segments):
            self._set_active((span.adapter,))
            with drawing_segment(index):
                sums.extend(self._pass(batch.segment(index), denominators))
        return PendingResults(batch, sums)

    def activate(self, batch: PackedBatch) -> None:
        """Make PEFT's active adapters those of ``batch``'s first pass, as :meth:`forward_backward` would.

        Switching adapters walks every module of the model; a caller that times passes calls this first.
        """
        self._set_active(self.adapters if self.fused else (batch.segments[0].adapter,))

    def _set_active(self, names: tuple[str, ...]) -> None:
        if self._active != names:
            # PEFT marks inactive adapters frozen; their accumulated .grad is kept and still stepped.
            set_active_adapters(self.model, list(names))
            self._active = names

    @contextlib.contextmanager
    def _routing(self, batch: PackedBatch) -> Iterator[None]:
        import lorafusion_kernels

        # Backward stays inside the context: activation checkpointing re-runs the forward there.
        with lorafusion_kernels.multi_lora_batch(batch.multi_lora_routing(self.adapters), list(self.adapters)):
            yield

    def evaluate(self, batch: PackedBatch) -> list[SegmentResult]:
        """The loss sums of ``batch``'s segments with the model in eval mode (no dropout) and no gradients.

        Runs the segments exactly as :meth:`forward_backward` does (fused in one pass, or one pass per
        segment); the adapters' accumulated ``.grad`` and the random generators are left untouched.

        Args:
            batch: The packed batch, on the model's device.

        Returns:
            One result per segment, in sequence order.
        """
        import torch

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                if self.fused:
                    self._set_active(self.adapters)
                    with self._routing(batch):
                        return PendingResults(batch, self._segment_losses(batch)).get()
                results = []
                for index, span in enumerate(batch.segments):
                    self._set_active((span.adapter,))
                    segment = batch.segment(index)
                    results.extend(PendingResults(segment, self._segment_losses(segment)).get())
                return results
        finally:
            self.model.train(was_training)

    def _segment_losses(self, batch: PackedBatch) -> list[torch.Tensor]:
        """Per segment, the sum of its token losses (a 0-d tensor in the autograd graph, if any).

        Runs the decoder alone and applies the LM head in chunks (:mod:`lorafusion_megatron.token_loss`),
        so the ``[T, vocab]`` logits never exist at once.
        """
        from typing import Any

        from lorafusion_megatron.token_loss import causal_lm_token_losses

        causal_lm: Any = self.model.base_model.model  # the *ForCausalLM inside PEFT
        outputs = causal_lm.model(
            input_ids=batch.input_ids, **attention_inputs(batch, self.attn_implementation, self.dtype)
        )
        token_loss = causal_lm_token_losses(causal_lm, outputs.last_hidden_state, batch.targets)
        return [token_loss[span.start : span.start + span.length].sum() for span in batch.segments]

    def _pass(self, batch: PackedBatch, denominators: Mapping[tuple[str, int], int]) -> list[torch.Tensor]:
        """Forward and backward of ``batch``; per segment, the sum of its token losses (on the device)."""
        sums = self._segment_losses(batch)
        objective = sums[0].new_zeros(())
        for span, segment_sum in zip(batch.segments, sums, strict=True):
            objective = objective + segment_sum / denominators[(span.adapter, span.global_batch)]
        objective.backward()  # type: ignore[no-untyped-call]
        return sums
