from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafusion_sched.cli import main


def test_demo_prints_tables_and_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo", "--samples", "256", "--global-batch-size", "16", "--workers", "1", "--time-limit", "0.02"]) == 0
    )
    out = capsys.readouterr().out
    for needle in ("SYNTHETIC", "lower bound", "verify: no violations", "megatron", "mlora", "bubbles:"):
        assert needle in out


def test_plan_verify_simulate_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = {
        "adapters": [
            {"name": "a", "sample_tokens": [512, 1033, 700, 90, 3000, 410], "global_batch_size": 2},
            {"name": "b", "sample_tokens": [64, 128, 2048, 999], "global_batch_size": 2},
        ],
        "options": {"capacity": 4096, "pipeline_stages": 4, "padding_multiple": 64},
    }
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    out_plan = tmp_path / "plan.json"
    assert main(["plan", str(tmp_path / "jobs.json"), "-o", str(out_plan), "--workers", "1"]) == 0
    assert "MILP wins" in capsys.readouterr().out
    assert main(["verify", str(out_plan)]) == 0
    assert "verifies clean" in capsys.readouterr().out
    assert main(["simulate", str(out_plan), "--stage-factors", "1,1,1,1.3"]) == 0
    assert "bubble ratio" in capsys.readouterr().out

    doc = json.loads(out_plan.read_text())
    doc["microbatches"] = [mb for mb in doc["microbatches"] if not mb["noop"]][1:]
    out_plan.write_text(json.dumps(doc))
    assert main(["verify", str(out_plan)]) == 1
    assert "violation" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["verify", "nope.json"], "plan file 'nope.json' does not exist"),
        (["plan", "nope.yaml", "-o", "x.json"], "jobs file 'nope.yaml' does not exist"),
        (["demo", "--capacity", "1000"], "capacity = 1000 is not a multiple of padding_multiple = 64"),
        (["demo", "--workload", "het", "--samples", "2", "--adapters", "4"], "--samples 2 < --adapters 4"),
        (["demo", "--time-limit", "-1"], "time_limit = -1.0: Input should be greater than 0"),
        (["demo", "--stage-factors", "1,x"], "--stage-factors = '1,x'"),
        (["demo", "--png", "timeline.txt"], "name the file *.png"),
        (["demo", "-o", "no-such-folder/plan.json"], "the folder 'no-such-folder' does not exist"),
        (["simulate", "nope.json", "--png", "no-such-folder/t.png"], "the folder 'no-such-folder' does not exist"),
    ],
)
def test_errors_exit_2_with_a_message(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "error:" in err
    assert "error:" not in captured.out, "errors go to standard error"
    assert needle in err


@pytest.mark.parametrize("flag", ["--samples", "--stages", "--capacity", "--workers"])
def test_demo_refuses_a_count_below_one_by_its_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: 0 is less than 1" in capsys.readouterr().err


def test_output_paths_are_checked_before_planning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "jobs.yaml").write_text("adapters: [{name: a, sample_tokens: [5000], global_batch_size: 1}]\n")
    (tmp_path / "plan.json").mkdir()
    assert main(["plan", str(tmp_path / "jobs.yaml"), "-o", str(tmp_path / "plan.json")]) == 2
    assert "it is a folder; name a file" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", str(tmp_path / "jobs.yaml"), "-o", str(tmp_path / "p.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "jobs.yaml: options.capacity: missing" in err, "the jobs file's problem, named with its path"
    (tmp_path / "jobs.yaml").write_text(
        "adapters: [{name: a, sample_tokens: [5000], global_batch_size: 1}]\noptions: {capacity: 4096}\n"
    )
    assert main(["plan", str(tmp_path / "jobs.yaml"), "-o", str(tmp_path / "p.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "jobs.yaml: adapter 'a': sample_tokens[0] = 5000 exceeds capacity = 4096" in err
    assert "set the option truncate = true" in err
    assert not (tmp_path / "p.json").exists()


def test_messages_keep_their_square_brackets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rich markup would eat ``[tokens]`` in a violation and ``[plot]`` in an install hint."""
    jobs = {"adapters": [{"name": "a", "sample_tokens": [5, 6], "global_batch_size": 1}], "options": {"capacity": 64}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    assert main(["plan", str(tmp_path / "jobs.json"), "-o", str(tmp_path / "p.json"), "-q"]) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["capacity"] = 4
    (tmp_path / "p.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "p.json")]) == 1
    assert "violation [capacity]" in " ".join(capsys.readouterr().out.split())


def test_simulate_with_bad_stage_factors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = {"adapters": [{"name": "a", "sample_tokens": [5, 6], "global_batch_size": 1}], "options": {"capacity": 64}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    assert main(["plan", str(tmp_path / "jobs.json"), "-o", str(tmp_path / "p.json"), "-q"]) == 0
    assert main(["simulate", str(tmp_path / "p.json"), "--stage-factors", "1,x"]) == 2
    assert "--stage-factors" in capsys.readouterr().err
