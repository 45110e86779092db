"""Split a decoder's layers into ``S`` contiguous pipeline stages of balanced cost (torch-free).

The cost of a stage is the forward FLOPs per token of what it holds: its decoder layers, plus the
LM head and loss on the last stage (``2 * hidden * vocab``, as large as several layers for small
models with big vocabularies); the embedding lookup costs no FLOPs. The partition minimises the
most expensive stage (the pipeline's throughput is set by its slowest stage), every stage holding
at least one layer; the number of layers need not divide by ``S``.

With activation checkpointing a stage also recomputes the forward of some of its layers in the
backward. Its time per token is then ``(1 + beta) C_s + R_s``: forward ``C_s``, a backward of
``beta`` times that (the frozen weights need no weight gradient), and ``R_s``, the forward cost of
the layers it recomputes. Whole layers leave stages unequal (LLaMa-3.1-70B over 4: 20, 20, 21 and
19 layers plus the head); ``balanced`` checkpointing evens them out by not recomputing a few layers
on the costlier stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lorafusion_megatron.errors import TrainerError

__all__ = [
    "CheckpointSetting",
    "StageSpec",
    "balanced_partition",
    "decoder_costs",
    "partition_model",
    "recomputed_layers",
    "stage_cost_factors",
]

CheckpointSetting = bool | Literal["balanced", "auto"] | list[int]
"""``runtime.activation_checkpointing``: none, every layer, ``balanced``, ``auto``, or a count per stage."""

BACKWARD_OVER_FORWARD = 1.36
"""``beta``: backward over forward time of a stage that recomputes nothing. Measured with the
profiler on LLaMa-3.1-8B, 8,192 tokens, fused LoRA kernels, H100 (2026-11-25: 401 against 295 ms);
there, each recomputed layer added 0.93 of a layer's forward, which the model rounds to 1."""


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage holds.

    Attributes:
        stage: Stage index ``s`` in ``[0, S)``.
        num_stages: ``S``.
        start: First decoder layer (global index).
        stop: One past the last decoder layer.
        cost: Estimated forward FLOPs per token of the stage.
    """

    stage: int
    num_stages: int
    start: int
    stop: int
    cost: float

    @property
    def is_first(self) -> bool:
        """Holds the embedding."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm, the LM head and the loss."""
        return self.stage == self.num_stages - 1

    @property
    def layers(self) -> range:
        """Global indices of the stage's decoder layers."""
        return range(self.start, self.stop)


def decoder_costs(config: Mapping[str, Any]) -> tuple[list[float], float]:
    """Forward FLOPs per token of each decoder layer and of the LM head, from a transformers config.

    Args:
        config: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads`` (default: heads), ``head_dim`` (default: hidden / heads) and
            ``vocab_size``.

    Returns:
        ``(per-layer costs, head cost)``.
    """
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * int(config["intermediate_size"])
    layer = 2.0 * (attention + mlp)
    head = 2.0 * hidden * int(config["vocab_size"])
    return [layer] * int(config["num_hidden_layers"]), head


def balanced_partition(layer_costs: Sequence[float], stages: int, *, last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges, one per stage, minimising the largest stage cost.

    Exact dynamic programme over split points (``O(S L^2)``, instant for any real model); among
    optimal partitions the earliest split points are taken, so ties put spare layers late.

    Args:
        layer_costs: Cost of each layer, in order.
        stages: ``S``; at most the number of layers.
        last_extra: Cost added to the last stage (LM head and loss).

    Raises:
        TrainerError: More stages than layers.
    """
    n = len(layer_costs)
    if not 1 <= stages <= n:
        raise TrainerError(
            f"parallel.pipeline_stages (or --pipeline-stages) = {stages} must be between 1 and the model's {n} "
            "decoder layers"
        )
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest max cost of splitting layers [0, i) into k stages (the last k-th not final).
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        extra = last_extra if k == stages else 0.0
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[k][i] - 1e-9 * abs(value):
                    best[k][i], cut[k][i] = value, j
    ranges = []
    stop = n
    for k in range(stages, 0, -1):
        start = cut[k][stop]
        ranges.append((start, stop))
        stop = start
    return ranges[::-1]


def partition_model(config: Mapping[str, Any], stages: int) -> list[StageSpec]:
    """The balanced stages of a decoder described by a transformers config dict.

    Args:
        config: The model config as a dict (``PretrainedConfig.to_dict()`` or a preset's keywords).
        stages: ``S``.

    Returns:
        One :class:`StageSpec` per stage.
    """
    layer_costs, head = decoder_costs(config)
    ranges = balanced_partition(layer_costs, stages, last_extra=head)
    specs = []
    for s, (start, stop) in enumerate(ranges):
        cost = sum(layer_costs[start:stop]) + (head if s == stages - 1 else 0.0)
        specs.append(StageSpec(stage=s, num_stages=stages, start=start, stop=stop, cost=cost))
    return specs


def recomputed_layers(config: Mapping[str, Any], stages: int, setting: CheckpointSetting) -> tuple[int, ...]:
    """How many decoder layers each stage recomputes in its backward (the first ones it holds).

    Args:
        config: The model config as a dict (see :func:`partition_model`).
        stages: ``S``.
        setting: ``False``: none; ``True``: every layer; a list: that many on each stage (one count
            per stage); ``"balanced"``: every layer, except that each stage costlier than the cheapest
            one (all layers recomputed) skips the recomputation of as few layers as bring it down to
            that cost (all of them where even that does not). One stage: the same as ``True``.
            ``"auto"`` (not yet resolved by a profile): every layer, as ``True``.

    Raises:
        TrainerError: A list whose length is not ``S``, or a count above the stage's layers.
    """
    specs = partition_model(config, stages)
    if setting is False:
        return (0,) * stages
    if setting is True or setting == "auto":
        return tuple(len(spec.layers) for spec in specs)
    if setting == "balanced":
        return _balanced_recomputation(decoder_costs(config)[0], specs)
    assert isinstance(setting, list)
    if len(setting) != stages:
        raise TrainerError(
            f"runtime.activation_checkpointing = {setting} gives {len(setting)} counts for {stages} pipeline "
            f"stage(s) (parallel.pipeline_stages or --pipeline-stages): give one count of recomputed layers "
            f"per stage, or true, false or balanced"
        )
    for spec, count in zip(specs, setting, strict=True):
        if not 0 <= count <= len(spec.layers):
            raise TrainerError(
                f"runtime.activation_checkpointing = {setting}: stage {spec.stage} holds {len(spec.layers)} "
                f"decoder layer(s) (layers {spec.start} to {spec.stop - 1}), so it can recompute 0 to "
                f"{len(spec.layers)} of them, not {count}"
            )
    return tuple(setting)


def _stage_time(spec: StageSpec, layer_costs: Sequence[float], recomputed: int) -> float:
    """Forward + backward cost per token of a stage that recomputes its first ``recomputed`` layers."""
    return (1.0 + BACKWARD_OVER_FORWARD) * spec.cost + sum(layer_costs[spec.start : spec.start + recomputed])


def _balanced_recomputation(layer_costs: Sequence[float], specs: Sequence[StageSpec]) -> tuple[int, ...]:
    """Recompute every layer but as few as bring each stage down to the cheapest stage's full-recompute time."""
    target = min(_stage_time(spec, layer_costs, len(spec.layers)) for spec in specs)
    counts = []
    for spec in specs:
        count = len(spec.layers)
        while count > 0 and _stage_time(spec, layer_costs, count) > target * (1 + 1e-9):
            count -= 1
        counts.append(count)
    return tuple(counts)


def stage_cost_factors(
    config: Mapping[str, Any], stages: int, recomputed: Sequence[int] | None = None
) -> tuple[float, ...] | None:
    """Each stage's estimated forward + backward time over the mean: what whole-layer partitions leave unbalanced.

    For the scheduler's cost model (``CostModel.stage_factors``), so its simulator runs the stages
    the runtime builds rather than equal ones. LLaMa-3.1-70B over 4 stages: layers 20, 20, 21 and
    19 plus the head, factors ``(0.985, 0.985, 1.034, 0.996)`` without recomputation, ``(0.989,
    0.989, 1.039, 0.983)`` recomputing every layer, within 0.5% of 1 with ``balanced``.

    Args:
        config: The model config as a dict (see :func:`partition_model`).
        stages: ``S``.
        recomputed: Layers each stage recomputes (:func:`recomputed_layers`); ``None``: none.

    Returns:
        One factor per stage, or ``None`` for one stage.
    """
    if stages == 1:
        return None
    layer_costs = decoder_costs(config)[0]
    specs = partition_model(config, stages)
    counts = recomputed if recomputed is not None else (0,) * stages
    times = [_stage_time(spec, layer_costs, count) for spec, count in zip(specs, counts, strict=True)]
    mean = sum(times) / stages
    return tuple(time / mean for time in times)
