"""The scheduler's cost model from the profiler's measurements (torch-free).

``lorafusion_sched.CostModel`` with ``forward_points`` says a microbatch of ``n`` padded tokens
takes ``factor_s * t(n)`` seconds forward on stage ``s`` and ``backward_factor`` times that
backward, where ``t`` interpolates the measured times between the token counts measured. Each
stage's factor is its mean forward time over the mean of all stages'; each point is a count's mean
over the stages of the forward time divided by the stage's factor; ``backward_factor`` is the
median ratio of backward to forward time.

Measured points, not a line: a stage that the host's kernel launches bound below some size and the
GPU above it is flat, then steep (LLaMa-3.1-70B, a stage of 20 layers on an H200, every layer
recomputed: 122, 135, 259 and 522 ms forward at 1,024, 2,048, 4,096 and 8,192 tokens, the stages'
means). A line through every count turns the flat part into a large fixed cost; a line through the
larger counts (this module's fit before) put 66 ms at 1,024 tokens there, and the profile chose
1,024 tokens, which the measured times simulate 1.5 times slower than 4,096 tokens with the
scheduler's splits.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafusion_megatron.profiler.measure import Measurement
    from lorafusion_sched.models import CostModel

__all__ = ["fit_line", "measured_cost_model"]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x``, clamped to non-negative values."""
    if len(set(xs)) < 2:
        return max(0.0, statistics.fmean(ys)), 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


def measured_cost_model(measurements: Sequence[Measurement]) -> CostModel:
    """The cost model through the measured times (one or more stages, one or more token counts each).

    Only the token counts that every stage measured are used (a stage that ran out of memory at some
    count measured none above it). A count measured faster than a smaller one takes the smaller
    one's time, so that no microbatch looks cheaper than a smaller one: LLaMa-3.1-8B over 2 stages
    on H200s measured 102 ms forward at 1,024 tokens and 88 ms at 2,048, and such noise (10-15%)
    would make splits look faster than they are by more than the scheduler's 3% margin. (Taking the
    larger count's time instead simulated that preset's real pipeline run 5% fast; this, 1% fast.)
    The line fields hold the least-squares line through the points, for display only.

    Raises:
        ValueError: no token count was measured on every stage.
    """
    from lorafusion_sched.models import CostModel

    stages_at: dict[int, set[int]] = {}
    for m in measurements:
        stages_at.setdefault(m.tokens, set()).add(m.stage)
    every_stage = {m.stage for m in measurements}
    shared = sorted(n for n, stages in stages_at.items() if stages == every_stage)
    if not shared:
        raise ValueError(f"no token count was measured on every stage ({len(measurements)} measurements)")
    measurements = [m for m in measurements if m.tokens in shared]
    means = {s: statistics.fmean(m.forward_s for m in measurements if m.stage == s) for s in sorted(every_stage)}
    overall = statistics.fmean(means.values())
    factors = {s: max(mean / overall, 1e-6) if overall > 0 else 1.0 for s, mean in means.items()}
    seconds = [statistics.fmean(m.forward_s / factors[m.stage] for m in measurements if m.tokens == n) for n in shared]
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    points = list(zip(shared, seconds, strict=True))
    fixed, per_token = fit_line([float(n) for n in shared], seconds)
    ratios = [m.backward_s / m.forward_s for m in measurements if m.forward_s > 0]
    return CostModel(
        forward_fixed_s=fixed,
        forward_per_token_s=per_token,
        backward_factor=statistics.median(ratios) if ratios else 2.0,
        stage_factors=tuple(factors.values()) if len(factors) > 1 else None,
        forward_points=tuple(points),
    )
