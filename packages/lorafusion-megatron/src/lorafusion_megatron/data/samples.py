"""Tokenised training samples: token ids and next-token targets, prompt tokens masked.

A sample of ``n`` tokens carries ``n`` targets: ``targets[t]`` is the token the model must predict
at position ``t`` (``input_ids[t + 1]``) or ``-100`` where the loss ignores it (prompt tokens and
the last position). Targets are shifted here, per sample, so that packing several samples into one
sequence never asks a sample's last token to predict the next sample's first token.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "FitReport",
    "Sample",
    "fit_to_capacity",
    "record_layout",
    "synthetic_samples",
    "tokenize_records",
]

IGNORE_INDEX = -100
"""Target value the loss skips (PyTorch's ``cross_entropy`` default ``ignore_index``)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Sample:
    """One training sequence.

    Attributes:
        input_ids: int64 ``[n]`` token ids.
        targets: int64 ``[n]`` next-token targets, ``IGNORE_INDEX`` where not trained.
    """

    input_ids: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_targets(self) -> int:
        """Tokens the loss counts."""
        return int(np.count_nonzero(self.targets != IGNORE_INDEX))

    @classmethod
    def from_trained_mask(cls, input_ids: Sequence[int], trained: Sequence[bool]) -> Sample:
        """A sample whose loss counts the tokens marked ``trained``.

        ``targets[t] = input_ids[t + 1]`` where ``trained[t + 1]``, else ``IGNORE_INDEX``: the model
        learns to produce every trained token from the tokens before it.

        Args:
            input_ids: Token ids ``[n]``.
            trained: ``[n]``: whether the model learns to produce each token.
        """
        ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.asarray(trained, dtype=bool)
        if mask.shape != ids.shape:
            raise ValueError(f"trained has shape {mask.shape}, input_ids {ids.shape}: give one flag per token")
        targets = np.full(ids.shape[0], IGNORE_INDEX, dtype=np.int64)
        targets[:-1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        return cls(input_ids=ids, targets=targets)

    @classmethod
    def from_tokens(cls, prompt: Sequence[int], response: Sequence[int]) -> Sample:
        """A sample trained on ``response`` only (every response token is a target).

        Args:
            prompt: Token ids the loss ignores (may be empty).
            response: Token ids the model learns to produce.
        """
        return cls.from_trained_mask([*prompt, *response], [False] * len(prompt) + [True] * len(response))

    def truncated(self, length: int) -> Sample:
        """The first ``length`` tokens (their targets unchanged)."""
        return Sample(input_ids=self.input_ids[:length], targets=self.targets[:length])


def tokenize_records(
    records: Sequence[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_field: str,
    response_field: str,
    text_field: str,
    messages_field: str,
    source: str,
) -> list[Sample]:
    """Tokenise chats (assistant turns trained), prompt/response pairs (response trained) or texts (all trained).

    The first record decides the layout, in this order: a ``messages_field`` chat, a
    ``prompt_field`` + ``response_field`` pair, a ``text_field``. Chats are rendered by the
    tokenizer's chat template (see :mod:`lorafusion_megatron.data.chat`). For pairs and texts the
    tokenizer's special tokens (e.g. BOS) start every sample and its EOS, when it has one, ends it
    and is trained on, so the model learns to stop.

    Args:
        records: Rows of the dataset.
        tokenizer: The base model's tokenizer.
        prompt_field: Name of the prompt column.
        response_field: Name of the response column.
        text_field: Name of the whole-text column.
        messages_field: Name of the chat column.
        source: Dataset name for error messages.

    Returns:
        One sample per record, in order.

    Raises:
        TrainerError: Records have none of the layouts, a field is not text, or a chat cannot be rendered.
    """
    if not records:
        raise TrainerError(f"dataset {source} has no records")
    layout = record_layout(
        records[0],
        prompt_field=prompt_field,
        response_field=response_field,
        text_field=text_field,
        messages_field=messages_field,
        source=source,
    )
    if layout == "chat":
        from lorafusion_megatron.data.chat import tokenize_chats

        return tokenize_chats([record.get(messages_field) for record in records], tokenizer, source=source)
    paired = layout == "pair"
    fields = (prompt_field, response_field) if paired else (text_field,)
    columns = []
    for field in fields:
        column = []
        for i, record in enumerate(records, start=1):
            value = record.get(field)
            if not isinstance(value, str):
                found = f"`{field}` is {value!r}" if field in record else f"has no `{field}` (it has {sorted(record)})"
                raise TrainerError(f"dataset {source} record {i} of {len(records)}: {found}, expected text")
            column.append(value)
        columns.append(column)
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if paired:
        prompts = tokenizer(columns[0], add_special_tokens=True)["input_ids"]
        responses = tokenizer(columns[1], add_special_tokens=False)["input_ids"]
        return [Sample.from_tokens(p, [*r, *eos]) for p, r in zip(prompts, responses, strict=True)]
    texts = tokenizer(columns[0], add_special_tokens=True)["input_ids"]
    # Every token after the first is trained: the first has nothing before it to predict it from.
    return [Sample.from_tokens(t[:1], [*t[1:], *eos]) for t in texts]


def record_layout(
    first: Mapping[str, Any],
    *,
    prompt_field: str,
    response_field: str,
    text_field: str,
    messages_field: str,
    source: str,
) -> Literal["chat", "pair", "text"]:
    """The layout a dataset's first record decides: a chat, a prompt/response pair, or a text.

    Raises:
        TrainerError: The record has none of the fields, naming the ones it has.
    """
    if messages_field in first:
        return "chat"
    if prompt_field in first and response_field in first:
        return "pair"
    if text_field in first:
        return "text"
    raise TrainerError(
        f"dataset {source}: records need `{messages_field}`, `{prompt_field}` and `{response_field}`, or "
        f"`{text_field}`; the first has {sorted(first)} (set dataset.messages_field/prompt_field/response_field/"
        "text_field)"
    )


def synthetic_samples(lengths: Sequence[int], *, vocab_size: int, seed: int, length_scale: float = 1.0) -> list[Sample]:
    """Random-token samples of given lengths, trained on every token (for throughput runs).

    Args:
        lengths: Token lengths before scaling.
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        seed: Seed of the token generator.
        length_scale: Multiplies every length (at least 2 tokens, so one target remains).
    """
    rng = np.random.default_rng(seed)
    samples = []
    for length in lengths:
        n = max(2, round(length * length_scale))
        ids = rng.integers(0, vocab_size, size=n, dtype=np.int64)
        samples.append(Sample.from_tokens(ids[:1].tolist(), ids[1:].tolist()))
    return samples


@dataclass(frozen=True)
class FitReport:
    """What :func:`fit_to_capacity` changed."""

    truncated: int
    dropped_long: int
    dropped_empty: int


def fit_to_capacity(
    samples: Sequence[Sample], capacity: int, mode: Literal["truncate", "drop"], *, source: str
) -> tuple[list[Sample], FitReport]:
    """Cut or drop samples longer than the microbatch capacity, then drop samples with no target.

    Args:
        samples: The job's samples.
        capacity: Tokens per microbatch.
        mode: ``truncate`` keeps the first ``capacity`` tokens; ``drop`` leaves the sample out.
        source: Dataset name for messages.

    Returns:
        The usable samples (order kept) and counts of what changed; a warning is logged when any.

    Raises:
        TrainerError: No usable sample is left.
    """
    kept: list[Sample] = []
    truncated = dropped_long = dropped_empty = 0
    for sample in samples:
        if len(sample) > capacity:
            if mode == "drop":
                dropped_long += 1
                continue
            sample = sample.truncated(capacity)
            truncated += 1
        if sample.num_targets == 0:
            dropped_empty += 1
            continue
        kept.append(sample)
    report = FitReport(truncated=truncated, dropped_long=dropped_long, dropped_empty=dropped_empty)
    if truncated or dropped_long:
        _log.warning(
            "dataset %s: %d sample(s) longer than the capacity of %d tokens were %s (scheduler.long_samples)",
            source,
            truncated + dropped_long,
            capacity,
            "truncated" if truncated else "dropped",
        )
    if dropped_empty:
        _log.warning("dataset %s: %d sample(s) have no trained token and were dropped", source, dropped_empty)
    if not kept:
        # Truncation keeps a long sample's first `capacity` tokens: it helps only where they hold a target.
        fix = "raise scheduler.capacity" + (", or set scheduler.long_samples: truncate" if mode == "drop" else "")
        raise TrainerError(
            f"dataset {source} has no usable samples: {len(samples)} read, {dropped_long} longer than the capacity "
            f"({capacity}) dropped, {truncated} truncated, {dropped_empty} without a trained token (empty response, "
            f"or all cut off); check the fields, or {fix}"
        )
    return kept, report
