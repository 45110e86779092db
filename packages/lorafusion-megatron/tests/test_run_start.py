"""What a run checks, and leaves behind, before it trains: refusals come early and leave no litter.

A ``--resume`` with a changed config was refused only after every job's data was tokenised and the
base model loaded (minutes for a large model); a refused run left a new output folder holding just
its lock file and an empty ``adapters/``; ``validate`` passed an output folder ``train`` refused;
a capacity past the model's context trained silently.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from lorafusion_megatron.cli import main
from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_lock import run_locks
from lorafusion_megatron.testing import StopAfter
from lorafusion_megatron.trainer import Trainer


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _not_now(*args: object, **kwargs: object) -> None:
    raise AssertionError("the data was read or the model built before the config was compared")


def test_a_resume_with_another_config_is_refused_before_the_data_and_the_model(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lorafusion_megatron.trainer as trainer_module

    config = parse_config(config_dict())
    assert Trainer(config, stop=StopAfter(2)).train().interrupted
    monkeypatch.setattr(trainer_module, "prepare_data", _not_now)
    monkeypatch.setattr(trainer_module._Session, "build", _not_now)
    changed = config.model_copy(update={"runtime": config.runtime.model_copy(update={"seed": 7})})
    with pytest.raises(TrainerError, match=r"a different config \(changed: runtime\.seed: 0 -> 7\)"):
        Trainer(changed).train(resume=True)
    first = config.jobs[0].model_copy(update={"r": 8})
    with pytest.raises(TrainerError, match=r"changed: jobs\[first\]\.r: 4 -> 8"):
        Trainer(config.model_copy(update={"jobs": [first, *config.jobs[1:]]})).train(resume=True)


def _failing_runs(tmp_path: Path, config_dict, jsonl_factory) -> list[tuple[str, TrainerConfig, bool]]:
    from lorafusion_megatron.data.tokenizer import byte_level_tokenizer

    bad = jsonl_factory("bad", 6)
    with bad.open("a") as file:
        file.write("{not json\n")
    tokenizer = tmp_path / "tokenizer"
    byte_level_tokenizer().save_pretrained(tokenizer)
    jobs = config_dict()["jobs"]
    jobs[0]["dataset"] = {"path": str(bad)}
    base = {"model_name_or_path": "tiny", "tokenizer_name_or_path": str(tokenizer), "dtype": "float32"}
    new = tmp_path / "new"
    return [
        (
            "bad data line",
            parse_config(config_dict(jobs=jobs, base_model=base, output_dir=str(new / "a" / "run"))),
            False,
        ),
        ("--resume without a checkpoint", parse_config(config_dict(output_dir=str(new / "b" / "run"))), True),
    ]


def test_a_refused_run_leaves_no_folder_of_its_own_making(tmp_path: Path, config_dict, jsonl_factory) -> None:
    for what, config, resume in _failing_runs(tmp_path, config_dict, jsonl_factory):
        with pytest.raises(TrainerError):
            Trainer(config).train(resume=resume)
        assert not (tmp_path / "new").exists(), f"{what}: left {sorted(map(str, (tmp_path / 'new').rglob('*')))}"


def test_a_refused_run_keeps_a_folder_that_was_there(tmp_path: Path, config_dict) -> None:
    """An existing output folder stays (with the lock file, as after any run); only what the run made goes."""
    config = parse_config(config_dict())
    Path(config.output_dir).mkdir()
    (Path(config.output_dir) / "notes.txt").write_text("mine")
    with pytest.raises(TrainerError, match="--resume: no checkpoint"):
        Trainer(config).train(resume=True)
    assert sorted(p.name for p in Path(config.output_dir).iterdir()) == [".lorafusion-run.lock", "notes.txt"]


def test_a_job_folder_in_use_names_the_jobs_key(tmp_path: Path, config_dict) -> None:
    """It said "choose another output_dir", the top-level key, where the job's own key was meant."""
    shared = tmp_path / "shared" / "adapter"
    first = parse_config(config_dict(output_dir=str(tmp_path / "a")))
    jobs = [first.jobs[0], first.jobs[1].model_copy(update={"output_dir": str(shared)})]
    first = first.model_copy(update={"jobs": jobs})
    second = parse_config(config_dict(output_dir=str(tmp_path / "b")))
    second = second.model_copy(update={"jobs": jobs})
    with run_locks(first), pytest.raises(TrainerError) as refused:
        Trainer(second).train()
    assert "job second's output folder, is in use by another run" in str(refused.value)
    assert "give job second another folder (jobs.1.output_dir)" in str(refused.value)
    assert not (tmp_path / "b").exists(), "and the refused run left no folder"


def test_a_fresh_run_into_a_finished_folder_with_checkpoints_says_both_steps(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "pass --overwrite", which was then refused for the checkpoints."""
    data = config_dict(save_steps=2)
    path = _write(tmp_path / "run.yaml", data)
    assert main(["train", str(path)]) == 0
    checkpoints = Path(data["output_dir"]) / "checkpoints"
    assert main(["train", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"delete {checkpoints}, then pass --overwrite" in err
    assert "pass --resume" in err
    shutil.rmtree(checkpoints)
    assert main(["train", str(path), "--overwrite"]) == 0, "the two steps it names are enough"


def test_validate_tries_to_write_where_train_would(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """validate judged by os.access, which says yes to root everywhere (``/proc``, a read-only mount)."""
    import os

    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc, where no file can be created")
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)  # as for root
    path = _write(tmp_path / "run.yaml", config_dict(output_dir="/proc/lorafusion-test/run"))
    assert main(["validate", str(path)]) == 2
    assert "output_dir: /proc/lorafusion-test/run cannot be created or written" in capsys.readouterr().err
    assert main(["train", str(path)]) == 2, "train refuses it too"
    assert not list(tmp_path.glob(".lorafusion-write-test-*"))


@pytest.fixture
def short_context_base(tiny_base: Path, tmp_path: Path) -> Path:
    """The saved tiny model with a context of 64 positions."""
    folder = shutil.copytree(tiny_base, tmp_path / "short-base")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_capacity_past_the_models_context_is_warned_about(
    tmp_path: Path,
    config_dict,
    short_context_base: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import lorafusion_megatron.trainer as trainer_module

    long_text = " ".join(["kiwi"] * 40)  # about 200 byte-level tokens
    data = tmp_path / "data" / "long.jsonl"
    data.parent.mkdir()
    data.write_text((json.dumps({"prompt": "say", "response": long_text}) + "\n") * 4, encoding="utf-8")
    jobs = config_dict()["jobs"]
    jobs[0]["dataset"] = {"path": str(data)}
    base = {"model_name_or_path": str(short_context_base), "dtype": "float32", "attn_implementation": "sdpa"}
    raw = config_dict(jobs=jobs, base_model=base)
    said = "scheduler.capacity (256 tokens) exceeds the base model's context (max_position_embeddings: 64)"

    assert main(["validate", str(_write(tmp_path / "run.yaml", raw))]) == 0, "a warning, not an error"
    assert said in " ".join(capsys.readouterr().err.split())

    class StoppedHereError(Exception):
        pass

    def stop(*args: object, **kwargs: object) -> None:
        raise StoppedHereError

    monkeypatch.setattr(trainer_module._Session, "build", stop)
    with caplog.at_level(logging.WARNING, logger="lorafusion_megatron"), pytest.raises(StoppedHereError):
        Trainer(parse_config(raw)).train()
    logged = " ".join(caplog.text.split())
    assert said in logged
    assert "job first: 4 sample(s) longer than 64 tokens" in logged
    caplog.clear()
    short = [{**job, "dataset": {"synthetic": "xsum", "num_samples": 4, "length_scale": 0.001}} for job in jobs]
    with caplog.at_level(logging.WARNING, logger="lorafusion_megatron"), pytest.raises(StoppedHereError):
        Trainer(parse_config({**raw, "jobs": short})).train()
    assert "max_position_embeddings" not in caplog.text, "no sample of this run is past the context"
    within = {**raw, "scheduler": {**raw["scheduler"], "capacity": 64}}
    with caplog.at_level(logging.WARNING, logger="lorafusion_megatron"), pytest.raises(StoppedHereError):
        Trainer(parse_config(within)).train()
    assert "max_position_embeddings" not in caplog.text
