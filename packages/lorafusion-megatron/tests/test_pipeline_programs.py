"""The programs the pipeline executes: the plan itself and the two baselines (torch-free)."""

from __future__ import annotations

import pytest

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.programs import Program, build_program, split_for_checkpoints
from lorafusion_sched import AdapterJob, Plan, PlanOptions, plan, verify


def _plan(stages: int, replicas: int) -> Plan:
    jobs = [
        AdapterJob(name="first", sample_tokens=(90, 40, 70, 30, 55, 65, 20), global_batch_size=3),
        AdapterJob(name="second", sample_tokens=(120, 35, 80, 45, 60), global_batch_size=2),
    ]
    options = PlanOptions(capacity=192, pipeline_stages=stages, padding_multiple=16, data_parallel=replicas)
    return plan(jobs, options)


def _samples_seen(program: Program) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {"first": [], "second": []}
    for run in program.runs:
        for mb in run:
            for seg in mb.segments:
                seen[seg.adapter].extend(seg.samples)
    return seen


def _as_plan(program: Program, source: Plan) -> Plan:
    microbatches = tuple(mb for run in program.runs for mb in run)
    return source.model_copy(update={"microbatches": microbatches})


@pytest.mark.parametrize(("stages", "replicas"), [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_mlora_is_a_valid_continuous_plan_apart_from_capacity(stages: int, replicas: int) -> None:
    source = _plan(stages, replicas)
    program = build_program(source, "mlora", samples_per_microbatch=2)
    assert len(program.runs) == 1
    assert all(len(mb.segments) <= 1 for mb in program.runs[0])
    violations = [v for v in verify(_as_plan(program, source)) if v.kind not in ("capacity", "stats")]
    assert violations == []
    seen = _samples_seen(program)
    assert sorted(seen["first"]) == list(range(7))
    assert sorted(seen["second"]) == list(range(5))


@pytest.mark.parametrize(("stages", "replicas"), [(2, 1), (2, 2)])
def test_megatron_runs_one_global_batch_of_one_adapter_and_steps_at_its_end(stages: int, replicas: int) -> None:
    source = _plan(stages, replicas)
    program = build_program(source, "megatron-1f1b", samples_per_microbatch=1)
    assert len(program.runs) == 3 + 3  # ceil(7 / 3) + ceil(5 / 2) global batches
    for run in program.runs:
        adapters = {seg.adapter for mb in run for seg in mb.segments}
        batches = {seg.global_batch for mb in run for seg in mb.segments}
        assert len(adapters) == 1
        assert len(batches) == 1
        assert len(run) % replicas == 0
        last_round = len(run) // replicas - 1
        for i, mb in enumerate(run):
            assert mb.step_after == (tuple(adapters) if i // replicas == last_round else ())
            assert mb.replica == (i % replicas if replicas > 1 else None)
    assert [run[0].segments[0].adapter for run in program.runs] == ["first"] * 3 + ["second"] * 3
    seen = _samples_seen(program)
    assert seen["first"] == list(range(7))
    assert seen["second"] == list(range(5))


def test_lorafusion_is_the_plan_and_replicas_take_turns() -> None:
    source = _plan(2, 2)
    program = build_program(source, "lorafusion")
    assert program.runs == (source.microbatches,)
    assert program.num_microbatches == len(source.microbatches)


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(TrainerError, match="schedule"):
        build_program(_plan(1, 1), "gpipe")  # type: ignore[arg-type]


@pytest.mark.parametrize(("replicas", "save_steps"), [(1, 1), (1, 3), (2, 2)])
def test_checkpoint_cuts_fall_between_rounds_after_every_save_steps_steps(replicas: int, save_steps: int) -> None:
    source = _plan(2, replicas)
    program = build_program(source, "lorafusion")
    cut = split_for_checkpoints(program, save_steps)
    flat = [mb for run in cut.runs for mb in run]
    assert flat == list(source.microbatches)
    assert all(len(run) % replicas == 0 for run in cut.runs)
    steps = 0
    for run in cut.runs[:-1]:
        before = steps
        steps += sum(len(mb.step_after) for mb in run[::replicas])
        assert steps // save_steps > before // save_steps
        # The cut is right after the round that crossed the multiple.
        assert (steps - len(run[-replicas].step_after)) // save_steps == before // save_steps
    total = sum(len(mb.step_after) for mb in source.microbatches[::replicas])
    assert len(cut.runs) - 1 <= total // save_steps
