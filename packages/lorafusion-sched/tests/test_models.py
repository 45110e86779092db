from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from lorafusion_sched import AdapterJob, Plan, PlanOptions, SchedError, plan, simulate, verify
from lorafusion_sched.io import describe_validation_error
from lorafusion_sched.models import (
    AdapterInfo,
    CostModel,
    Microbatch,
    PlanStats,
    RunStats,
    Segment,
    SimulationResult,
    Violation,
)


def test_models_are_frozen_and_refuse_unknown_fields() -> None:
    job = AdapterJob(name="a", sample_tokens=(10,), global_batch_size=1)
    with pytest.raises(ValidationError):
        job.name = "b"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        AdapterJob(name="a", sample_tokens=(10,), global_batch_size=1, rank=16)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sample_tokens": ()}, "sample_tokens is empty"),
        ({"sample_tokens": (5, 0, 7)}, r"sample_tokens\[1\] = 0"),
        ({"sample_tokens": (5, -3)}, r"sample_tokens\[1\] = -3"),
        ({"global_batch_size": 0}, "global_batch_size = 0"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_job_names_field_and_value(kwargs: dict[str, object], needle: str) -> None:
    fields: dict[str, object] = {"name": "a", "sample_tokens": (5,), "global_batch_size": 1} | kwargs
    with pytest.raises(ValidationError, match=needle):
        AdapterJob.model_validate(fields)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capacity": 1000, "padding_multiple": 64}, "capacity = 1000 is not a multiple of padding_multiple = 64"),
        ({"pipeline_stages": 0}, "pipeline_stages = 0"),
        ({"pipeline_stages": 40_000}, "pipeline_stages = 40000: at most 1024"),
        ({"capacity": 0}, "capacity = 0"),
        ({"data_parallel": 0}, "data_parallel = 0"),
        ({"padding_multiple": -1}, "padding_multiple = -1"),
        ({"capacity": 32, "padding_multiple": 64}, "use capacity = 64$"),
        ({"seed": 2**31}, "seed = 2147483648: Input should be less than or equal to 2147483647"),
        ({"node_limit": 2**31}, "node_limit = 2147483648"),
        ({"sigma_factor": float("inf")}, "sigma_factor = inf: Input should be a finite number"),
        ({"time_limit": float("nan")}, "time_limit = nan: Input should be a finite number"),
    ],
)
def test_bad_options_name_field_and_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError) as raised:
        PlanOptions.model_validate({"capacity": 1024} | kwargs)
    assert re.search(needle, describe_validation_error(raised.value)), describe_validation_error(raised.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capacity": "4096"}, r"capacity = '4096': give a whole number \(4096\), not a string"),
        ({"capacity": "4k"}, r"capacity = '4k': give a whole number, not a string"),
        ({"capacity": 4096.5}, r"capacity = 4096.5: give a whole number, not a fraction"),
        ({"capacity": True}, r"capacity = True: give a whole number, not a boolean"),
        ({"workers": "2"}, r"workers = '2': give a whole number \(2\), not a string"),
        ({"seed": [1]}, r"seed = \[1\]: give a whole number, not a list"),
    ],
)
def test_options_refuse_strings_and_fractions_for_whole_numbers(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        PlanOptions.model_validate({"capacity": 4096} | kwargs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sample_tokens": [5, "7"]}, r"sample_tokens\[1\] = '7': give a whole number \(7\), not a string"),
        ({"sample_tokens": (5.5,)}, r"sample_tokens\[0\] = 5.5: give a whole number, not a fraction"),
        ({"global_batch_size": "2"}, r"global_batch_size = '2': give a whole number \(2\), not a string"),
    ],
)
def test_jobs_refuse_strings_and_fractions_for_whole_numbers(kwargs: dict[str, object], needle: str) -> None:
    fields: dict[str, object] = {"name": "a", "sample_tokens": (5,), "global_batch_size": 1} | kwargs
    with pytest.raises(ValidationError, match=needle):
        AdapterJob.model_validate(fields)


def test_whole_numbers_take_lists_and_numpy_integers() -> None:
    job = AdapterJob(name="a", sample_tokens=np.array([5, 6], dtype=np.int32), global_batch_size=np.int64(2))  # type: ignore[arg-type]
    assert job.sample_tokens == (5, 6)
    assert all(type(t) is int for t in (*job.sample_tokens, job.global_batch_size))
    assert AdapterJob.model_validate({"name": "a", "sample_tokens": [5, 6], "global_batch_size": 1}).sample_tokens == (
        5,
        6,
    )
    assert PlanOptions(capacity=np.int64(64), workers=None).capacity == 64  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="not a fraction"):
        AdapterJob(name="a", sample_tokens=np.array([5.5]), global_batch_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="not a bool"):
        PlanOptions(capacity=np.True_)  # type: ignore[arg-type]


def test_whole_floats_are_integers_as_in_json_schema() -> None:
    """JSON Schema counts 4096.0 as an integer, so the models take it too, as an int."""
    options = PlanOptions.model_validate_json('{"capacity": 4096.0, "neighbourhood": 3.0}')
    assert (options.capacity, options.neighbourhood) == (4096, 3)
    assert type(options.capacity) is int
    job = AdapterJob(name="a", sample_tokens=[5.0, 6], global_batch_size=np.float64(2.0))  # type: ignore[arg-type, list-item]
    assert job.sample_tokens == (5, 6)
    assert all(type(t) is int for t in (*job.sample_tokens, job.global_batch_size))


@pytest.mark.parametrize(
    ("model", "fields", "needle"),
    [
        (PlanOptions, {"capacity": 64, "drop_last": "true"}, "drop_last"),
        (PlanOptions, {"capacity": 64, "use_milp": 1}, "use_milp"),
        (PlanOptions, {"capacity": 64, "time_limit": "0.5"}, "time_limit"),
        (PlanOptions, {"capacity": 64, "sigma_factor": "0.25"}, "sigma_factor"),
        (Microbatch, {"noop": "false"}, "noop"),
        (CostModel, {"stage_factors": [1.0, "1.2"]}, "stage_factors"),
    ],
)
def test_numbers_and_booleans_refuse_text(model: type[BaseModel], fields: dict[str, object], needle: str) -> None:
    """A number or boolean field takes what the JSON schema's type takes, never its text."""
    with pytest.raises(ValidationError, match=needle):
        model.model_validate(fields)
    with pytest.raises(ValidationError, match=needle):
        model.model_validate_json(json.dumps(fields))


def test_number_fields_take_integers_and_numpy_floats() -> None:
    options = PlanOptions(capacity=64, time_limit=1, sigma_factor=np.float64(0.5))  # type: ignore[arg-type]
    assert (options.time_limit, options.sigma_factor) == (1.0, 0.5)
    assert CostModel.model_validate_json('{"stage_factors": [1, 1.5]}').stage_factors == (1.0, 1.5)


def _integer_fields(model: type[BaseModel]) -> tuple[list[str], list[str], list[str]]:
    """The model's fields whose JSON schema says integer, array of integers, and number."""
    integers, arrays, numbers = [], [], []
    for name, prop in model.model_json_schema()["properties"].items():
        types = {prop.get("type")} | {option.get("type") for option in prop.get("anyOf", [])}
        if "integer" in types:
            integers.append(name)
        if "number" in types:
            numbers.append(name)
        if prop.get("type") == "array" and prop["items"].get("type") == "integer":
            arrays.append(name)
    return integers, arrays, numbers


@pytest.mark.parametrize(
    "model",
    [AdapterJob, PlanOptions, Segment, Microbatch, AdapterInfo, PlanStats, Plan, Violation, RunStats, SimulationResult],
    ids=lambda m: m.__name__,
)
def test_every_schema_integer_refuses_strings_and_fractions(model: type[BaseModel]) -> None:
    """What the JSON schema calls an integer, the model validates as one; a number still takes an int."""
    integers, arrays, numbers = _integer_fields(model)
    assert integers or arrays
    for mode in ("python", "json"):
        for bad in ("1", 1.5):
            doc: dict[str, object] = dict.fromkeys(integers, bad) | dict.fromkeys(numbers, 1)
            doc |= {name: [1, bad] for name in arrays}
            with pytest.raises(ValidationError) as info:
                model.model_validate_json(json.dumps(doc)) if mode == "json" else model.model_validate(doc)
            refused = {str(e["loc"][0]) for e in info.value.errors() if "give a whole number" in e["msg"]}
            assert refused == set(integers) | set(arrays), (mode, bad)
            assert not {str(e["loc"][0]) for e in info.value.errors()} & set(numbers), (mode, bad)


def test_plan_refuses_no_jobs_and_duplicate_names() -> None:
    options = PlanOptions(capacity=1024)
    with pytest.raises(SchedError, match="jobs is empty"):
        plan([], options)
    job = AdapterJob(name="a", sample_tokens=(5,), global_batch_size=1)
    with pytest.raises(SchedError, match=r"repeated: \['a'\]"):
        plan([job, job], options)


def test_sample_longer_than_capacity_is_an_error_or_truncated() -> None:
    job = AdapterJob(name="long", sample_tokens=(100, 5000, 6000), global_batch_size=2)
    message = r"'long': sample_tokens\[1\] = 5000 exceeds capacity = 4096 \(2 of its samples do\)"
    with pytest.raises(SchedError, match=message):
        plan([job], PlanOptions(capacity=4096))
    result = plan([job], PlanOptions(capacity=4096, truncate=True, use_milp=False))
    assert result.adapters[0].sample_tokens == (100, 4096, 4096)
    assert result.adapters[0].truncated_samples == 2


def test_drop_last_that_drops_everything_is_an_error() -> None:
    job = AdapterJob(name="tiny", sample_tokens=(5, 6), global_batch_size=4)
    with pytest.raises(SchedError, match="drop_last"):
        plan([job], PlanOptions(capacity=64, drop_last=True))


def test_plan_json_schema_has_the_contract_fields() -> None:
    schema = Plan.model_json_schema()
    assert {"schema_version", "capacity", "pipeline_stages", "padding_multiple", "adapters", "stats"} <= set(
        schema["properties"]
    )
    segment = schema["$defs"]["Segment"]["properties"]
    assert {"adapter", "global_batch", "samples", "tokens", "padded_tokens"} <= set(segment)
    assert {"segments", "noop", "step_after", "replica"} <= set(schema["$defs"]["Microbatch"]["properties"])
    json.dumps(schema)


def test_the_public_functions_refuse_dicts_and_a_lone_job_with_how_to_build_them() -> None:
    job = AdapterJob(name="a", sample_tokens=(5, 6), global_batch_size=1)
    options = PlanOptions(capacity=64)
    with pytest.raises(TypeError, match=r"jobs has type AdapterJob: pass a list of AdapterJob, e.g. plan\(\[job\]"):
        plan(job, options)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"jobs\[0\] has type dict, not AdapterJob: .*AdapterJob.model_validate"):
        plan([job.model_dump()], options)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"options has type dict, not PlanOptions"):
        plan([job], {"capacity": 64})  # type: ignore[arg-type]
    document = json.loads(plan([job], options).model_dump_json())
    with pytest.raises(TypeError, match=r"plan has type dict, not Plan: .*Plan.model_validate"):
        verify(document)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"plan has type dict, not Plan"):
        simulate(document)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cost_model has type dict, not CostModel"):
        simulate(plan([job], options), {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"forward_fixed_s": 0.0, "forward_per_token_s": 0.0}, "a forward that takes no time"),
        ({"forward_per_token_s": math.inf}, "forward_per_token_s"),
        ({"backward_factor": math.nan}, "backward_factor"),
        ({"stage_factors": (1.0, math.inf)}, "stage_factors"),
    ],
)
def test_a_cost_model_refuses_costs_that_leave_nothing_to_simulate(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        CostModel.model_validate(fields)


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.5, 1.5])
def test_plan_stats_refuse_ratios_that_no_plan_has(value: float) -> None:
    """A hand-edited NaN slipped past verify: ``abs(stated - want) > tol`` is False for NaN."""
    p = plan([AdapterJob(name="a", sample_tokens=(5, 6), global_batch_size=1)], PlanOptions(capacity=64))
    document = p.model_dump()
    document["stats"]["fill_ratio"] = value
    with pytest.raises(ValidationError, match="fill_ratio"):
        Plan.model_validate(document)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("   ", r"name = '   ': give a name with at least one character that is not whitespace"),
        ("a ", r"name = 'a ': remove the whitespace at its start or end \('a'\)"),
        ("\tchat", r"remove the whitespace at its start or end \('chat'\)"),
        ("a\nb", r"name = 'a\\nb': remove the control character '\\n' \(U\+000A\); a name is shown on one line"),
        ("x\x00", r"remove the control character '\\x00' \(U\+0000\)"),
        ("a\u2028b", r"remove the control character '\\u2028' \(U\+2028\)"),
        ("\u200b", r"name = '\\u200b': give a name with a visible character"),
        ("e\u0301", r"name = 'e\\u0301': write it in Unicode's composed form \(NFC\), '\\xe9'; it prints as"),
    ],
)
def test_adapter_names_print_as_themselves_on_one_line(name: str, needle: str) -> None:
    """A newline broke the CLI's tables, and 'a ' passed for 'a'."""
    with pytest.raises(ValidationError, match=needle):
        AdapterJob(name=name, sample_tokens=(5,), global_batch_size=1)
    with pytest.raises(ValidationError, match=needle):
        AdapterInfo(name=name, global_batch_size=1, num_samples=1, num_global_batches=1, sample_tokens=(5,))


@pytest.mark.parametrize("name", ["a", "chat v2", "x[/b]", "ünïcode-名前", "a+b"])
def test_ordinary_adapter_names_are_kept(name: str) -> None:
    assert AdapterJob(name=name, sample_tokens=(5,), global_batch_size=1).name == name


def test_a_cost_model_interpolates_its_measured_points_and_scales_them_by_stage() -> None:
    cost = CostModel(forward_points=((1024, 0.2), (2048, 0.25), (4096, 0.3)), stage_factors=(1.0, 2.0))
    assert cost.forward_seconds(0, 0) == 0.0, "a no-op"
    assert cost.forward_seconds(64, 0) == 0.2, "below the first point: its time"
    assert cost.forward_seconds(3072, 0) == pytest.approx(0.275)
    assert cost.forward_seconds(3072, 1) == pytest.approx(0.55)
    assert cost.forward_seconds(8192, 0) == pytest.approx(0.6), "past the last: in proportion to the tokens"
    assert CostModel(forward_fixed_s=0.0, forward_per_token_s=0.0, forward_points=((64, 1.0),)).forward_seconds(64, 0)
    assert CostModel.model_validate_json('{"forward_points": [[1024, 1], [2048.0, 2.5]]}').forward_points == (
        (1024, 1.0),
        (2048, 2.5),
    )


@pytest.mark.parametrize(
    ("points", "needle"),
    [
        ([], "no points: give at least one"),
        ([(2048, 0.1), (1024, 0.2)], "1024 tokens follows 2048: list the points by rising tokens"),
        ([(1024, 0.1), (1024, 0.2)], "1024 tokens follows 1024"),
        ([(0, 0.1)], "at least 1 token"),
        ([(64, 0.2), (128, 0.0)], "greater than 0"),
        ([(64, -0.1)], "greater than 0"),
        ([(64, math.inf)], "finite"),
        ([(64.5, 0.1)], "give a whole number, not a fraction"),
        ([("64", 0.1)], "not a string"),
    ],
)
def test_a_cost_model_refuses_points_it_cannot_interpolate(points: list[tuple[object, object]], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        CostModel(forward_points=points)  # type: ignore[arg-type]
