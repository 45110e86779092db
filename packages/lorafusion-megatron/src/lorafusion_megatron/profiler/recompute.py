"""``activation_checkpointing: auto``: recompute as few layers per stage as fit memory (torch-free).

The profiler measures each stage twice at one token count ``n``: with every layer recomputed and
with none. A layer that keeps its activations then costs ``a = (peak_none - peak_all) / (n L)``
bytes per token, and saves ``c = (backward_all - backward_none) / (n L)`` backward seconds per token,
``L`` being the stage's layers. At capacity ``n``, stage ``s`` of ``S`` holds up to ``k = S - s``
microbatches, so recomputing ``R`` of its layers peaks at
``peak_all(n) + k n (L - R) a``: the fewest ``R`` under the memory limit is the stage's count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafusion_megatron.profiler.measure import Measurement
    from lorafusion_sched.models import CostModel

__all__ = ["RecomputeModel", "adjusted_cost", "fewest_recomputed", "fit_recompute"]


@dataclass(frozen=True)
class RecomputeModel:
    """What keeping one layer's activations costs and saves on one stage.

    Attributes:
        stage: Pipeline stage.
        layers: Decoder layers of the stage (``L``).
        bytes_per_token: Peak memory per token of each layer that keeps its activations (``a``).
        seconds_per_token: Backward seconds per token saved by each layer not recomputed (``c``).
    """

    stage: int
    layers: int
    bytes_per_token: float
    seconds_per_token: float


def fit_recompute(with_all: Measurement, with_none: Measurement, layers: int) -> RecomputeModel:
    """The model of one stage from its two measurements at the same token count.

    Without peak memory (the CPU, where no memory limit applies) a kept layer counts 0 bytes.

    Raises:
        ValueError: The measurements are of different stages or token counts.
    """
    if (with_all.stage, with_all.tokens) != (with_none.stage, with_none.tokens):
        raise ValueError(f"measurements of different runs: {with_all} and {with_none}")
    per_layer_token = with_all.tokens * layers
    held = 0.0
    if with_all.peak_bytes is not None and with_none.peak_bytes is not None:
        held = max(0.0, (with_none.peak_bytes - with_all.peak_bytes) / per_layer_token)
    return RecomputeModel(
        stage=with_all.stage,
        layers=layers,
        bytes_per_token=held,
        seconds_per_token=max(0.0, (with_all.backward_s - with_none.backward_s) / per_layer_token),
    )


def fewest_recomputed(
    model: RecomputeModel, *, peak_all: float, in_flight: int, tokens: int, limit: float | None
) -> int | None:
    """The fewest layers the stage must recompute for its peak to stay under ``limit``.

    Args:
        model: The stage's model.
        peak_all: Predicted peak of the stage with every layer recomputed and ``in_flight``
            microbatches held.
        in_flight: Microbatches the stage holds at once (``S - s``).
        tokens: Tokens per microbatch.
        limit: Usable bytes; ``None``: no limit (nothing recomputed).

    Returns:
        A count in ``[0, L]``, or ``None`` when even recomputing every layer does not fit.
    """
    if limit is None:
        return 0
    if peak_all > limit:
        return None
    per_layer = in_flight * tokens * model.bytes_per_token
    if per_layer <= 0:
        return 0
    kept = math.floor((limit - peak_all) / per_layer)
    return max(0, model.layers - kept)


def adjusted_cost(
    cost: CostModel, models: Sequence[RecomputeModel], recomputed: Sequence[int], tokens: int
) -> CostModel:
    """``cost`` (fitted with every layer recomputed) for stages that recompute only ``recomputed`` layers.

    Each stage's backward at ``tokens`` tokens shrinks by ``(L - R) c tokens``; the result keeps
    the scheduler's form (one backward factor, one factor per stage) with each stage's forward +
    backward time at ``tokens`` exact.
    """
    stages = len(models)
    forward = [cost.forward_seconds(tokens, s) for s in range(stages)]
    backward = [
        cost.backward_factor * f - (m.layers - r) * m.seconds_per_token * tokens
        for f, m, r in zip(forward, models, recomputed, strict=True)
    ]
    mean_forward = sum(forward) / stages
    mean_backward = max(sum(backward) / stages, 1e-3 * mean_forward)
    totals = [f + b for f, b in zip(forward, backward, strict=True)]
    mean_total = sum(totals) / stages
    return cost.model_copy(
        update={
            "backward_factor": mean_backward / mean_forward,
            "stage_factors": tuple(max(t / mean_total, 1e-6) for t in totals) if stages > 1 else None,
        }
    )
