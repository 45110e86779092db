"""Balanced stage partition of a decoder (torch-free)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.partition import (
    BACKWARD_OVER_FORWARD,
    balanced_partition,
    decoder_costs,
    partition_model,
    recomputed_layers,
    stage_cost_factors,
)
from lorafusion_megatron.presets import PRESETS


def _brute_force(costs: list[float], stages: int, extra: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[-1] += extra
        best = min(best, max(loads))
    return best


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    stages=st.integers(1, 4),
    extra=st.integers(0, 30),
)
def test_partition_is_contiguous_non_empty_and_optimal(costs: list[int], stages: int, extra: int) -> None:
    stages = min(stages, len(costs))
    ranges = balanced_partition([float(c) for c in costs], stages, last_extra=float(extra))
    assert len(ranges) == stages
    assert ranges[0][0] == 0
    assert ranges[-1][1] == len(costs)
    assert all(start < stop for start, stop in ranges)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    loads = [float(sum(costs[a:b])) for a, b in ranges]
    loads[-1] += extra
    assert max(loads) == pytest.approx(_brute_force([float(c) for c in costs], stages, float(extra)))


def test_layers_need_not_divide_by_stages_and_the_head_counts() -> None:
    # 5 equal layers, a head worth 3 layers: the last stage gets one layer.
    assert balanced_partition([1.0] * 5, 2, last_extra=3.0) == [(0, 4), (4, 5)]
    assert balanced_partition([1.0] * 5, 2) in ([(0, 2), (2, 5)], [(0, 3), (3, 5)])


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(TrainerError, match=r"pipeline_stages \(or --pipeline-stages\) = 3"):
        balanced_partition([1.0, 1.0], 3)


def test_llama_70b_on_four_stages() -> None:
    specs = partition_model(PRESETS["llama-3.1-70b"].config, 4)
    assert [s.stage for s in specs] == [0, 1, 2, 3]
    assert specs[0].is_first
    assert specs[-1].is_last
    assert not specs[1].is_first
    assert sum(len(s.layers) for s in specs) == 80
    layers, head = decoder_costs(PRESETS["llama-3.1-70b"].config)
    # The LM head is worth about 1.2 layers here, so the last stage holds fewer layers.
    assert len(specs[-1].layers) < len(specs[0].layers)
    assert max(s.cost for s in specs) <= (sum(layers) + head) / 4 + max(layers)


def test_stage_cost_factors_weigh_each_stage_against_the_mean() -> None:
    config = PRESETS["llama-3.1-70b"].config
    factors = stage_cost_factors(config, 4)
    assert factors is not None
    assert sum(factors) == pytest.approx(4.0)
    costs = [spec.cost for spec in partition_model(config, 4)]
    assert factors.index(max(factors)) == costs.index(max(costs)) == 2  # the stage with 21 of 80 layers
    assert stage_cost_factors(config, 1) is None


def test_recomputed_layers_per_setting() -> None:
    config = PRESETS["llama-3.1-70b"].config
    assert recomputed_layers(config, 4, False) == (0, 0, 0, 0)
    assert recomputed_layers(config, 4, True) == (20, 20, 21, 19)
    assert recomputed_layers(config, 4, [3, 0, 21, 19]) == (3, 0, 21, 19)
    assert recomputed_layers(config, 1, "balanced") == recomputed_layers(config, 1, True) == (80,)
    with pytest.raises(TrainerError, match="gives 2 counts for 4 pipeline"):
        recomputed_layers(config, 4, [1, 2])
    with pytest.raises(
        TrainerError, match=r"stage 3 holds 19 decoder layer\(s\) \(layers 61 to 79\), so it can recompute 0 to 19"
    ):
        recomputed_layers(config, 4, [0, 0, 0, 20])


def test_balanced_recomputation_evens_out_the_stages() -> None:
    """LLaMa-3.1-70B over 4 stages: recomputing everything leaves the 21-layer stage 4% slower than the mean."""
    config = PRESETS["llama-3.1-70b"].config
    everything = stage_cost_factors(config, 4, recomputed_layers(config, 4, True))
    balanced = recomputed_layers(config, 4, "balanced")
    factors = stage_cost_factors(config, 4, balanced)
    assert everything is not None
    assert factors is not None
    assert max(everything) == pytest.approx(1.039, abs=1e-3)
    assert balanced == (19, 19, 17, 19)
    assert max(factors) < 1.007
    assert stage_cost_factors(config, 4, [0, 0, 0, 0]) == stage_cost_factors(config, 4)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(2, 40), stages=st.integers(2, 6), vocab=st.integers(1, 200_000))
def test_balanced_recomputes_all_it_can_without_exceeding_the_lightest_stage(
    layers: int, stages: int, vocab: int
) -> None:
    """Each stage recomputes as many layers as keep it within the cheapest stage's full-recompute time (or none)."""
    stages = min(stages, layers)
    config = {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "vocab_size": vocab,
    }
    layer_cost = decoder_costs(config)[0][0]
    specs = partition_model(config, stages)
    full = [(1 + BACKWARD_OVER_FORWARD) * spec.cost + len(spec.layers) * layer_cost for spec in specs]
    counts = recomputed_layers(config, stages, "balanced")
    for spec, count in zip(specs, counts, strict=True):
        time = (1 + BACKWARD_OVER_FORWARD) * spec.cost + count * layer_cost
        assert 0 <= count <= len(spec.layers)
        assert time <= min(full) * (1 + 1e-9) or count == 0  # some stages cost more even without
        assert count == len(spec.layers) or time + layer_cost > min(full) * (1 + 1e-9)
