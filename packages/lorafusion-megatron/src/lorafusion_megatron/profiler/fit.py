"""Fit the scheduler's cost model to the profiler's measurements (torch-free).

``lorafusion_sched.CostModel`` says a microbatch of ``n`` padded tokens takes
``factor_s * (fixed + per_token * n)`` seconds forward on stage ``s`` and ``backward_factor`` times
that backward. The fit: each stage's factor is its mean forward time over the mean of all stages;
``fixed`` and ``per_token`` are the least-squares line through the factor-normalised forward times;
``backward_factor`` is the median ratio of backward to forward time. All three use the larger half
of the token counts measured (at least two): small microbatches are bound by the host's kernel
launches (LLaMa-3.1-8B on an H100: 275 ms forward at 1,024 tokens, 295 ms at 8,192), which a line
through every count turns into a large fixed cost that makes every larger capacity look better.
That line chooses the capacity; the planner's splits, a choice between smaller and larger
microbatches, get the measured times themselves (:func:`measured_cost_model`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafusion_megatron.profiler.measure import Measurement
    from lorafusion_sched.models import CostModel

__all__ = ["fit_cost_model", "fit_line", "measured_cost_model"]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x``, clamped to non-negative values."""
    if len(set(xs)) < 2:
        return max(0.0, statistics.fmean(ys)), 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


def fit_cost_model(measurements: Sequence[Measurement]) -> CostModel:
    """The cost model that best matches ``measurements`` (one or more stages, several token counts each)."""
    from lorafusion_sched.models import CostModel

    counts = sorted({m.tokens for m in measurements})
    larger = set(counts[len(counts) // 2 :] if len(counts) > 3 else counts[-2:])
    measurements = [m for m in measurements if m.tokens in larger]
    factors = _stage_factors(measurements)
    xs = [float(m.tokens) for m in measurements]
    ys = [m.forward_s / factors[m.stage] for m in measurements]
    fixed, per_token = fit_line(xs, ys)
    return CostModel(
        forward_fixed_s=fixed,
        forward_per_token_s=per_token,
        backward_factor=_backward_factor(measurements),
        stage_factors=tuple(factors.values()) if len(factors) > 1 else None,
    )


def measured_cost_model(measurements: Sequence[Measurement]) -> CostModel:
    """A cost model through the measured times themselves (``CostModel.forward_points``), for the planner's splits.

    A line cannot follow a stage that the host bounds below some size and the GPU above it
    (Qwen2.5-32B, stage 0 of 2 on an H200, every layer recomputed: 193, 258, 276 and 514 ms forward at
    1,024, 2,048, 4,096 and 8,192 tokens), and a split is a choice between such sizes. Each point
    is a token count's mean forward over the stages, each stage's time divided by its factor; the
    stage factors and the backward factor are :func:`fit_cost_model`'s, over the counts every stage
    measured (a stage that ran out of memory at some count measured none above it). The line
    fields hold the least-squares line through the points, for display only.
    """
    from lorafusion_sched.models import CostModel

    stages_at: dict[int, set[int]] = {}
    for m in measurements:
        stages_at.setdefault(m.tokens, set()).add(m.stage)
    every_stage = {m.stage for m in measurements}
    shared = sorted(n for n, stages in stages_at.items() if stages == every_stage)
    measurements = [m for m in measurements if m.tokens in shared]
    factors = _stage_factors(measurements)
    points = [
        (n, statistics.fmean(m.forward_s / factors[m.stage] for m in measurements if m.tokens == n)) for n in shared
    ]
    fixed, per_token = fit_line([float(n) for n, _ in points], [seconds for _, seconds in points])
    return CostModel(
        forward_fixed_s=fixed,
        forward_per_token_s=per_token,
        backward_factor=_backward_factor(measurements),
        stage_factors=tuple(factors.values()) if len(factors) > 1 else None,
        forward_points=tuple(points),
    )


def _stage_factors(measurements: Sequence[Measurement]) -> dict[int, float]:
    """Each stage's mean forward over the mean of all stages' (by stage, in order)."""
    stages = sorted({m.stage for m in measurements})
    means = {s: statistics.fmean(m.forward_s for m in measurements if m.stage == s) for s in stages}
    overall = statistics.fmean(means.values())
    return {s: max(means[s] / overall, 1e-6) if overall > 0 else 1.0 for s in stages}


def _backward_factor(measurements: Sequence[Measurement]) -> float:
    """The median ratio of backward to forward seconds (2 without a forward that took time)."""
    ratios = [m.backward_s / m.forward_s for m in measurements if m.forward_s > 0]
    return statistics.median(ratios) if ratios else 2.0
