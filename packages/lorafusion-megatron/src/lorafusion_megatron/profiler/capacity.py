"""Choose the token capacity: the largest that fits memory with the best simulated throughput (torch-free).

For every candidate capacity the jobs are planned as ``train`` will plan them, with the measured
cost model (:func:`~lorafusion_megatron.profiler.fit.measured_cost_model`), so that global batches
a job runs alone are split where that is faster (greedy packing, which lands within about 1.5% of
the MILP), and the plan's pipeline simulated with that model. A capacity whose lone global batches
drain the pipeline is judged by its split plan, as it will run: on LLaMa-3.1-70B over 4 stages
(H200) a lone job's plans at 4,096 and 8,192 tokens split into the same microbatches. A capacity
that does not fit is planned without splits, which cost planning time (a lone job of 25,600
samples on 16 stages x 8 replicas, planned and simulated: about 9 s per capacity with them, 4 s
without).

Memory: one microbatch of ``n`` tokens peaks at ``static + activations * n`` on a stage (fitted to
the measurements), and stage ``s`` of a 1F1B pipeline holds the activations of up to ``S - s``
microbatches at once. With ``activation_checkpointing: auto`` (:mod:`.recompute`) each candidate
also gets the fewest recomputed layers per stage that fit, and is simulated with what recomputing
only those costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorafusion_megatron.profiler.fit import fit_line
from lorafusion_megatron.profiler.recompute import RecomputeModel, adjusted_cost, fewest_recomputed

if TYPE_CHECKING:
    from lorafusion_megatron.profiler.measure import Measurement
    from lorafusion_sched.models import AdapterJob, CostModel

__all__ = ["CapacityOption", "choose_capacity", "predicted_peak_bytes", "stage_peak_bytes"]


@dataclass(frozen=True)
class CapacityOption:
    """One candidate capacity.

    Attributes:
        capacity: Tokens per microbatch.
        peak_bytes: Predicted peak memory of the fullest stage (``None`` when not measured).
        fits: Whether it fits the memory limit.
        microbatches: Microbatches of the plan (no-ops included).
        bubble_ratio: Simulated bubble ratio.
        tokens_per_s: Simulated throughput.
        recomputed_layers: Layers each stage recomputes (``activation_checkpointing: auto``), else ``None``.
    """

    capacity: int
    peak_bytes: float | None
    fits: bool
    microbatches: int
    bubble_ratio: float
    tokens_per_s: float
    recomputed_layers: tuple[int, ...] | None = None


def stage_peak_bytes(measurements: Sequence[Measurement], stages: int, capacity: int) -> list[float] | None:
    """Peak memory of each stage at ``capacity`` tokens (``S - s`` microbatches held), ``None`` without measurements."""
    peaks = []
    for s in sorted({m.stage for m in measurements}):
        points = [(float(m.tokens), float(m.peak_bytes)) for m in measurements if m.stage == s and m.peak_bytes]
        if not points:
            return None
        static, per_token = fit_line([p[0] for p in points], [p[1] for p in points])
        peaks.append(static + (stages - s) * per_token * capacity)
    return peaks


def predicted_peak_bytes(measurements: Sequence[Measurement], stages: int, capacity: int) -> float | None:
    """Peak memory of the fullest stage at ``capacity`` tokens, or ``None`` without memory measurements."""
    peaks = stage_peak_bytes(measurements, stages, capacity)
    return None if peaks is None else max(peaks)


def _recomputation(
    models: Sequence[RecomputeModel],
    measurements: Sequence[Measurement],
    *,
    stages: int,
    capacity: int,
    limit: float | None,
) -> tuple[tuple[int, ...] | None, float | None]:
    """The fewest recomputed layers per stage at ``capacity`` (``None`` if none fits) and the fullest stage's peak."""
    peaks = stage_peak_bytes(measurements, stages, capacity)
    if peaks is None:  # no memory measured (the CPU): nothing to save
        return tuple(0 for _ in models), None
    counts = []
    predicted = []
    for model, peak in zip(models, peaks, strict=True):
        in_flight = stages - model.stage
        count = fewest_recomputed(model, peak_all=peak, in_flight=in_flight, tokens=capacity, limit=limit)
        if count is None:
            return None, max(peaks)
        counts.append(count)
        kept = model.layers - count
        predicted.append(peak + in_flight * capacity * kept * model.bytes_per_token if kept else peak)
    return tuple(counts), max(predicted)


def choose_capacity(
    jobs: Sequence[AdapterJob],
    cost: CostModel,
    measurements: Sequence[Measurement],
    *,
    candidates: Sequence[int],
    stages: int,
    data_parallel: int,
    padding_multiple: int,
    memory_limit_bytes: float | None,
    out_of_memory_at: int | None = None,
    recompute: Sequence[RecomputeModel] | None = None,
) -> tuple[int, list[CapacityOption]]:
    """The best candidate capacity and every candidate's numbers.

    Args:
        jobs: The jobs' sample lengths and global batch sizes.
        cost: The measured cost model: the plans' splits and their simulation.
        measurements: The profiler's measurements (for memory).
        candidates: Capacities to try (multiples of ``padding_multiple``).
        stages: Pipeline stages.
        data_parallel: Replicas.
        padding_multiple: The scheduler's padding multiple.
        memory_limit_bytes: Usable memory per device; ``None``: no limit.
        out_of_memory_at: A token count that ran out of memory when measured: it and every larger
            candidate do not fit, whatever the fitted line predicts.
        recompute: One model per stage for ``activation_checkpointing: auto`` (``cost`` and
            ``measurements`` then are those with every layer recomputed); ``None``: as measured.

    Returns:
        ``(chosen capacity, options in candidate order)``; the chosen one fits memory and has the
        highest simulated tokens/s (the larger on a tie); with none fitting, the smallest candidate.
    """
    import lorafusion_sched
    from lorafusion_sched.models import PlanOptions

    options = []
    for capacity in sorted(candidates):
        counts = None
        simulated_cost = cost
        if recompute is None:
            peak = predicted_peak_bytes(measurements, stages, capacity)
            fits = memory_limit_bytes is None or peak is None or peak <= memory_limit_bytes
        else:
            counts, peak = _recomputation(
                recompute, measurements, stages=stages, capacity=capacity, limit=memory_limit_bytes
            )
            fits = counts is not None
            if counts is not None:
                simulated_cost = adjusted_cost(cost, recompute, counts, capacity)
        if out_of_memory_at is not None and capacity >= out_of_memory_at:
            fits = False
        plan = lorafusion_sched.plan(
            list(jobs),
            PlanOptions(
                capacity=capacity,
                pipeline_stages=stages,
                data_parallel=data_parallel,
                padding_multiple=padding_multiple,
                truncate=True,
                use_milp=False,
                cost_model=simulated_cost if fits else None,  # the splits cost planning time; it is not chosen
            ),
        )
        run = lorafusion_sched.simulate(plan, simulated_cost, baselines=False).runs[0]
        options.append(
            CapacityOption(
                capacity=capacity,
                peak_bytes=peak,
                fits=fits,
                microbatches=len(plan.microbatches),
                bubble_ratio=run.bubble_ratio,
                tokens_per_s=run.tokens_per_s,
                recomputed_layers=counts,
            )
        )
    fitting = [o for o in options if o.fits]
    if not fitting:
        return options[0].capacity, options
    best = max(fitting, key=lambda o: (o.tokens_per_s, o.capacity))
    return best.capacity, options
