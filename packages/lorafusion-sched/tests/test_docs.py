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
