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
