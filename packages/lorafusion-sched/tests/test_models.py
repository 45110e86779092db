from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from lorafusion_sched import AdapterJob, Plan, PlanOptions, SchedError, plan


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
        ({"capacity": 0}, "capacity = 0"),
        ({"data_parallel": 0}, "data_parallel = 0"),
        ({"padding_multiple": -1}, "padding_multiple = -1"),
    ],
)
def test_bad_options_name_field_and_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        PlanOptions.model_validate({"capacity": 1024} | kwargs)


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
