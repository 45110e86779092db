from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafusion_sched import AdapterJob, CostModel, Plan, PlanOptions, SchedError, plan, simulate, verify
from lorafusion_sched.simulate import Event, _Item, _one_f_one_b, run_sequences, timeline
from lorafusion_sched.workloads import synthetic_jobs

UNIT = CostModel(forward_fixed_s=0.0, forward_per_token_s=1.0, backward_factor=2.0)


@pytest.mark.parametrize(("n", "stages"), [(1, 1), (4, 4), (8, 4), (16, 2), (3, 5)])
def test_uniform_1f1b_matches_the_closed_form(n: int, stages: int) -> None:
    makespan, busy = run_sequences([[[_Item(1, "a")] * n]], stages, UNIT)
    assert makespan == pytest.approx((n + stages - 1) * 3.0)
    assert busy == pytest.approx([3.0 * n] * stages)


def test_events_respect_dependencies() -> None:
    events: list[Event] = []
    run_sequences([[[_Item(t, "a") for t in (3, 1, 2, 5, 1)]]], 3, UNIT, events)
    end = {(e.stage, e.kind, e.microbatch): e.end for e in events}
    for e in events:
        if e.kind == "F" and e.stage > 0:
            assert e.start >= end[(e.stage - 1, "F", e.microbatch)] - 1e-12
        if e.kind == "B" and e.stage < 2:
            assert e.start >= end[(e.stage + 1, "B", e.microbatch)] - 1e-12
    per_stage: dict[int, list[Event]] = {}
    for e in events:
        per_stage.setdefault(e.stage, []).append(e)
    for evs in per_stage.values():
        evs.sort(key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(evs))


def _reference_1f1b(
    forward: list[list[float]], backward: list[list[float]], start: float
) -> dict[tuple[str, int, int], float]:
    """Every op's end, plainly: sweep the stages, each running its next ops while their inputs have ended."""
    stages, n = len(forward), len(forward[0])
    orders = []
    for s in range(stages):
        warmup = min(stages - 1 - s, n)
        steady = [op for j in range(n - warmup) for op in (("F", warmup + j), ("B", j))]
        orders.append([("F", i) for i in range(warmup)] + steady + [("B", i) for i in range(n - warmup, n)])
    end: dict[tuple[str, int, int], float] = {}
    clock = [start] * stages
    while len(end) < 2 * stages * n:
        for s, order in enumerate(orders):
            for kind, i in order[sum(1 for key in end if key[1] == s) :]:
                if kind == "F":
                    inputs = ("F", s - 1, i) if s > 0 else None
                else:
                    inputs = ("B", s + 1, i) if s < stages - 1 else ("F", s, i)
                if inputs is not None and inputs not in end:
                    break
                ready = end[inputs] if inputs is not None else start
                clock[s] = max(clock[s], ready) + (forward if kind == "F" else backward)[s][i]
                end[(kind, s, i)] = clock[s]
    return end


@settings(max_examples=200, deadline=None)
@given(
    stages=st.integers(1, 6),
    tokens=st.lists(st.sampled_from([0, 1, 2, 5]), max_size=14),
    factors=st.lists(st.sampled_from([0.5, 1.0, 1.5]), min_size=6, max_size=6),
    start=st.sampled_from([0.0, 2.5]),
)
def test_the_simulated_ops_end_where_a_plain_sweep_ends_them(
    stages: int, tokens: list[int], factors: list[float], start: float
) -> None:
    cost = CostModel(
        forward_fixed_s=0.0, forward_per_token_s=1.0, backward_factor=2.0, stage_factors=tuple(factors[:stages])
    )
    forward = [[factor * t for t in tokens] for factor in factors[:stages]]
    expected = _reference_1f1b(forward, [[2.0 * x for x in row] for row in forward], start) if tokens else {}
    events: list[Event] = []
    items = [_Item(t, "a") for t in tokens]
    assert _one_f_one_b(items, stages, cost, start, events) == max(expected.values(), default=start)
    assert {(e.kind, e.stage, e.microbatch): e.end for e in events} == {
        key: value for key, value in expected.items() if forward[key[1]][key[2]] > 0
    }
    _, busy = run_sequences([[items]], stages, cost)
    assert busy == pytest.approx([3.0 * factor * sum(tokens) for factor in factors[:stages]])


def test_four_adapters_beat_both_baselines() -> None:
    jobs = synthetic_jobs("het", 640, num_adapters=4, global_batch_size=16, seed=0)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=4, padding_multiple=64, use_milp=False))
    result = simulate(p)
    ours, megatron, mlora = (result.run(n) for n in ("lorafusion", "megatron", "mlora"))
    assert ours.bubble_ratio < mlora.bubble_ratio < megatron.bubble_ratio
    assert ours.tokens_per_s > mlora.tokens_per_s > megatron.tokens_per_s
    assert ours.tokens == megatron.tokens == mlora.tokens
    assert len(ours.bubble_ratio_per_stage) == 4


def test_stage_factors_must_match_the_pipeline() -> None:
    jobs = synthetic_jobs("xsum", 32, num_adapters=1, global_batch_size=8)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, use_milp=False))
    with pytest.raises(SchedError, match="stage_factors has 3 entries"):
        simulate(p, CostModel(stage_factors=(1.0, 1.0, 1.2)))
    slow_last = simulate(p, CostModel(stage_factors=(1.0, 1.5)), baselines=False)
    assert slow_last.runs[0].bubble_ratio_per_stage[0] > slow_last.runs[0].bubble_ratio_per_stage[1]
    with pytest.raises(SchedError, match="run = 'x'"):
        timeline(p, "x")


@pytest.mark.parametrize(
    ("samples", "needle"),
    [
        ({"xsum-0": 0}, r"microbatch_samples\['xsum-0'\] = 0: give a whole number"),
        ({"xsum-0": -2}, r"= -2: give a whole number"),
        ({"nobody": 4}, "names 'nobody', which is not an adapter of the plan"),
    ],
)
def test_baseline_microbatch_samples_are_checked(samples: dict[str, int], needle: str) -> None:
    jobs = synthetic_jobs("xsum", 32, num_adapters=1, global_batch_size=8)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, use_milp=False))
    assert [a.name for a in p.adapters] == ["xsum-0"]
    with pytest.raises(SchedError, match=needle):
        simulate(p, microbatch_samples=samples)


def test_data_parallel_simulation_runs() -> None:
    jobs = synthetic_jobs("het", 128, num_adapters=2, global_batch_size=8, seed=1)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, data_parallel=2, use_milp=False))
    result = simulate(p)
    assert all(r.makespan_s > 0 for r in result.runs)


def test_single_stage_has_no_negative_bubble() -> None:
    jobs = synthetic_jobs("mixed", 96, num_adapters=3, global_batch_size=8, seed=2)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=1, use_milp=False))
    for run in simulate(p).runs:
        assert all(ratio >= 0.0 for ratio in run.bubble_ratio_per_stage), run
        assert run.bubble_ratio >= 0.0


def _noops_dropped() -> Plan:
    """A plan whose no-ops a runtime dropped: it simulates faster than the valid plan, and trains on stale weights."""
    job = AdapterJob(name="solo", sample_tokens=(300,) * 12, global_batch_size=3)
    p = plan([job], PlanOptions(capacity=1024, pipeline_stages=4, use_milp=False))
    assert p.stats.num_noops > 0
    return p.model_copy(update={"microbatches": tuple(mb for mb in p.microbatches if not mb.noop)})


def test_an_invalid_plan_is_refused_not_simulated() -> None:
    bad = _noops_dropped()
    count = len(verify(bad))
    with pytest.raises(
        SchedError, match=rf"the plan has {count} violation\(s\), so it is not simulated: \[bubble_lemma\]"
    ):
        simulate(bad)
    with pytest.raises(SchedError, match=r"Run `lorafusion-sched verify` on the plan file .* and plan again"):
        simulate(bad, baselines=False)
    with pytest.raises(SchedError, match="not simulated"):
        timeline(bad)


def test_an_unknown_run_lists_the_runs() -> None:
    jobs = synthetic_jobs("xsum", 32, num_adapters=1, global_batch_size=8)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, use_milp=False))
    with pytest.raises(KeyError) as info:
        simulate(p).run("nope")
    assert str(info.value) == "run 'nope' is not in this result; choose one of ['lorafusion', 'megatron', 'mlora']"
    with pytest.raises(SchedError, match=r"choose one of \['lorafusion'\]; simulate\(\.\.\., baselines=True\) adds"):
        simulate(p, baselines=False).run("megatron")


def test_baseline_samples_per_microbatch_take_whole_numbers_as_the_models_do() -> None:
    """``numpy.int64(2)`` and ``2.0`` were refused as "not a whole number"; every model takes them."""
    import numpy as np

    jobs = synthetic_jobs("xsum", 32, num_adapters=1, global_batch_size=8)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, use_milp=False))
    expected = simulate(p, microbatch_samples={"xsum-0": 2})
    for count in (np.int64(2), 2.0):
        assert simulate(p, microbatch_samples={"xsum-0": count}) == expected
    with pytest.raises(SchedError, match=r"microbatch_samples\['xsum-0'\] = 2.5: give a whole number, not a fraction"):
        simulate(p, microbatch_samples={"xsum-0": 2.5})


@pytest.mark.parametrize("fixed", [1e308, 1e-320])
def test_seconds_past_a_float_are_an_error_not_inf(fixed: float) -> None:
    """``forward_fixed_s = 1e308`` gave makespan inf (a traceback in the CLI's table); 1e-320 gave inf tokens/s."""
    jobs = synthetic_jobs("xsum", 32, num_adapters=1, global_batch_size=8)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, use_milp=False))
    with pytest.raises(SchedError, match="the cost model's seconds per microbatch are out of range"):
        simulate(p, CostModel(forward_fixed_s=fixed, forward_per_token_s=0.0), baselines=False)


def test_the_simulator_remembers_pipelines_by_digest_not_by_copy() -> None:
    """It kept whole token tuples: 178 MB after planning a 100,000-sample job, freed only by clearing the cache."""
    import importlib

    simulate_module = importlib.import_module("lorafusion_sched.simulate")
    run_sequences([[[_Item(t, "a") for t in range(1, 2000)]]], 4, UNIT)
    assert simulate_module._ends
    assert all(isinstance(key[0], bytes) and len(key[0]) == 16 for key in simulate_module._ends)
