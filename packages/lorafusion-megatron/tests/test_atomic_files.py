from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically


def test_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text("old", encoding="utf-8")
    write_json_atomically(path, {"b": 1, "a": [2]})
    assert json.loads(path.read_text(encoding="utf-8")) == {"a": [2], "b": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old", encoding="utf-8")
    with pytest.raises(TypeError):
        write_json_atomically(path, {"not json": object()})
    with pytest.raises(UnicodeEncodeError):
        write_text_atomically(path, "\ud800")
    assert path.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
