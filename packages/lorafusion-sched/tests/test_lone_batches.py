"""Global batches that run alone, split into smaller microbatches where the cost model finds that faster."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lorafusion_sched import AdapterJob, CostModel, Plan, PlanOptions, lone_batches, plan, simulate, verify
from lorafusion_sched.lone_batches import Splitting, split_lone_batches, split_lone_tail
from lorafusion_sched.sequence import Slot
from lorafusion_sched.workloads import synthetic_jobs

# These workloads end with a lone adapter on purpose; the warning is tested in test_plan.py.
pytestmark = pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")

SMALL_FIXED = CostModel(forward_fixed_s=1e-3, forward_per_token_s=1e-5)
"""Fixed cost of 100 tokens: splitting a lone 4,096-token batch pays."""

NO_PER_TOKEN = CostModel(forward_fixed_s=1e-3, forward_per_token_s=0.0)
"""Every microbatch costs the same: a split never pays."""


def _seconds(p: Plan, cost: CostModel) -> float:
    return simulate(p, cost, baselines=False).runs[0].makespan_s


def _lopsided(seed: int = 3) -> list[AdapterJob]:
    """Two short jobs and one with eight times their samples: the long one ends alone."""
    short = synthetic_jobs("het", 64, num_adapters=2, global_batch_size=16, seed=seed)
    long = synthetic_jobs("cnndm", 256, num_adapters=1, global_batch_size=16, seed=seed + 1)[0]
    return [*short, long.model_copy(update={"name": "long"})]


def _options(**updates: object) -> PlanOptions:
    base = {"capacity": 4096, "pipeline_stages": 4, "padding_multiple": 64, "use_milp": False, "workers": 1}
    return PlanOptions.model_validate(base | updates)


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_a_lone_tail_is_split_into_a_plan_that_verifies_and_simulates_faster(data_parallel: int) -> None:
    jobs = _lopsided()
    unsplit = plan(jobs, _options(data_parallel=data_parallel))
    split = plan(jobs, _options(data_parallel=data_parallel, cost_model=SMALL_FIXED))
    assert unsplit.stats.split_batches == 0
    assert split.stats.split_batches > 0
    assert verify(split) == [], "every sample once, capacity, bubble lemma, steps"
    assert (
        split.stats.num_microbatches - split.stats.num_noops > unsplit.stats.num_microbatches - unsplit.stats.num_noops
    )
    assert _seconds(split, SMALL_FIXED) < 0.95 * _seconds(unsplit, SMALL_FIXED)

    def long_microbatches(p: Plan) -> int:
        return sum(1 for mb in p.microbatches for s in mb.segments if s.adapter == "long")

    assert long_microbatches(split) > long_microbatches(unsplit), "the job left alone is the one split"


def test_a_split_keeps_every_global_batch_and_its_optimizer_step() -> None:
    """The split spreads a global batch over more microbatches; the samples per step do not change."""
    jobs = _lopsided()
    split = plan(jobs, _options(cost_model=SMALL_FIXED))
    for info in split.adapters:
        seen: dict[int, list[int]] = {}
        for mb in split.microbatches:
            for s in mb.segments:
                if s.adapter == info.name:
                    seen.setdefault(s.global_batch, []).extend(s.samples)
        gbs = info.global_batch_size
        assert {g: sorted(samples) for g, samples in seen.items()} == {
            g: list(range(g * gbs, min((g + 1) * gbs, info.num_samples))) for g in range(info.num_global_batches)
        }
        steps = sum(info.name in mb.step_after for mb in split.microbatches)
        assert steps == info.num_global_batches


def test_nothing_is_split_when_every_microbatch_costs_the_same() -> None:
    jobs = _lopsided()
    unsplit = plan(jobs, _options())
    same = plan(jobs, _options(cost_model=NO_PER_TOKEN))
    assert same.stats.split_batches == 0
    assert same.microbatches == unsplit.microbatches


def test_one_stage_and_one_replica_never_split() -> None:
    """Without a pipeline there is no drain to shorten: more microbatches only add fixed costs."""
    jobs = _lopsided()
    p = plan(jobs, _options(pipeline_stages=1, cost_model=SMALL_FIXED))
    assert p.stats.split_batches == 0


def test_a_round_padded_with_no_ops_is_filled_when_fixed_costs_are_large() -> None:
    """With 2 replicas, a global batch of one microbatch leaves the other replica a no-op in its round.

    Split in two, both replicas work in that round: no more rounds, each half as long, however
    large the fixed cost.
    """
    job = AdapterJob(name="solo", sample_tokens=(1000,) * 32, global_batch_size=4)
    large_fixed = CostModel(forward_fixed_s=0.1, forward_per_token_s=1e-5)
    unsplit = plan([job], _options(data_parallel=2))
    split = plan([job], _options(data_parallel=2, cost_model=large_fixed))
    assert split.stats.split_batches == 8
    assert split.stats.num_microbatches == unsplit.stats.num_microbatches
    assert split.stats.num_noops == unsplit.stats.num_noops - 8
    assert _seconds(split, large_fixed) < _seconds(unsplit, large_fixed)


def test_only_a_lone_batch_followed_by_a_drain_is_split() -> None:
    """S = 2: adapter 0's batch 0 is followed by adapter 1's work, its batch 1 by a no-op and the end."""
    slots: list[Slot] = [
        {0: (0, [0, 1, 2, 3])},
        {1: (0, [0])},
        {0: (1, [4, 5, 6, 7])},
    ]
    lengths = [[1000] * 8, [1000]]
    out = split_lone_batches(
        slots, Splitting(lengths, capacity=4096, padding=1, stages=2, replicas=1, cost=SMALL_FIXED)
    )
    assert out[:2] == slots[:2], "batch 0 has adapter 1's microbatch to overlap with: kept"
    assert [slot[0] for slot in out[2:]] == [(1, [4]), (1, [5]), (1, [6]), (1, [7])], "(4 + 1) x 1,100 < 2 x 4,100"


def test_a_groups_global_batches_are_split_together() -> None:
    """Adapters 0 and 1 share their microbatches (a group): their batch 0 is split as one unit."""
    slots: list[Slot] = [{0: (0, [0, 1, 2]), 1: (0, [0])}, {0: (0, [3]), 1: (0, [1, 2])}, {}]
    how = Splitting([[1000] * 4, [1000] * 3], capacity=4096, padding=1, stages=2, replicas=1, cost=SMALL_FIXED)
    out = split_lone_batches(slots, how)
    assert len([slot for slot in out if slot]) > 2
    for adapter, samples in ((0, [0, 1, 2, 3]), (1, [0, 1, 2])):
        assert sorted(s for slot in out if adapter in slot for s in slot[adapter][1]) == samples
    assert all(max(how.size(slot) for slot in out) <= 4096 for _ in out)
    assert how.seconds(out) < how.seconds(slots)


def test_a_unit_holding_two_global_batches_of_one_adapter_is_not_split() -> None:
    """Adapter 1's batches 0 and 1 are tied together through adapter 0's microbatches: not one step's samples."""
    slots: list[Slot] = [{0: (0, [0]), 1: (0, [0])}, {0: (0, [1])}, {0: (0, [2]), 1: (1, [1])}, {}]
    how = Splitting([[1000] * 3, [1000] * 2], capacity=4096, padding=1, stages=2, replicas=1, cost=SMALL_FIXED)
    assert split_lone_batches(slots, how) == slots


def test_no_split_goes_over_the_capacity() -> None:
    """Dealt longest first, samples of 3, 3 and 2 tokens do not fit two microbatches of 4."""
    how = Splitting([[3, 3, 2]], capacity=4, padding=1, stages=2, replicas=1, cost=SMALL_FIXED)
    unit: list[Slot] = [{0: (0, [0, 1, 2])}]
    assert how.deal(unit, 2) is None
    assert how.deal(unit, 3) == [{0: (0, [0])}, {0: (0, [1])}, {0: (0, [2])}]


FOUR_ADAPTERS_S3 = Splitting(
    [[1000] * 4, [1000] * 8, [1000] * 8, [1000]], capacity=4096, padding=1, stages=3, replicas=1, cost=SMALL_FIXED
)
"""The tail tests' adapters: 0 with 4 samples, 1 and 2 with 8, 3 with 1; 1,000 tokens each; S = 3."""


def test_the_tail_is_split_but_a_global_batch_begun_before_it_is_kept() -> None:
    """S = 3: adapters 1 and 2 fill part of each other's waits; the no-op between them is no drain.

    Adapter 0's batch 0 began in a shared microbatch: its lone second microbatch stays whole.
    """
    slots: list[Slot] = [
        {0: (0, [0, 1]), 3: (0, [0])},
        {0: (0, [2, 3])},
        {1: (0, [0, 1, 2, 3])},
        {2: (0, [0, 1, 2, 3])},
        {},
        {1: (1, [4, 5, 6, 7])},
        {2: (1, [4, 5, 6, 7])},
    ]
    how = FOUR_ADAPTERS_S3
    per_batch = split_lone_batches(slots, how)
    assert per_batch[:6] == slots[:6], "only the plan's last global batch is followed by a drain (the end)"
    out = split_lone_tail(slots, how)
    assert out[:2] == slots[:2]
    for adapter in (1, 2):
        for batch, samples in ((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])):
            groups = [slot[adapter][1] for slot in out if adapter in slot and slot[adapter][0] == batch]
            assert len(groups) > 1
            assert sorted(s for group in groups for s in group) == samples
    assert how.seconds(out) < how.seconds(slots)


def _two_long_jobs() -> list[AdapterJob]:
    short = synthetic_jobs("het", 64, num_adapters=4, global_batch_size=32, seed=0)
    longs = synthetic_jobs("xsum", 512, num_adapters=2, global_batch_size=16, seed=5)
    return [*short, *(job.model_copy(update={"name": f"long-{i}"}) for i, job in enumerate(longs))]


def test_two_long_jobs_left_together_are_split_in_the_tail() -> None:
    """No global batch of the two is followed by a whole drain (each fills part of the other's), so
    only the tail's split can shorten them; with 2 replicas the no-ops are most of that tail."""
    jobs = _two_long_jobs()
    unsplit = plan(jobs, _options(data_parallel=2))
    split = plan(jobs, _options(data_parallel=2, cost_model=SMALL_FIXED))
    assert verify(split) == []
    assert split.stats.split_batches > 0
    assert _seconds(unsplit, SMALL_FIXED) > 1.3 * _seconds(split, SMALL_FIXED)


def test_a_split_the_model_finds_less_than_min_gain_faster_is_not_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one replica the two long jobs leave 3 no-ops: with a fixed cost of 500 tokens the tail's
    split gains about 2%, under MIN_GAIN."""
    jobs = _two_long_jobs()
    cost = CostModel(forward_fixed_s=5e-3, forward_per_token_s=1e-5)
    unsplit = plan(jobs, _options())
    split = plan(jobs, _options(cost_model=cost))
    assert split.stats.split_batches == 0
    assert split.microbatches == unsplit.microbatches
    monkeypatch.setattr(lone_batches, "MIN_GAIN", 1.0)
    anyway = plan(jobs, _options(cost_model=cost))
    assert anyway.stats.split_batches > 0
    assert 1.0 < _seconds(unsplit, cost) / _seconds(anyway, cost) < 1.03


def test_stage_factors_must_match_the_pipeline() -> None:
    with pytest.raises(ValidationError, match=r"cost_model\.stage_factors has 2 entries for pipeline_stages = 4"):
        _options(cost_model={"stage_factors": [1.0, 1.2]})
    assert _options(cost_model={"stage_factors": [1.0, 1.2, 1.0, 1.5]}).cost_model is not None


def test_options_copied_past_their_checks_are_checked_again() -> None:
    """``model_copy(update=...)`` skips pydantic's validators; plan() must not fail with an IndexError."""
    options = _options(pipeline_stages=2, cost_model={"stage_factors": [1.0, 1.2]})
    job = AdapterJob(name="a", sample_tokens=(1000,) * 32, global_batch_size=4)
    with pytest.raises(ValidationError, match=r"cost_model\.stage_factors has 2 entries for pipeline_stages = 8"):
        plan([job], options.model_copy(update={"pipeline_stages": 8}))


def test_a_global_batch_begun_before_the_tail_is_kept_wherever_its_microbatches_lie() -> None:
    """Adapter 0's batch 0 began in a shared microbatch; its lone second one lies inside the tail."""
    slots: list[Slot] = [
        {0: (0, [0, 1]), 3: (0, [0])},
        {1: (0, [0, 1, 2, 3])},
        {0: (0, [2, 3])},
        {2: (0, [0, 1, 2, 3])},
        {},
        {1: (1, [4, 5, 6, 7])},
        {2: (1, [4, 5, 6, 7])},
    ]
    how = FOUR_ADAPTERS_S3
    out = split_lone_tail(slots, how)
    assert out != slots, "adapters 1 and 2 are split"
    assert [slot for slot in out if 0 in slot] == [slots[0], slots[2]]


def test_measured_points_split_a_lone_batch_where_the_host_bound_floor_ends() -> None:
    """A stage flat up to 1,024 tokens (the host's floor), then proportional: a lone global batch of
    4,096 tokens goes fastest in four microbatches of 1,024 (seven slots of one floor each, against
    four slots of four floors unsplit); smaller ones would add slots at the same floor."""
    cost = CostModel(forward_points=((64, 1e-2), (1024, 1e-2), (4096, 4e-2)))
    job = AdapterJob(name="one", sample_tokens=(256,) * 16, global_batch_size=16)
    split = plan([job], _options(capacity=4096, cost_model=cost))
    assert verify(split) == []
    assert sorted(mb.padded_tokens for mb in split.microbatches if not mb.noop) == [1024] * 4
    unsplit = plan([job], _options(capacity=4096))
    assert _seconds(unsplit, cost) / _seconds(split, cost) == pytest.approx(16 / 7)


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_two_jobs_of_one_length_are_split_though_their_microbatches_mix(data_parallel: int) -> None:
    """Two equal jobs alternate to the end; where one's global batch ends and the other's begins
    they share a microbatch here and there, so the suffix that holds one adapter per microbatch is
    short. Neither ended early, so the whole plan is their tail. With 2 replicas nearly half of its
    slots were no-ops."""
    jobs = synthetic_jobs("xsum", 512, num_adapters=2, global_batch_size=16, seed=9)
    unsplit = plan(jobs, _options(data_parallel=data_parallel))
    assert any(len(mb.segments) > 1 for mb in unsplit.microbatches[len(unsplit.microbatches) // 2 :])
    split = plan(jobs, _options(data_parallel=data_parallel, cost_model=SMALL_FIXED))
    assert verify(split) == []
    assert split.stats.split_batches == sum(a.num_global_batches for a in split.adapters), "every global batch"
    assert _seconds(unsplit, SMALL_FIXED) / _seconds(split, SMALL_FIXED) > (1.2 if data_parallel == 1 else 1.7)
