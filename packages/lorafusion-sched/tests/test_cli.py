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
    assert main(["verify", str(out_plan), "--jobs", str(tmp_path / "jobs.json")]) == 0
    assert f"is for the jobs of {tmp_path / 'jobs.json'}" in " ".join(capsys.readouterr().out.split())
    jobs["adapters"][1]["sample_tokens"][0] = 65
    (tmp_path / "other.json").write_text(json.dumps(jobs))
    assert main(["verify", str(out_plan), "--jobs", str(tmp_path / "other.json")]) == 1
    assert (
        "violation [jobs] adapter 'b': sample_tokens[0] = 64, the job's sample is 65 tokens long"
        in capsys.readouterr().out
    )
    assert main(["simulate", str(out_plan), "--stage-factors", "1,1,1,1.3"]) == 0
    assert "bubble ratio" in capsys.readouterr().out
    assert main(["simulate", str(out_plan), "--forward-points", "1024:0.17,4096:0.27,8192:0.52"]) == 0
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
        (["demo", "--stage-factors", "1,x"], "--stage-factors = '1,x'"),
        (["demo", "--forward-points", "1024=0.1"], "give comma-separated TOKENS:SECONDS pairs"),
        (["demo", "--forward-points", "4096:0.2,1024:0.1"], "1024 tokens follows 4096: list the points by rising"),
        (["demo", "--forward-points", "1024:0.1", "--forward-fixed", "3"], "give them, or --forward-fixed and"),
        (["demo", "--samples", "64", "--no-milp", "--forward-fixed", "1e308"], "seconds per microbatch are out of"),
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


def test_a_plan_file_that_is_not_utf8_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1 means "the plan has violations": an unreadable file must not look like one."""
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{\x00")
    assert main(["verify", str(tmp_path / "bad.json")]) == 2
    assert "not UTF-8 text" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flag", ["--samples", "--stages", "--capacity", "--workers"])
def test_demo_refuses_a_count_below_one_by_its_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: 0 is less than 1" in capsys.readouterr().err


def test_demo_refuses_a_negative_seed_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "argument --seed: -1 is less than 0" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "message"), [("0", "0 is not above 0"), ("soon", "'soon' is not a number")])
def test_time_limit_is_refused_by_its_flag(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--time-limit", value])
    assert exit_info.value.code == 2
    assert f"argument --time-limit: {message}" in capsys.readouterr().err


def test_no_time_limit_plans_the_same_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = [tmp_path / "a.json", tmp_path / "b.json"]
    for output in outputs:
        args = ["demo", "--samples", "128", "--global-batch-size", "16", "--workers", "1", "--no-time-limit"]
        assert main([*args, "-o", str(output)]) == 0
    first, second = (json.loads(path.read_text()) for path in outputs)
    for stats in (first["stats"], second["stats"]):
        del stats["solve_seconds"]
    assert first == second
    assert first["stats"]["milp_runs"] > 0


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
    assert "(the only sample that does): raise the capacity, or set the option truncate = true" in err
    assert "(demo: --truncate)" in err
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


def test_adapter_names_are_printed_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rich read ``x[/b]`` in the plan table as a closing tag and crashed after the plan was written."""
    adapters = [{"name": name, "sample_tokens": [5, 6], "global_batch_size": 1} for name in ("x[/b]", "chat[v2]")]
    (tmp_path / "jobs.json").write_text(json.dumps({"adapters": adapters, "options": {"capacity": 64}}))
    assert main(["plan", str(tmp_path / "jobs.json"), "-o", str(tmp_path / "p.json"), "--no-milp"]) == 0
    assert "x[/b]+chat[v2]" in capsys.readouterr().out


def test_simulate_refuses_a_forward_that_takes_no_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = {"adapters": [{"name": "a", "sample_tokens": [5, 6], "global_batch_size": 1}], "options": {"capacity": 64}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    assert main(["plan", str(tmp_path / "jobs.json"), "-o", str(tmp_path / "p.json"), "-q"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(tmp_path / "p.json"), "--forward-fixed", "0", "--forward-per-token", "0"]) == 2
    assert "a forward that takes no time" in capsys.readouterr().err


def test_simulate_with_bad_stage_factors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = {"adapters": [{"name": "a", "sample_tokens": [5, 6], "global_batch_size": 1}], "options": {"capacity": 64}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    assert main(["plan", str(tmp_path / "jobs.json"), "-o", str(tmp_path / "p.json"), "-q"]) == 0
    assert main(["simulate", str(tmp_path / "p.json"), "--stage-factors", "1,x"]) == 2
    assert "--stage-factors" in capsys.readouterr().err


def test_a_missing_matplotlib_is_found_before_planning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "plan.json"
    assert main(["demo", "--samples", "64", "-o", str(out), "--png", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert "drawing a PNG needs matplotlib" in captured.err
    assert not out.exists()


def test_verify_prints_one_line_per_violation_when_piped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "p.json"
    assert main(["demo", "--samples", "64", "--adapters", "1", "--no-milp", "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["microbatches"] = [mb for mb in data["microbatches"] if not mb["noop"]]
    plan_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["verify", str(plan_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("violation [") for line in lines[:-1]), lines
    assert any(len(line) > 80 for line in lines), "a long violation stays on one line"


def test_verify_checks_the_runtime_settings_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "p.json"
    args = ["demo", "--samples", "64", "--adapters", "2", "--stages", "4", "--capacity", "4096", "--padding", "64"]
    assert main([*args, "--no-milp", "-o", str(plan_path)]) == 0
    capsys.readouterr()
    fitting = ["--capacity", "8192", "--stages", "4", "--data-parallel", "1", "--padding", "32"]
    assert main(["verify", str(plan_path), *fitting]) == 0
    assert "fits the runtime's capacity 8192, pipeline_stages 4, data_parallel 1, padding_multiple 32" in " ".join(
        capsys.readouterr().out.split()
    )
    assert main(["verify", str(plan_path), "--capacity", "2048", "--stages", "8"]) == 1
    out = capsys.readouterr().out
    assert "violation [settings] capacity = 4096:" in out
    assert "violation [settings] pipeline_stages = 4:" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", str(plan_path), "--data-parallel", "0"])
    assert exit_info.value.code == 2
    assert "argument --data-parallel: 0 is less than 1" in capsys.readouterr().err


def _lone_tail_jobs(tmp_path: Path) -> Path:
    """'big' outlives 'small' by 18 global batches of one microbatch each: 3 no-ops after each."""
    adapters = [
        {"name": "big", "sample_tokens": [300] * 40, "global_batch_size": 2},
        {"name": "small", "sample_tokens": [300] * 4, "global_batch_size": 2},
    ]
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"adapters": adapters, "options": {"capacity": 1024, "pipeline_stages": 4}}))
    return path


def test_simulate_lists_the_violations_of_an_invalid_plan_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan whose no-ops were dropped simulated faster than the valid one, exit 0, without a word."""
    plan_path = tmp_path / "p.json"
    assert main(["plan", str(_lone_tail_jobs(tmp_path)), "-q", "--no-milp", "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["microbatches"] = [mb for mb in data["microbatches"] if not mb["noop"]]
    plan_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["simulate", str(plan_path)]) == 1
    out = capsys.readouterr().out
    assert "violation [bubble_lemma]" in out
    assert "violation(s) in" in out
    assert "not simulated" in out
    assert "bubble ratio" not in out, "no simulation table"


def test_verify_shows_every_kind_and_counts_them_past_50(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A reversed plan has over 50 violations of several kinds; the first 50 used to be all of the first kind."""
    from collections import Counter

    from lorafusion_sched.io import load_plan
    from lorafusion_sched.verify import verify

    plan_path = tmp_path / "p.json"
    args = ["demo", "--samples", "256", "--adapters", "2", "--global-batch-size", "8", "--no-milp"]
    assert main([*args, "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["stats"]["num_microbatches"] += 1
    data["microbatches"] = data["microbatches"][::-1]
    plan_path.write_text(json.dumps(data))
    counts = Counter(v.kind for v in verify(load_plan(plan_path)))
    assert sum(counts.values()) > 50, counts
    assert len(counts) >= 3, counts
    capsys.readouterr()
    assert main(["verify", str(plan_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    shown = Counter(line.split("[")[1].split("]")[0] for line in lines if line.startswith("violation ["))
    assert set(shown) == set(counts), "each kind gets lines"
    assert sum(shown.values()) <= 50
    assert f"by kind: {', '.join(f'{kind} {n}' for kind, n in counts.most_common())}" in lines
    assert lines[-1].startswith(f"{sum(counts.values())} violation(s) in")


def test_plan_warns_of_a_lone_adapter_tail_under_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(_lone_tail_jobs(tmp_path)), "--no-milp", "-o", str(tmp_path / "p.json")]) == 0
    captured = capsys.readouterr()
    assert "no-ops (71%)" in captured.out
    err = " ".join(captured.err.split())
    assert "warning: 55 of 77 microbatches (71%) are no-ops" in err
    assert "'big' runs alone" in err
    assert "What helps: give the planner a cost model (options cost_model" in err
    assert "; give 'big' a larger global_batch_size" in err


def test_plan_with_a_cost_model_in_the_jobs_file_splits_the_lone_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = json.loads(_lone_tail_jobs(tmp_path).read_text())
    jobs["options"]["cost_model"] = {"forward_fixed_s": 0.001, "forward_per_token_s": 1e-5}
    path = tmp_path / "with-cost.json"
    path.write_text(json.dumps(jobs))
    assert main(["plan", str(path), "--no-milp", "-o", str(tmp_path / "p.json")]) == 0
    captured = capsys.readouterr()
    assert "lone global batches split" in captured.out
    assert "give the planner a cost model" not in captured.err, "it has one"
    from lorafusion_sched.io import load_plan

    assert load_plan(tmp_path / "p.json").stats.split_batches > 0
