"""Fit the scheduler's cost model to the profiler's measurements (torch-free).

``lorafusion_sched.CostModel`` says a microbatch of ``n`` padded tokens takes
``factor_s * (fixed + per_token * n)`` seconds forward on stage ``s`` and ``backward_factor`` times
that backward. The fit: each stage's factor is its mean forward time over the mean of all stages;
``fixed`` and ``per_token`` are the least-squares line through the factor-normalised forward times;
``backward_factor`` is the median ratio of backward to forward time. All three use the larger half
of the token counts measured (at least two): small microbatches are bound by the host's kernel
launches (LLaMa-3.1-8B on an H100: 275 ms forward at 1,024 tokens, 295 ms at 8,192), which a line
through every count turns into a large fixed cost that makes every larger capacity look better.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafusion_megatron.profiler.measure import Measurement
    from lorafusion_sched.models import CostModel

__all__ = ["fit_cost_model", "fit_line"]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x``, clamped to non-negative values."""
    if len(set(xs)) < 2:
        return max(0.0, statistics.fmean(ys)), 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


def fit_cost_model(measurements: Sequence[Measurement], *, every_count: bool = False) -> CostModel:
    """The cost model that best matches ``measurements`` (one or more stages, several token counts each).

    ``every_count``: fit every token count, not the larger half: small microbatches bound by the
    host then raise the fixed cost, which is what a model deciding whether to run smaller
    microbatches must see.
    """
    from lorafusion_sched.models import CostModel

    if not every_count:
        counts = sorted({m.tokens for m in measurements})
        larger = set(counts[len(counts) // 2 :] if len(counts) > 3 else counts[-2:])
        measurements = [m for m in measurements if m.tokens in larger]
    stages = sorted({m.stage for m in measurements})
    means = {s: statistics.fmean(m.forward_s for m in measurements if m.stage == s) for s in stages}
    overall = statistics.fmean(means.values())
    factors = {s: means[s] / overall if overall > 0 else 1.0 for s in stages}
    xs = [float(m.tokens) for m in measurements]
    ys = [m.forward_s / factors[m.stage] for m in measurements]
    fixed, per_token = fit_line(xs, ys)
    ratios = [m.backward_s / m.forward_s for m in measurements if m.forward_s > 0]
    return CostModel(
        forward_fixed_s=fixed,
        forward_per_token_s=per_token,
        backward_factor=statistics.median(ratios) if ratios else 2.0,
        stage_factors=tuple(max(factors[s], 1e-6) for s in stages) if len(stages) > 1 else None,
    )
