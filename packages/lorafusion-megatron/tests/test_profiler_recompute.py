"""``activation_checkpointing: auto``: the recomputation model and the choice it drives (torch-free)."""

from __future__ import annotations

import math

import pytest

from lorafusion_megatron.profiler.capacity import choose_capacity
from lorafusion_megatron.profiler.fit import measured_cost_model
from lorafusion_megatron.profiler.measure import Measurement
from lorafusion_megatron.profiler.recompute import RecomputeModel, adjusted_cost, fewest_recomputed, fit_recompute
from lorafusion_sched import AdapterJob

GIB = 2**30
LAYERS = 10
HELD = 100_000.0
"""Bytes per token of each layer that keeps its activations."""
SAVED = 1e-6
"""Backward seconds per token saved by each layer not recomputed."""


def _with_all(stage: int, factor: float = 1.0) -> list[Measurement]:
    """A stage that recomputes all of its layers: 10 GiB of weights, 20 KB per token held."""
    out = []
    for tokens in (1024, 2048, 4096):
        forward = factor * (1e-3 + 2e-6 * tokens)
        out.append(Measurement(stage, tokens, forward, 2.5 * forward, int(10 * GIB + 20_000 * tokens)))
    return out


def _kept(with_all: Measurement) -> Measurement:
    """The same run with no layer recomputed."""
    extra = with_all.tokens * LAYERS
    return Measurement(
        with_all.stage,
        with_all.tokens,
        with_all.forward_s,
        with_all.backward_s - SAVED * extra,
        int(with_all.peak_bytes or 0) + int(HELD * extra),
    )


def test_fit_recovers_what_a_kept_layer_costs_and_saves() -> None:
    measured = _with_all(0)[-1]
    model = fit_recompute(measured, _kept(measured), LAYERS)
    assert model == RecomputeModel(
        stage=0, layers=LAYERS, bytes_per_token=pytest.approx(HELD), seconds_per_token=pytest.approx(SAVED)
    )
    with pytest.raises(ValueError, match="different runs"):
        fit_recompute(measured, _kept(_with_all(0)[0]), LAYERS)
    on_cpu = Measurement(0, 1024, 1.0, 2.0, None)
    assert fit_recompute(on_cpu, Measurement(0, 1024, 1.0, 1.5, None), 5).bytes_per_token == 0.0


def test_fewest_recomputed_layers_fill_the_memory_left() -> None:
    model = RecomputeModel(stage=0, layers=LAYERS, bytes_per_token=HELD, seconds_per_token=SAVED)
    # 2 microbatches of 4,096 tokens: each kept layer holds 819.2 MB; 3.5 of them fit in 2.867 GB.
    fits = {"peak_all": 20e9, "in_flight": 2, "tokens": 4096}
    assert fewest_recomputed(model, **fits, limit=20e9 + 3.5 * 2 * 4096 * HELD) == LAYERS - 3
    assert fewest_recomputed(model, **fits, limit=1e12) == 0
    assert fewest_recomputed(model, **fits, limit=20e9) == LAYERS
    assert fewest_recomputed(model, **fits, limit=19e9) is None
    assert fewest_recomputed(model, **fits, limit=None) == 0
    never = RecomputeModel(stage=0, layers=LAYERS, bytes_per_token=math.inf, seconds_per_token=0.0)
    assert fewest_recomputed(never, **fits, limit=1e12) == LAYERS


def test_adjusted_cost_gives_each_stage_its_time_at_the_capacity() -> None:
    measurements = _with_all(0, 0.8) + _with_all(1, 1.2)
    cost = measured_cost_model(measurements)
    models = [RecomputeModel(s, LAYERS, HELD, SAVED) for s in (0, 1)]
    tokens = 4096
    adjusted = adjusted_cost(cost, models, [LAYERS, 4], tokens)
    for stage, recomputed in ((0, LAYERS), (1, 4)):
        expected = cost.forward_seconds(tokens, stage) * (1 + cost.backward_factor)
        expected -= (LAYERS - recomputed) * SAVED * tokens
        got = adjusted.forward_seconds(tokens, stage) * (1 + adjusted.backward_factor)
        assert got == pytest.approx(expected)
    assert adjusted_cost(cost, models, [LAYERS, LAYERS], tokens).stage_factors == pytest.approx(cost.stage_factors)


def test_auto_chooses_per_stage_counts_and_the_capacity_with_them() -> None:
    """Stage 0 of 2 holds two microbatches, stage 1 one: stage 0 recomputes more at the same capacity."""
    measurements = _with_all(0) + _with_all(1)
    cost = measured_cost_model(measurements)
    models = [RecomputeModel(s, LAYERS, HELD, SAVED) for s in (0, 1)]
    jobs = [AdapterJob(name="a", sample_tokens=[512] * 64, global_batch_size=16)]
    limit = 12 * GIB
    chosen, options = choose_capacity(
        jobs,
        cost,
        measurements,
        candidates=[1024, 4096, 65536],
        stages=2,
        data_parallel=1,
        padding_multiple=64,
        memory_limit_bytes=limit,
        recompute=models,
    )
    by_capacity = {o.capacity: o for o in options}
    for capacity in (1024, 4096):
        option = by_capacity[capacity]
        assert option.fits
        assert option.recomputed_layers is not None
        for stage, count in enumerate(option.recomputed_layers):
            in_flight = 2 - stage
            peak_all = 10 * GIB + in_flight * 20_000 * capacity
            assert peak_all + in_flight * capacity * (LAYERS - count) * HELD <= limit
            if count:  # one layer fewer would not fit
                assert peak_all + in_flight * capacity * (LAYERS - count + 1) * HELD > limit
        assert option.peak_bytes is not None
        assert option.peak_bytes <= limit
    assert by_capacity[4096].recomputed_layers == (8, 5)
    assert by_capacity[1024].recomputed_layers == (0, 0)
    assert not by_capacity[65536].fits  # even recomputing everything does not
    assert by_capacity[65536].recomputed_layers is None
    assert chosen in (1024, 4096)


def test_a_stage_that_cannot_keep_any_layer_recomputes_all_of_them() -> None:
    """Its run with no layer recomputed ran out of memory at every count: an infinite cost per kept layer."""
    measurements = _with_all(0) + _with_all(1)
    models = [RecomputeModel(0, LAYERS, math.inf, 0.0), RecomputeModel(1, LAYERS, HELD, SAVED)]
    jobs = [AdapterJob(name="a", sample_tokens=[512] * 64, global_batch_size=16)]
    _, [option] = choose_capacity(
        jobs,
        measured_cost_model(measurements),
        measurements,
        candidates=[4096],
        stages=2,
        data_parallel=1,
        padding_multiple=64,
        memory_limit_bytes=12 * GIB,
        recompute=models,
    )
    assert option.recomputed_layers == (LAYERS, 5)
    assert option.peak_bytes is not None
    assert math.isfinite(option.peak_bytes)
