"""What a kill, or a hand edit, leaves in a run's checkpoints: rotation cut short, a ``trainer_state.json`` that no
run writes. Each is tidied at the next start or refused with a clear message, never resumed or a traceback."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafusion_megatron.checkpoint import latest_checkpoint, prune_checkpoints
from lorafusion_megatron.cli import main
from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.state import InvalidStateError, JobProgress, RunState
from lorafusion_megatron.testing import StopAfter
from lorafusion_megatron.trainer import Trainer


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs (no ``except Exception``, no clean-up but ``finally``)."""


@pytest.fixture
def make_config(config_dict, tmp_path: Path) -> Callable[..., TrainerConfig]:
    """Two jobs of 3 steps each on the tiny preset, a checkpoint after every step, the newest 2 kept."""

    def make(**top: Any) -> TrainerConfig:
        data = config_dict(output_dir=str(tmp_path / "run"), save_steps=1, save_total_limit=2, **top)
        data["scheduler"]["milp_time_limit"] = None
        return parse_config(data)

    return make


def _names(folder: Path) -> list[str]:
    return sorted(child.name for child in folder.iterdir())


def _kill_while_deleting_a_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next deletion of a checkpoint folder deletes its weights and ``trainer_state.json``, then is killed."""
    real = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        folder = Path(path)
        if folder.parent.name == "checkpoints" and ".tmp-" not in folder.name:
            for name in ("lora.safetensors", "trainer_state.json"):
                (folder / name).unlink()
            monkeypatch.setattr(shutil, "rmtree", real)
            raise _Killed
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_none_half_there(
    make_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint-2 was deleted in place: a kill left it holding some files, which no later run deleted or
    counted against save_total_limit (or, with trainer_state.json still there, took for complete)."""
    config = make_config()
    _kill_while_deleting_a_checkpoint(monkeypatch)
    with pytest.raises(_Killed):
        Trainer(config).train()
    assert _names(config.checkpoint_dir) == [".checkpoint-2.deleting", "checkpoint-3", "checkpoint-4"]
    result = Trainer(config).train(resume=True)
    assert result.state.total_optimizer_steps == 6
    assert _names(config.checkpoint_dir) == ["checkpoint-3", "checkpoint-4"]


def test_pruning_deletes_leftovers_and_counts_only_complete_checkpoints(tmp_path: Path) -> None:
    """A husk (no trainer_state.json) was neither deleted nor counted; a hidden leftover is deleted too."""
    for name in ("checkpoint-2", "checkpoint-3", "checkpoint-4", ".checkpoint-5.deleting"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-1" / "adapters").mkdir(parents=True)
    prune_checkpoints(tmp_path, 2)
    assert _names(tmp_path) == ["checkpoint-3", "checkpoint-4"]


def test_leftovers_of_earlier_deletions_are_removed_at_the_start(make_config) -> None:
    """An earlier version's husk (no trainer_state.json) older than the newest checkpoint goes, and so does a
    hidden folder of a deletion cut short, even one that looks complete; a newer folder without
    trainer_state.json is no pruning's leftover and stays (its file may have been moved away by hand)."""
    config = make_config()
    assert Trainer(config, stop=StopAfter(3)).train().interrupted
    directory = config.checkpoint_dir
    newest = latest_checkpoint(directory)
    assert newest is not None
    assert newest.name == "checkpoint-3"
    (directory / "checkpoint-1" / "adapters").mkdir(parents=True)  # as the audit found checkpoint-14
    shutil.copytree(newest, directory / ".checkpoint-9.deleting")
    (directory / "checkpoint-7" / "adapters").mkdir(parents=True)
    assert latest_checkpoint(directory) == newest
    Trainer(config).train(resume=True)
    assert _names(directory) == ["checkpoint-3", "checkpoint-4", "checkpoint-7"]


@pytest.fixture
def stopped_run(make_config, monkeypatch: pytest.MonkeyPatch) -> tuple[TrainerConfig, Path]:
    """A run stopped after its 4th microbatch (checkpoint-4, with checkpoint-3 before it); reading data fails."""
    import lorafusion_megatron.trainer as trainer_module

    config = make_config()
    assert Trainer(config, stop=StopAfter(4)).train().interrupted
    newest = latest_checkpoint(config.checkpoint_dir)
    assert newest is not None
    assert newest.name == "checkpoint-4"

    def refused_before(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the damaged checkpoint was found only after the data was read")

    monkeypatch.setattr(trainer_module, "prepare_data", refused_before)
    return config, newest


_Edit = Callable[[dict[str, Any]], Any]


def _state(**changes: Any) -> _Edit:
    """An edit of ``trainer_state.json`` that sets entries of its ``state``."""
    return lambda meta: {**meta, "state": {**meta["state"], **changes}}


def _first_job(**changes: Any) -> _Edit:
    """An edit of ``trainer_state.json`` that sets counters of job ``first``."""

    def edit(meta: dict[str, Any]) -> dict[str, Any]:
        first, *others = meta["state"]["jobs"]
        return _state(jobs=[{**first, **changes}, *others])(meta)

    return edit


_EDITS: dict[str, tuple[_Edit, str]] = {
    "position-past-the-end": (
        _state(position=99999),
        r"state\.position: 99999 is past the plan's last microbatch, \d+",
    ),
    "more-steps-than-the-job-has": (
        _first_job(steps_done=5000),
        r"state\.jobs\[first\]\.steps_done: 5000 is more than the job's total_steps, 3",
    ),
    "steps-the-plan-did-not-take": (
        _first_job(steps_done=0),
        r"state\.jobs\[first\]\.steps_done: 0, where the plan's microbatches before position 4 take 2",
    ),
    "a-job-missing": (
        lambda meta: _state(jobs=meta["state"]["jobs"][:1])(meta),
        r"state\.jobs: the counters of jobs \['first'\], where the plan trains \['first', 'second'\]",
    ),
    "other-total": (
        _first_job(total_steps=30),
        r"state\.jobs\[first\]\.total_steps: 30, where the plan gives the job 3",
    ),
    "total-of-all-jobs": (
        _state(total_optimizer_steps=2),
        r"state\.total_optimizer_steps: 2, where the jobs' steps add up to 4",
    ),
    "text-for-a-number": (_state(seconds="soon"), r"state\.seconds: 'soon' is not a number"),
    "no-state": (lambda meta: {**meta, "state": None}, r"state: a NoneType, not an object"),
    "a-list": (lambda meta: [meta], r"a list at the top level, not an object"),
    "no-fingerprint": (lambda meta: {"a": 1}, r"'fingerprint' is missing"),
}


@pytest.mark.parametrize("edit", list(_EDITS))
def test_a_hand_edited_trainer_state_is_refused_as_damaged(stopped_run, edit: str) -> None:
    """It was resumed as written: past the plan's end the checkpoint's weights became the finished adapters
    (status 0), other counters failed with KeyError or AttributeError (status 3), no fingerprint with
    "a different config"."""
    config, newest = stopped_run
    change, problem = _EDITS[edit]
    path = newest / "trainer_state.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    damaged = rf"checkpoint {newest} is damaged: trainer_state\.json holds what no run writes \({problem}\)"
    with pytest.raises(TrainerError, match=rf"{damaged}; delete that folder, and --resume continues from checkpoint-3"):
        Trainer(config).train(resume=True)
    assert not (Path(config.output_dir) / "summary.json").exists()


def test_the_cli_exits_2_on_a_hand_edited_trainer_state(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_dict(save_steps=2)))
    assert main(["train", str(path)]) == 0
    (tmp_path / "run" / "summary.json").unlink()  # as if killed as it ended
    state = tmp_path / "run" / "checkpoints" / "checkpoint-4" / "trainer_state.json"
    meta = json.loads(state.read_text())
    meta["state"]["position"] = 99999
    state.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["train", str(path), "--resume"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "checkpoint-4 is damaged: trainer_state.json holds what no run writes (state.position: 99999" in said
    assert "--resume continues from checkpoint-2" in said
    assert "Traceback" not in said


def _job(**changes: Any) -> dict[str, Any]:
    return {**vars(JobProgress(name="a", total_steps=3, steps_done=1, pending_targets={2: 5})), **changes}


def test_run_state_reads_back_what_it_writes() -> None:
    """Through JSON (string keys) and through torch.save, which keeps the pending batches' int keys."""
    state = RunState(position=4, jobs={"a": JobProgress(**_job(pending_loss={2: 1.5}))}, total_optimizer_steps=1)
    assert RunState.from_json(json.loads(json.dumps(state.to_json()))) == state
    assert RunState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"position": -1}, r"state\.position: -1 is not a whole number of at least 0"),
        ({"position": True}, r"state\.position: True is not a whole number"),
        ({"seconds": float("inf")}, r"state\.seconds: inf is not a duration in seconds"),
        ({"jobs": {}}, r"state\.jobs: a dict, not a list"),
        ({"jobs": [_job(), _job()]}, r"state\.jobs: job 'a' appears twice"),
        ({"jobs": [_job(epoch=2)]}, r"state\.jobs\[0\]: unknown key 'epoch'"),
        ({"jobs": [_job(name="")]}, r"state\.jobs\[0\]\.name: '' is not a job name"),
        ({"jobs": [_job(tokens=1.5)]}, r"state\.jobs\[a\]\.tokens: 1\.5 is not a whole number"),
        ({"jobs": [_job(last_loss="low")]}, r"state\.jobs\[a\]\.last_loss: 'low' is not a number"),
        ({"jobs": [_job(pending_targets={"x": 1})]}, r"pending_targets: key 'x' is not a global batch index"),
    ],
)
def test_run_state_names_what_no_run_writes(entry: dict[str, Any], problem: str) -> None:
    data = {**RunState(position=0, jobs={"a": JobProgress(**_job())}).to_json(), **entry}
    with pytest.raises(InvalidStateError, match=problem):
        RunState.from_json(data)


@pytest.mark.parametrize(
    ("summary", "pipeline", "needle"),
    [
        ("pipeline_summary.json", False, "holds a pipeline run (pipeline_summary.json): resume it with the parallel"),
        ("summary.json", True, "holds a single-process run (summary.json): resume it without pipeline parallelism"),
        ("summary.json", False, "train without --resume to start afresh"),
        (None, True, "train without --resume to start afresh"),
    ],
)
def test_a_resume_without_a_checkpoint_names_the_runtime_that_ran_there(
    tmp_path: Path, summary: str | None, pipeline: bool, needle: str
) -> None:
    """A finished pipeline run resumed without --pipeline-stages was told to train afresh (then --overwrite)."""
    from lorafusion_megatron.checkpoint import checkpoint_to_resume

    (tmp_path / "checkpoints").mkdir()
    if summary is not None:
        (tmp_path / summary).write_text("{}")
    with pytest.raises(TrainerError, match=rf"--resume: no checkpoint in .*; .*{re.escape(needle)}"):
        checkpoint_to_resume(tmp_path / "checkpoints", resume=True, pipeline=pipeline)
