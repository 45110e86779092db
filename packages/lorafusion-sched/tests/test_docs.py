"""The documented example runs, and the committed JSON schema is current."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lorafusion_sched import Plan

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[1]


def test_readme_python_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (PACKAGE / "README.md").read_text()
    code = re.search(r"## Python\n\n```python\n(.*?)```", text, re.S)
    assert code is not None
    assert len(code.group(1).strip().splitlines()) <= 11
    exec(compile(code.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_committed_plan_schema_is_current() -> None:
    path = REPO / "docs" / "sched" / "plan.schema.json"
    if not path.is_file():
        pytest.skip("docs/ not present (installed package)")
    assert json.loads(path.read_text()) == Plan.model_json_schema(), "regenerate docs/sched/plan.schema.json"


def test_schema_page_names_every_field() -> None:
    from lorafusion_sched.models import AdapterInfo, Microbatch, PlanStats, Segment

    path = REPO / "docs" / "sched" / "schema.md"
    if not path.is_file():
        pytest.skip("docs/ not present (installed package)")
    named = {word for quoted in re.findall(r"`([^`]+)`", path.read_text()) for word in re.split(r"[^a-z_]+", quoted)}
    for model in (Plan, AdapterInfo, PlanStats, Microbatch, Segment):
        missing = set(model.model_fields) - named
        assert not missing, f"docs/sched/schema.md does not name {model.__name__}'s {sorted(missing)}"


def _index() -> str:
    path = REPO / "docs" / "sched" / "index.md"
    if not path.is_file():
        pytest.skip("docs/ not present (installed package)")
    return path.read_text()


def _block(text: str, heading: str) -> str:
    code = re.search(rf"{re.escape(heading)}\n.*?```python\n(.*?)```", text, re.S)
    assert code is not None, f"no python block under {heading!r}"
    return code.group(1)


def test_walk_the_plan_snippet_runs_and_covers_every_sample_once(capsys: pytest.CaptureFixture[str]) -> None:
    text = _index()
    namespace: dict[str, object] = {}
    exec(compile(_block(text, "## In ten lines of Python"), "index.md", "exec"), namespace)
    capsys.readouterr()
    exec(compile(_block(text, "### Walk the plan"), "index.md", "exec"), namespace)
    out = capsys.readouterr().out
    jobs = namespace["jobs"]
    assert isinstance(jobs, list)
    for job in jobs:
        for s in range(len(job.sample_tokens)):
            assert out.count(f"'{job.name} #{s}'") == 1, (job.name, s)
    assert out.count("\n") == len(namespace["p"].microbatches)  # type: ignore[attr-defined]


def test_python_api_section_names_every_job_field_and_violation_kind() -> None:
    from typing import get_args

    from lorafusion_sched import AdapterJob, Violation

    section = _index().split("## Python API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert set(AdapterJob.model_fields) <= named
    assert set(Violation.model_fields) <= named
    kinds = set(get_args(Violation.model_fields["kind"].annotation))
    assert not kinds - named, f"docs/sched/index.md, Python API: no row for {sorted(kinds - named)}"


def test_the_docs_say_what_the_model_takes_for_a_sample() -> None:
    """They said two tokens or more while a one-token sample is accepted (labels are the trainer's concern)."""
    from lorafusion_sched import AdapterJob, PlanOptions, plan, verify

    text = " ".join(_index().split())
    assert "The scheduler takes samples of one token or more" in text
    assert "two tokens" not in text
    p = plan([AdapterJob(name="a", sample_tokens=(1, 1), global_batch_size=2)], PlanOptions(capacity=64))
    assert verify(p) == []


def test_the_no_op_warning_names_a_section_of_the_docs() -> None:
    from lorafusion_sched import AdapterJob, PlanOptions, SchedWarning, plan
    from lorafusion_sched.advice import noop_advice

    with pytest.warns(SchedWarning, match="the plan's only adapter"):
        p = plan(
            [AdapterJob(name="a", sample_tokens=(5,) * 20, global_batch_size=1)],
            PlanOptions(capacity=64, pipeline_stages=4),
        )
    advice = noop_advice(p)
    assert advice is not None
    section = re.search(r"docs: '(.+)'", advice)
    assert section is not None
    assert f"\n### {section.group(1)}\n" in _index()
