"""plan() must always verify clean: random workloads, stages, capacities, padding multiples."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafusion_sched import AdapterJob, CostModel, PlanOptions, plan, simulate, verify
from lorafusion_sched.packing import highs
from lorafusion_sched.packing.greedy import greedy_pack
from lorafusion_sched.packing.problem import PackingProblem, bin_size
from lorafusion_sched.packing.solve import is_valid_packing, pack_with_milp

# Random workloads often end with a lone adapter; the no-op warning is tested in test_plan.py.
pytestmark = pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")

FAST = highs.SolverSettings(time_limit=0.01, node_limit=50, mip_rel_gap=0.0, seed=0)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[AdapterJob], PlanOptions]:
    padding = draw(st.sampled_from([1, 8, 64, 128]))
    capacity = padding * draw(st.integers(min_value=max(1, 64 // padding), max_value=4096 // padding))
    truncate = draw(st.booleans())
    top = capacity * 2 if truncate else capacity
    num_adapters = draw(st.integers(min_value=1, max_value=5))
    jobs = []
    for a in range(num_adapters):
        lengths = draw(st.lists(st.integers(min_value=1, max_value=top), min_size=1, max_size=30))
        gbs = draw(st.integers(min_value=1, max_value=8))
        jobs.append(AdapterJob(name=f"adapter-{a}", sample_tokens=tuple(lengths), global_batch_size=gbs))
    drop_last = draw(st.booleans()) and all(len(j.sample_tokens) >= j.global_batch_size for j in jobs)
    options = PlanOptions(
        capacity=capacity,
        pipeline_stages=draw(st.integers(min_value=1, max_value=6)),
        padding_multiple=padding,
        data_parallel=draw(st.integers(min_value=1, max_value=3)),
        drop_last=drop_last,
        truncate=truncate,
        merge=draw(st.booleans()),
        use_milp=draw(st.booleans()),
        neighbourhood=draw(st.sampled_from([None, 2, 3])),
        time_limit=0.01,
        node_limit=50,
        workers=1,
    )
    return jobs, options


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_plan_always_verifies_clean(workload: tuple[list[AdapterJob], PlanOptions]) -> None:
    jobs, options = workload
    p = plan(jobs, options)
    assert verify(p) == []
    compute = p.stats.num_microbatches - p.stats.num_noops
    assert compute >= p.stats.lower_bound
    assert all(mb.padded_tokens <= options.capacity for mb in p.microbatches)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 1024)), min_size=1, max_size=24),
    st.sampled_from([1, 16, 64]),
    st.sampled_from([None, 3]),
)
def test_milp_is_never_worse_than_greedy(items: list[tuple[int, int]], padding: int, neighbourhood: int | None) -> None:
    p = PackingProblem(
        adapters=tuple(a for a, _ in items), lengths=tuple(t for _, t in items), capacity=1024, padding=padding
    )
    greedy = greedy_pack(p)
    result = pack_with_milp(p, greedy, FAST, neighbourhood)
    assert is_valid_packing(p, result.packing)
    assert len(result.packing) <= len(greedy)
    if len(result.packing) == len(greedy):
        assert min(bin_size(p, b) for b in result.packing) <= min(bin_size(p, b) for b in greedy)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_merge_never_adds_microbatches(workload: tuple[list[AdapterJob], PlanOptions]) -> None:
    jobs, options = workload
    greedy = options.model_copy(update={"use_milp": False})
    merged = plan(jobs, greedy.model_copy(update={"merge": True}))
    unmerged = plan(jobs, greedy.model_copy(update={"merge": False}))
    assert merged.stats.num_microbatches <= unmerged.stats.num_microbatches


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_a_plan_is_never_longer_than_the_greedy_plan(workload: tuple[list[AdapterJob], PlanOptions]) -> None:
    """Per task the MILP is never worse; per plan too, although the no-ops and the merge act on the
    whole sequence (a review found a workload whose MILP plan was one microbatch longer)."""
    jobs, options = workload
    milp = plan(jobs, options.model_copy(update={"use_milp": True}))
    greedy = plan(jobs, options.model_copy(update={"use_milp": False}))
    assert milp.stats.num_microbatches <= greedy.stats.num_microbatches


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.sampled_from([1e-4, 1e-3, 1e-2, 0.1]),
    st.sampled_from([1e-6, 1e-5]),
    st.sampled_from([1.0, 2.0]),
    st.sampled_from([None, 256, 1024]),
)
def test_a_cost_model_never_makes_the_plan_slower_under_it(
    workload: tuple[list[AdapterJob], PlanOptions], fixed: float, per_token: float, backward: float, floor: int | None
) -> None:
    """Lone global batches are split only where the whole plan then simulates faster, and the result verifies.

    The model is a line, or (``floor``) measured points: flat up to ``floor`` tokens, then the line.
    """
    jobs, options = workload
    options = options.model_copy(update={"use_milp": False})  # time-limited solves could differ between the plans
    cost = CostModel(forward_fixed_s=fixed, forward_per_token_s=per_token, backward_factor=backward)
    if floor is not None:
        points = tuple((n, cost.forward_seconds(n, 0)) for n in (floor, 2 * floor, 8 * floor))
        cost = cost.model_copy(update={"forward_points": points})
    without = plan(jobs, options)
    with_cost = plan(jobs, PlanOptions.model_validate(options.model_dump() | {"cost_model": cost}))
    assert verify(with_cost) == []
    assert all(mb.padded_tokens <= options.capacity for mb in with_cost.microbatches)
    seconds = [simulate(p, cost, baselines=False).runs[0].makespan_s for p in (without, with_cost)]
    assert seconds[1] <= seconds[0]
    assert (with_cost.stats.split_batches == 0) == (with_cost.microbatches == without.microbatches)
