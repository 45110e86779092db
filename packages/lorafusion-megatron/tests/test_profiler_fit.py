"""Fitting the scheduler's cost model and choosing the capacity (torch-free)."""

from __future__ import annotations

import pytest

import lorafusion_sched
from lorafusion_megatron.profiler.capacity import choose_capacity, predicted_peak_bytes
from lorafusion_megatron.profiler.fit import fit_line, measured_cost_model
from lorafusion_megatron.profiler.measure import Measurement
from lorafusion_sched import AdapterJob


def _measurements(peak_per_token: float | None = None) -> list[Measurement]:
    out = []
    for stage, factor in ((0, 0.8), (1, 1.2)):
        for tokens in (1024, 2048, 4096):
            forward = factor * (1e-3 + 2e-6 * tokens)
            peak = None if peak_per_token is None else int(1e9 + peak_per_token * tokens)
            out.append(Measurement(stage, tokens, forward, 2.5 * forward, peak))
    return out


def test_the_measured_model_recovers_the_times_of_a_line_and_the_stage_factors() -> None:
    cost = measured_cost_model(_measurements())
    assert cost.stage_factors == pytest.approx((0.8, 1.2))
    assert cost.forward_fixed_s == pytest.approx(1e-3)
    assert cost.forward_per_token_s == pytest.approx(2e-6)
    assert cost.backward_factor == pytest.approx(2.5)
    for tokens in (1024, 3072, 4096):
        assert cost.forward_seconds(tokens, 1) == pytest.approx(1.2 * (1e-3 + 2e-6 * tokens))


def test_a_count_measured_faster_than_a_smaller_one_takes_the_smaller_ones_time() -> None:
    """LLaMa-3.1-8B over 2 stages on H200s (the stages' means): 2,048 tokens ran faster than 1,024."""
    forward_ms = {1024: 102.0, 2048: 88.1, 4096: 104.2, 8192: 138.7}
    cost = measured_cost_model([Measurement(0, n, ms / 1e3, 2 * ms / 1e3, None) for n, ms in forward_ms.items()])
    assert cost.forward_points is not None
    assert [seconds * 1e3 for _, seconds in cost.forward_points] == pytest.approx([102.0, 102.0, 104.2, 138.7])


def test_measurements_without_a_count_every_stage_measured_make_no_model() -> None:
    with pytest.raises(ValueError, match="no token count was measured on every stage"):
        measured_cost_model([Measurement(0, 1024, 0.1, 0.2, None), Measurement(1, 2048, 0.2, 0.4, None)])


def test_the_capacity_is_chosen_by_the_measured_times_with_the_splits_train_will_make() -> None:
    """LLaMa-3.1-70B over 4 stages on H200s (the stages' mean forward, every layer recomputed) and one
    lone job: 1,024-token microbatches are bound by the host, and at 4,096 and 8,192 tokens the
    plan's lone global batches are split. A line through the larger counts (no fixed cost) put
    1,024 tokens first at 3,545 tokens/s; measured, it is the slowest."""
    forward_ms = {1024: 121.7, 2048: 134.5, 4096: 259.1, 8192: 522.5}
    measurements = [
        Measurement(stage, n, ms / 1e3, 2.17 * ms / 1e3, int(30e9 + 1e6 * n))
        for stage in range(4)
        for n, ms in forward_ms.items()
    ]
    jobs = [AdapterJob(name="xsum", sample_tokens=tuple([520] * 64), global_batch_size=16)]
    cost = measured_cost_model(measurements)
    chosen, options = choose_capacity(
        jobs,
        cost,
        measurements,
        candidates=list(forward_ms),
        stages=4,
        data_parallel=1,
        padding_multiple=64,
        memory_limit_bytes=None,
    )
    speed = {o.capacity: o.tokens_per_s for o in options}
    assert min(speed, key=speed.__getitem__) == 1024
    assert chosen in (4096, 8192)
    assert speed[chosen] > 1.4 * speed[1024]
    unsplit = lorafusion_sched.plan(
        jobs, lorafusion_sched.PlanOptions(capacity=8192, pipeline_stages=4, padding_multiple=64, use_milp=False)
    )
    by_capacity = {o.capacity: o for o in options}
    assert by_capacity[8192].microbatches > len(unsplit.microbatches), "split, as train will"
    _, options = choose_capacity(
        jobs,
        cost,
        measurements,
        candidates=[8192],
        stages=4,
        data_parallel=1,
        padding_multiple=64,
        memory_limit_bytes=30e9,
    )
    assert not options[0].fits
    assert options[0].microbatches == len(unsplit.microbatches), "not chosen: planned without the splits' search"


def test_the_measured_model_follows_a_host_bound_then_gpu_bound_stage_point_by_point() -> None:
    """Qwen2.5-32B, stage 0 of 2 on an H200 (every layer recomputed): flat to 4,096 tokens, then steep.

    Stage 1 runs 0.9 times as long. By the line through these points two microbatches of 4,096
    tokens take 1.29 times one of 8,192 (321 and 498 ms); by the measurements, 1.07 times."""
    forward_ms = {1024: 192.7, 2048: 258.4, 4096: 276.3, 8192: 514.0}
    measurements = [
        Measurement(stage, n, factor * ms / 1e3, 2.2 * factor * ms / 1e3, None)
        for stage, factor in ((0, 1.0), (1, 0.9))
        for n, ms in forward_ms.items()
    ]
    cost = measured_cost_model(measurements)
    assert cost.stage_factors == pytest.approx((1 / 0.95, 0.9 / 0.95))
    assert cost.backward_factor == pytest.approx(2.2)
    for n, ms in forward_ms.items():
        assert cost.forward_seconds(n, 0) == pytest.approx(ms / 1e3)
        assert cost.forward_seconds(n, 1) == pytest.approx(0.9 * ms / 1e3)
    assert cost.forward_seconds(3072, 0) == pytest.approx((258.4 + 276.3) / 2e3), "between two points: linear"
    assert cost.forward_seconds(512, 0) == pytest.approx(0.1927), "below the first: the first's time"
    assert cost.forward_seconds(16384, 0) == pytest.approx(1.028), "past the last: in proportion to the tokens"
    fixed, per_token = fit_line(list(map(float, forward_ms)), [ms * 0.95e-3 for ms in forward_ms.values()])
    assert (cost.forward_fixed_s, cost.forward_per_token_s) == pytest.approx((fixed, per_token))


def test_the_measured_model_keeps_the_counts_every_stage_measured() -> None:
    """Stage 1 ran out of memory at 4,096 tokens: the points end at 2,048, where both stages have times."""
    measurements = [m for m in _measurements() if (m.stage, m.tokens) != (1, 4096)]
    cost = measured_cost_model(measurements)
    assert cost.forward_points is not None
    assert [n for n, _ in cost.forward_points] == [1024, 2048]
    assert cost.stage_factors == pytest.approx((0.8, 1.2))
    assert cost.forward_seconds(2048, 1) == pytest.approx(1.2 * (1e-3 + 2e-6 * 2048))


def test_fit_line_never_goes_negative() -> None:
    assert fit_line([1.0, 2.0], [3.0, 1.0]) == (2.0, 0.0)
    assert fit_line([5.0, 5.0], [1.0, 3.0]) == (2.0, 0.0)


def test_peak_memory_counts_the_microbatches_in_flight_on_each_stage() -> None:
    # Stage 0 of 2 keeps two microbatches' activations, stage 1 one.
    peak = predicted_peak_bytes(_measurements(peak_per_token=1000.0), 2, 8192)
    assert peak == pytest.approx(1e9 + 2 * 1000.0 * 8192, rel=1e-6)
    assert predicted_peak_bytes(_measurements(), 2, 8192) is None


def test_the_largest_capacity_that_fits_memory_wins_when_throughput_grows_with_it() -> None:
    jobs = [AdapterJob(name=n, sample_tokens=tuple([700, 300, 1500, 900] * 8), global_batch_size=8) for n in "xy"]
    measurements = _measurements(peak_per_token=1e5)
    candidates = [2048, 4096, 8192]
    chosen, options = choose_capacity(
        jobs,
        measured_cost_model(measurements),
        measurements,
        candidates=candidates,
        stages=2,
        data_parallel=1,
        padding_multiple=64,
        memory_limit_bytes=1e9 + 2 * 1e5 * 4096 + 1,
    )
    assert [o.capacity for o in options] == candidates
    assert [o.fits for o in options] == [True, True, False]
    assert chosen == 4096
    assert options[1].tokens_per_s >= options[0].tokens_per_s
