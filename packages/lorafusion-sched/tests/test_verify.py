from __future__ import annotations

import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from lorafusion_sched import AdapterJob, Microbatch, Plan, PlanOptions, RuntimeSettings, Segment, plan, verify


def make_job(name: str, lengths: list[int], gbs: int) -> AdapterJob:
    return AdapterJob(name=name, sample_tokens=tuple(lengths), global_batch_size=gbs)


@pytest.fixture
def good() -> Plan:
    jobs = [make_job("a", [300, 200, 500, 100, 250, 50], gbs=2), make_job("b", [700, 800, 120, 90], gbs=2)]
    return plan(jobs, PlanOptions(capacity=1024, pipeline_stages=2, padding_multiple=64, use_milp=False))


def replace_mb(p: Plan, index: int, **changes: Any) -> Plan:
    mbs = list(p.microbatches)
    mbs[index] = mbs[index].model_copy(update=changes)
    return p.model_copy(update={"microbatches": tuple(mbs)})


def with_microbatches(p: Plan, microbatches: tuple[Microbatch, ...]) -> Plan:
    """``p`` with other microbatches, and the counts in its stats to match (so only deeper checks fail)."""
    noops = sum(mb.noop for mb in microbatches)
    stats = p.stats.model_copy(update={"num_microbatches": len(microbatches), "num_noops": noops})
    return p.model_copy(update={"microbatches": microbatches, "stats": stats})


def kinds(p: Plan) -> set[str]:
    return {v.kind for v in verify(p)}


def first_with(p: Plan, adapter: str) -> int:
    return next(i for i, mb in enumerate(p.microbatches) if any(s.adapter == adapter for s in mb.segments))


def test_good_plan_is_clean(good: Plan) -> None:
    assert verify(good) == []


def test_missing_and_repeated_samples(good: Plan) -> None:
    i = first_with(good, "a")
    assert "sample_missing" in kinds(replace_mb(good, i, segments=(), noop=True))
    doubled = good.model_copy(update={"microbatches": (*good.microbatches, good.microbatches[i])})
    assert "sample_repeated" in kinds(doubled)


def test_capacity_and_token_counts(good: Plan) -> None:
    i = first_with(good, "b")
    seg = next(s for s in good.microbatches[i].segments if s.adapter == "b")
    big = seg.model_copy(update={"tokens": 2000, "padded_tokens": 2048})
    found = kinds(replace_mb(good, i, segments=(big,)))
    assert {"capacity", "tokens"} <= found


def test_two_global_batches_order_and_lemma(good: Plan) -> None:
    a_segments = [(i, s) for i, mb in enumerate(good.microbatches) for s in mb.segments if s.adapter == "a"]
    i0, s1 = a_segments[0][0], a_segments[-1][1]
    both = (*good.microbatches[i0].segments, s1)
    assert "two_global_batches" in kinds(replace_mb(good, i0, segments=both))
    swapped = list(good.microbatches)
    first, last = a_segments[0][0], a_segments[-1][0]
    swapped[first], swapped[last] = swapped[last], swapped[first]
    assert {"batch_order", "bubble_lemma"} & kinds(good.model_copy(update={"microbatches": tuple(swapped)}))


def test_removing_noops_breaks_the_lemma() -> None:
    p = plan([make_job("solo", [300] * 6, gbs=2)], PlanOptions(capacity=1024, pipeline_stages=3, use_milp=False))
    compact = tuple(mb for mb in p.microbatches if not mb.noop)
    violations = verify(with_microbatches(p, compact))
    assert {v.kind for v in violations} == {"bubble_lemma"}
    assert "needs 3" in violations[0].message
    assert [v.microbatch for v in violations] == sorted(v.microbatch for v in violations)


def test_a_dropped_global_batch_cannot_pass_for_drop_last() -> None:
    """Removing the partial last batch and claiming floor(7 / 3) batches leaves dropped_samples wrong."""
    p = plan([make_job("a", [100, 200, 300, 400, 500, 600, 700], gbs=3)], PlanOptions(capacity=1024, use_milp=False))
    kept = tuple(mb for mb in p.microbatches if all(s.global_batch < 2 for s in mb.segments))
    adapters = (p.adapters[0].model_copy(update={"num_global_batches": 2}),)
    tampered = with_microbatches(p, kept).model_copy(update={"adapters": adapters})
    messages = [v.message for v in verify(tampered) if v.kind == "stats"]
    assert any("stats.dropped_samples = 0, but the plan gives 1" in m for m in messages)


@pytest.mark.parametrize(
    ("field", "value"), [("num_microbatches", 1), ("num_noops", -4), ("fill_ratio", 7.0), ("token_ratio", 0.0)]
)
def test_stats_that_follow_from_the_plan_are_checked(good: Plan, field: str, value: float) -> None:
    tampered = good.model_copy(update={"stats": good.stats.model_copy(update={field: value})})
    assert [v.kind for v in verify(tampered)] == ["stats"]
    assert f"stats.{field} = {value}" in verify(tampered)[0].message


def test_a_huge_claimed_global_batch_count_is_flagged_at_once(good: Plan) -> None:
    """A corrupt count must not make verify loop over it (10**12 global batches of 6 samples)."""
    import time

    adapters = (good.adapters[0].model_copy(update={"num_global_batches": 10**12}), *good.adapters[1:])
    start = time.perf_counter()
    assert "schema" in kinds(good.model_copy(update={"adapters": adapters}))
    assert time.perf_counter() - start < 5


def test_sample_lengths_below_one_token_are_refused(good: Plan) -> None:
    data = json.loads(good.model_dump_json())
    data["adapters"][0]["sample_tokens"][0] = 0
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Plan.model_validate(data)


def test_step_after_noop_and_replica_consistency(good: Plan) -> None:
    i = first_with(good, "a")
    assert "step_after" in kinds(replace_mb(good, i, step_after=("nobody",)))
    assert "noop" in kinds(replace_mb(good, i, noop=True))
    assert "replica" in kinds(replace_mb(good, i, replica=1))


def test_wrong_global_batch_and_unknown_adapter(good: Plan) -> None:
    i = first_with(good, "a")
    seg = good.microbatches[i].segments[0]
    wrong = seg.model_copy(update={"global_batch": seg.global_batch + 1})
    assert "sample_wrong_batch" in kinds(replace_mb(good, i, segments=(wrong,)))
    ghost = Segment(adapter="ghost", global_batch=0, samples=(0,), tokens=1, padded_tokens=64)
    extra = with_microbatches(good, (*good.microbatches, Microbatch(segments=(ghost,))))
    assert "schema" in kinds(extra)


def test_violation_message_names_the_microbatch(good: Plan) -> None:
    i = first_with(good, "a")
    text = str(verify(replace_mb(good, i, step_after=("nobody",)))[0])
    assert text.startswith(f"[step_after] microbatch {i}:")


@pytest.mark.parametrize(
    "runtime",
    [
        RuntimeSettings(),
        RuntimeSettings(capacity=1024, pipeline_stages=2, data_parallel=1, padding_multiple=64),
        RuntimeSettings(capacity=8192),  # a larger microbatch holds the plan's
        RuntimeSettings(pipeline_stages=1),  # fewer stages need a shorter distance than the plan keeps
        RuntimeSettings(padding_multiple=16),  # segments padded to 64 are padded to 16 too
        RuntimeSettings(padding_multiple=1),
    ],
    ids=["none", "same", "larger-capacity", "fewer-stages", "padding-divides", "no-padding"],
)
def test_a_plan_fits_runtime_settings_it_was_made_for(good: Plan, runtime: RuntimeSettings) -> None:
    assert verify(good, runtime=runtime) == []


@pytest.mark.parametrize(
    ("runtime", "needle"),
    [
        (RuntimeSettings(capacity=512), r"capacity = 1024: .* the runtime's capacity 512; .* capacity <= 512"),
        (RuntimeSettings(pipeline_stages=3), r"pipeline_stages = 2: .* runtime's 3 pipeline stages .* >= 3"),
        (RuntimeSettings(data_parallel=2), r"data_parallel = 1: .* to 1 replicas, the runtime has 2; .* = 2"),
        (
            RuntimeSettings(padding_multiple=128),
            r"padding_multiple = 64: .* multiples of 128, which does not divide 64",
        ),
        (RuntimeSettings(padding_multiple=48), r"padding_multiple = 64: .* multiples of 48"),
    ],
    ids=["smaller-capacity", "more-stages", "other-data-parallel", "coarser-padding", "padding-not-dividing"],
)
def test_a_plan_made_for_other_settings_is_a_violation(good: Plan, runtime: RuntimeSettings, needle: str) -> None:
    violations = verify(good, runtime=runtime)
    assert [v.kind for v in violations] == ["settings"]
    assert re.search(needle, str(violations[0])), str(violations[0])
    assert str(violations[0]).startswith("[settings] ")


def test_fewer_replicas_at_runtime_is_a_violation() -> None:
    jobs = [make_job("a", [300, 200, 500, 100], gbs=2), make_job("b", [700, 800, 120, 90], gbs=2)]
    p = plan(jobs, PlanOptions(capacity=1024, pipeline_stages=2, data_parallel=2, use_milp=False))
    assert verify(p, runtime=RuntimeSettings(data_parallel=2)) == []
    assert [v.kind for v in verify(p, runtime=RuntimeSettings(data_parallel=1))] == ["settings"]


def test_settings_violations_come_first_one_per_setting(good: Plan) -> None:
    broken = replace_mb(good, first_with(good, "a"), step_after=("nobody",))
    runtime = RuntimeSettings(capacity=512, pipeline_stages=3, data_parallel=2, padding_multiple=128)
    found = [v.kind for v in verify(broken, runtime=runtime)]
    assert found[:4] == ["settings"] * 4
    assert "step_after" in found[4:]


@pytest.mark.parametrize("fields", [{"capacity": 0}, {"pipeline_stages": "4"}, {"padding_multiple": 64.5}])
def test_runtime_settings_are_whole_numbers_of_at_least_one(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match=next(iter(fields))):
        RuntimeSettings.model_validate(fields)


def _jobs() -> list[AdapterJob]:
    return [make_job("a", [300, 200, 500, 100, 250, 50], gbs=2), make_job("b", [700, 800, 120, 90], gbs=2)]


def test_a_plan_is_checked_against_the_runtimes_jobs(good: Plan) -> None:
    """A plan edited consistently (an adapter removed, the header to match) passed: only the jobs tell."""
    assert verify(good, jobs=_jobs()) == []
    trimmed = plan([_jobs()[0]], PlanOptions(capacity=1024, pipeline_stages=2, padding_multiple=64, use_milp=False))
    assert verify(trimmed) == [], "a plan of job a alone is valid on its own"
    [violation] = verify(trimmed, jobs=_jobs())
    assert violation.kind == "jobs"
    assert (
        violation.message
        == "the plan is for adapters ['a'], the runtime's jobs are ['a', 'b']: plan the runtime's jobs"
    )


@pytest.mark.parametrize(
    ("job", "needle"),
    [
        (make_job("b", [700, 800, 120, 90], gbs=4), "global_batch_size = 2, the job's is 4"),
        (make_job("b", [700, 800, 120], gbs=2), "4 samples, the job has 3"),
        (make_job("b", [700, 801, 120, 90], gbs=2), "sample_tokens[1] = 800, the job's sample is 801 tokens long"),
    ],
)
def test_a_plan_for_other_samples_is_a_jobs_violation(good: Plan, job: AdapterJob, needle: str) -> None:
    [violation] = verify(good, jobs=[_jobs()[0], job])
    assert (violation.kind, violation.adapter) == ("jobs", "b")
    assert violation.message == f"adapter 'b': {needle}: plan the runtime's jobs"


def test_truncated_samples_match_the_jobs_lengths() -> None:
    job = make_job("a", [100, 5000, 300], gbs=3)
    p = plan([job], PlanOptions(capacity=1024, truncate=True, use_milp=False))
    assert p.adapters[0].sample_tokens == (100, 1024, 300)
    assert verify(p, jobs=[job]) == []
    tampered = p.model_copy(update={"adapters": (p.adapters[0].model_copy(update={"truncated_samples": 0}),)})
    assert [v.message for v in verify(tampered, jobs=[job])] == [
        "adapter 'a': truncated_samples = 0, but 1 of the job's samples exceed capacity 1024: plan the runtime's jobs"
    ]


def test_the_runtimes_drop_last_sets_the_global_batch_counts() -> None:
    job = make_job("a", [100, 200, 300, 400, 500, 600, 700], gbs=3)
    kept = plan([job], PlanOptions(capacity=1024, use_milp=False))
    dropped = plan([job], PlanOptions(capacity=1024, drop_last=True, use_milp=False))
    assert verify(kept, runtime=RuntimeSettings(drop_last=False)) == []
    assert verify(dropped, runtime=RuntimeSettings(drop_last=True)) == []
    [violation] = verify(kept, runtime=RuntimeSettings(drop_last=True))
    assert violation.kind == "settings"
    assert violation.message == (
        "num_global_batches = 3: 7 samples in global batches of 3 make 2 with the runtime's drop_last = true; plan "
        "again with drop_last = true"
    )


def test_segments_and_samples_out_of_the_formats_order_are_schema_violations(good: Plan) -> None:
    """The schema says a row lists its segments in the jobs' order, each segment's samples rising: unchecked before."""
    two = next(i for i, mb in enumerate(good.microbatches) if len(mb.segments) == 2)
    first, second = good.microbatches[two].segments
    [violation] = verify(replace_mb(good, two, segments=(second, first)))
    assert (violation.kind, violation.microbatch) == ("schema", two)
    assert violation.message == "segments ['b', 'a'] are not in the order of the plan's adapters"
    many = next(i for i, mb in enumerate(good.microbatches) if len(mb.segments[0].samples) > 1)
    segment = good.microbatches[many].segments[0]
    backwards = segment.model_copy(update={"samples": tuple(reversed(segment.samples))})
    [violation] = verify(replace_mb(good, many, segments=(backwards, *good.microbatches[many].segments[1:])))
    assert (violation.kind, violation.adapter) == ("schema", segment.adapter)
    assert violation.message.endswith("are not in rising order")
