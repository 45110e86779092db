from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.errors import TrainerError


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


def test_threads_writing_one_path_each_use_their_own_temporary(tmp_path: Path) -> None:
    import threading

    path = tmp_path / "failure.json"
    failures: list[BaseException] = []

    def write_often(value: int) -> None:
        try:
            for _ in range(100):
                write_json_atomically(path, {"value": value})
        except BaseException as err:  # collected for the assertion below
            failures.append(err)

    threads = [threading.Thread(target=write_often, args=(v,)) for v in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert json.loads(path.read_text(encoding="utf-8"))["value"] in range(4)
    assert [p.name for p in tmp_path.iterdir()] == ["failure.json"]


def test_a_folder_in_the_way_is_the_launchers_clear_error(tmp_path: Path) -> None:
    """Regression: the scheduler's ``SchedError`` escaped the CLI as a traceback with exit status 1,
    which the CLI keeps for "interrupted, checkpoint written"."""
    (tmp_path / "summary.json").mkdir()
    with pytest.raises(TrainerError, match="it is a folder"):
        write_json_atomically(tmp_path / "summary.json", {})


def test_a_full_disk_is_the_launchers_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``OSError`` while writing (ENOSPC here) names the file and leaves its previous content."""
    path = tmp_path / "summary.json"
    path.write_text("old", encoding="utf-8")

    def full(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(TrainerError, match=r"cannot write .*summary\.json: No space left on device"):
        write_json_atomically(path, {})
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
