"""The pipeline benchmark's scripts: configs, launch order, deadline, report; and one real run on CPU (slow).

The scripts live in ``benchmarks/`` (not a package); the fast tests import them from there, the
slow one runs ``bench_pipeline.py`` as the device script does, on the tiny preset over gloo.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
SCHEDULES = ("lorafusion", "megatron-1f1b", "mlora")


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModuleType]:
    """The benchmark scripts as modules (they import each other by name, as when run from their folder)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_pipeline
    import pipeline_results
    import profile_stage
    import report_pipeline

    return {"bench": bench_pipeline, "results": pipeline_results, "report": report_pipeline, "stage": profile_stage}


def _args(scripts: dict[str, ModuleType], *argv: str) -> Any:
    return scripts["bench"]._parser().parse_args(list(argv))


def test_every_schedule_of_a_cell_trains_the_same_jobs(scripts: dict[str, ModuleType]) -> None:
    from lorafusion_megatron.config import parse_config

    bench = scripts["bench"]
    args = _args(scripts, "--preset", "llama-3.1-70b", "--stages", "4", "--checkpointing")
    configs = {s: parse_config(bench.run_config(args, bench.Cell(3, s), samples=32, steps=2)) for s in SCHEDULES}
    assert {s: c.parallel.schedule for s, c in configs.items()} == {s: s for s in SCHEDULES}
    assert [job.name for job in configs["lorafusion"].jobs] == ["xsum", "cnndm", "wikisum"]
    assert all(job.global_batch_size == 16 and job.max_steps == 2 for job in configs["mlora"].jobs)
    # The paper's baselines run the unfused LoRA layers; only that and the schedule differ.
    assert [c.runtime.fused_kernels for c in configs.values()] == [True, False, False]
    assert len({c.model_dump_json(exclude={"parallel", "runtime"}) for c in configs.values()}) == 1
    assert configs["mlora"].runtime.activation_checkpointing is True
    balanced = _args(scripts, "--preset", "llama-3.1-70b", "--stages", "4", "--checkpointing", "balanced")
    assert (
        parse_config(
            bench.run_config(balanced, bench.Cell(4, "lorafusion"), samples=32, steps=2)
        ).runtime.activation_checkpointing
        == "balanced"
    )
    assert max(bench.partition_factors("llama-3.1-70b", 4, "balanced")) < max(
        bench.partition_factors("llama-3.1-70b", 4, "all")
    )


def test_the_yaml_config_starts_with_its_command(scripts: dict[str, ModuleType], tmp_path: Path) -> None:
    from lorafusion_megatron.config import load_config

    bench = scripts["bench"]
    mapping = bench.run_config(_args(scripts), bench.Cell(2, "mlora"), samples=8, steps=2)
    bench.write_config(tmp_path / "config.yaml", mapping)
    assert (tmp_path / "config.yaml").read_text().startswith("# python -m lorafusion_megatron.cli train config.yaml\n")
    assert load_config(tmp_path / "config.yaml").parallel.schedule == "mlora"


def test_cells_run_the_first_count_first_with_the_schedules_rotated(scripts: dict[str, ModuleType]) -> None:
    bench = scripts["bench"]
    args = _args(scripts)
    names = [[cell.name for cell in bench.cells_in_order(args, repeat)] for repeat in (0, 1)]
    tail = ["lorafusion-3a", "lorafusion-2a", "lorafusion-1a"]
    assert names[0] == ["lorafusion-4a", "megatron-1f1b-4a", "mlora-4a", *tail]
    assert names[1] == ["megatron-1f1b-4a", "mlora-4a", "lorafusion-4a", *tail]
    both = _args(scripts, "--adapters", "2", "1", "--baseline-adapters", "2", "1")
    assert [c.name for c in bench.cells_in_order(both, 0)] == [
        "lorafusion-2a",
        "megatron-1f1b-2a",
        "mlora-2a",
        "lorafusion-1a",
        "megatron-1f1b-1a",
        "mlora-1a",
    ]


def _run(schedule: str, adapters: int, rate: float, **extra: Any) -> dict[str, Any]:
    return {
        "status": "ok",
        "warmup": False,
        "schedule": schedule,
        "adapters": adapters,
        "fused_kernels": schedule == "lorafusion",
        "tokens": 1000,
        "tokens_per_second": rate,
        "bubble_ratio": 0.2,
        "bubble_ratio_per_stage": [0.1, 0.3],
        "launch_overhead_seconds": 30.0,
        **extra,
    }


def test_a_launch_is_predicted_from_the_launches_before_it(scripts: dict[str, ModuleType]) -> None:
    predict = scripts["bench"].predict_seconds
    warmup = _run("lorafusion", 4, 1.0, warmup=True, launch_overhead_seconds=40.0)
    assert predict([warmup], "lorafusion", 1000) is None
    runs = [warmup, _run("lorafusion", 4, 100.0), _run("mlora", 4, 50.0)]
    assert predict(runs, "lorafusion", 1000) == pytest.approx(40 + 10)
    # A schedule not run yet is assumed to run at half the slowest rate seen.
    assert predict(runs, "megatron-1f1b", 1000) == pytest.approx(40 + 40)


def test_cells_take_medians_and_leave_out_warm_ups_and_failures(scripts: dict[str, ModuleType]) -> None:
    runs = [
        _run("lorafusion", 2, 300.0, warmup=True),
        _run("lorafusion", 2, 100.0),
        _run("lorafusion", 2, 120.0, bubble_ratio_per_stage=[0.2, 0.4]),
        _run("mlora", 2, 80.0),
        {"status": "failed", "warmup": False, "schedule": "mlora", "adapters": 2},
    ]
    cells = scripts["results"].summarise_cells(runs)
    assert [(c["schedule"], c["repeats"]) for c in cells] == [("lorafusion", 2), ("mlora", 1)]
    assert cells[0]["tokens_per_second"] == pytest.approx(110.0)
    assert cells[0]["bubble_ratio_per_stage"] == pytest.approx([0.15, 0.35])
    assert cells[1]["speedup"] == pytest.approx(110.0 / 80.0)


def _document(settings: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    header = {
        "device": {"kind": "cuda", "name": "NVIDIA H200", "count": 2},
        "versions": {"torch": "2.11.0"},
        "date": "2026-11-23T10:00:00Z",
    }
    return {
        "settings": settings,
        "provenance": header,
        "runs": runs,
        "simulated": {"4": {"mlora": {"bubble_ratio": 0.3}}},
    }


def _settings() -> dict[str, Any]:
    return {
        "preset": "qwen2.5-32b",
        "pipeline_stages": 2,
        "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.1},
        "steps_per_adapter": 2,
        "global_batch_size": 16,
        "capacity": 4096,
        "dtype": "bfloat16",
        "activation_checkpointing": True,
        "baseline_kernels": "plain",
    }


def _two_calls(folder: Path) -> list[str]:
    """Two results files of the same settings, as two device calls would write them."""
    first, second = folder / "a.json", folder / "b.json"
    first.write_text(json.dumps(_document(_settings(), [_run("lorafusion", 4, 200.0), _run("mlora", 4, 150.0)])))
    second.write_text(json.dumps(_document(_settings(), [_run("lorafusion", 4, 220.0), _run("lorafusion", 1, 90.0)])))
    return [str(first), str(second)]


def test_the_report_merges_calls_into_one_table(scripts: dict[str, ModuleType], tmp_path: Path) -> None:
    other = tmp_path / "c.json"
    other.write_text(json.dumps(_document({**_settings(), "capacity": 2048}, [])))
    report = scripts["report"]
    files = _two_calls(tmp_path)
    report.main([*files, "--markdown", str(tmp_path / "table.md")])
    table = (tmp_path / "table.md").read_text()
    assert "**qwen2.5-32b, 2 pipeline stages** on 2x NVIDIA H200" in table
    assert "| 4 | `lorafusion` | 2 | 210 | 200 to 220 | 1.00x | 20.0% | 10.0%, 30.0% |  |" in table
    assert "| 4 | `mlora` | 1 | 150 | 150 to 150 | 1.40x | 20.0% | 10.0%, 30.0% | 30.0% |" in table
    with pytest.raises(SystemExit, match="capacity"):
        report.main([files[0], str(other)])


@pytest.mark.together
def test_the_report_draws_a_png(scripts: dict[str, ModuleType], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    scripts["report"].main([*_two_calls(tmp_path), "--plot", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_launch_counts_compilations_and_gc_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pipeline_cells

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    compiles = pipeline_cells.CompileCounter()
    assert knobs.runtime.jit_cache_hook is not None
    # What Triton's JIT does around a compilation (the hook's keyword arguments).
    assert compiles._before(key="k", repr="_kernel[num_warps=4](x: ())") is False
    compiles._after(key=(("*bf16", "D"), ("i32", "")), repr="_kernel[num_warps=4](x: ())")
    taken = compiles.take()
    assert taken["count"] == 1
    assert taken["seconds"] >= 0
    assert taken["kernels"] == [{"name": "_kernel", "key": "(('*bf16', 'D'), ('i32', ''))"}]
    assert compiles.take() == {"count": 0, "seconds": 0.0, "kernels": []}

    pauses = pipeline_cells.GcPauses()
    try:
        pauses.take()
        gc.collect()
        taken = pauses.take()
    finally:
        gc.callbacks.remove(pauses._callback)
    assert taken["full_count"] == 1
    assert taken["count"] >= 1
    assert 0 <= taken["longest_seconds"] <= taken["seconds"] + 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("one_launch", [False, True], ids=["a-launch-per-cell", "one-launch"])
def test_bench_pipeline_runs_every_schedule_on_two_cpu_stages(tmp_path: Path, one_launch: bool) -> None:
    """Six cells on two gloo processes: six launches (about 40 s apiece on two loaded cores), or one."""
    out = tmp_path / "pipeline.json"
    args = ["--preset", "tiny", "--stages", "2", "--dtype", "float32", "--capacity", "256"]
    args += ["--length-scale", "0.03", "--global-batch-size", "2", "--steps", "2", "--repeats", "1"]
    args += ["--adapters", "2", "1", "--baseline-adapters", "2", "1", "--warmup-samples", "0", "--out", str(out)]
    args += ["--one-launch"] if one_launch else []
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_pipeline.py"), *args], check=True, cwd=tmp_path)
    document = json.loads(out.read_text())
    assert document["method"]["one_launch"] is one_launch
    overheads = [run["launch_overhead_seconds"] for run in document["runs"]]
    assert all((overhead is None) is one_launch for overhead in overheads)
    assert document["provenance"]["versions"]["torch"]
    assert [run["status"] for run in document["runs"]] == ["ok"] * 6
    assert all(len(run["replayed_bubble_ratio_per_stage"]) == 2 for run in document["runs"])
    assert all((run["kernel_compiles_per_stage"] is None) is not one_launch for run in document["runs"])
    assert all((run["gc_pauses_per_stage"] is None) is not one_launch for run in document["runs"])
    assert len(list((tmp_path / "pipeline-traces").glob("*.json"))) == 6
    cells = {(c["adapters"], c["schedule"]): c for c in document["cells"]}
    assert set(cells) == {(n, s) for n in (1, 2) for s in SCHEDULES}
    for n in (1, 2):
        # Every schedule of one adapter count trained the same samples.
        assert len({cells[(n, s)]["tokens"] for s in SCHEDULES}) == 1
        assert set(document["simulated"][str(n)]) == set(SCHEDULES)
        assert 0.0 <= document["simulated"][str(n)]["lorafusion"]["bubble_ratio_with_partition"] < 1.0
    assert all(len(c["bubble_ratio_per_stage"]) == 2 and c["tokens_per_second"] > 0 for c in cells.values())
    assert str(tmp_path) not in out.read_text()
    report = [sys.executable, str(BENCHMARKS / "report_pipeline.py"), str(out), "--markdown", str(tmp_path / "t.md")]
    if importlib.util.find_spec("matplotlib") is not None:
        report += ["--plot", str(tmp_path / "plot.png")]
    subprocess.run(report, check=True, cwd=tmp_path, capture_output=True)
    assert (tmp_path / "t.md").read_text().count("| `mlora` |") == 2


def test_profile_stage_measures_each_recompute_setting_on_one_stage(
    scripts: dict[str, ModuleType], tmp_path: Path
) -> None:
    out = tmp_path / "stage.json"
    argv = ["--preset", "tiny", "--stages", "2", "--stage", "1", "--recompute", "all", "balanced", "0"]
    argv += ["--tokens", "64", "--sample-length", "32", "--device", "cpu", "--out", str(out)]
    assert scripts["stage"].main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    # The tiny preset's LM head outweighs its layer: the last stage of 2 recomputes nothing when balanced.
    assert [(r["setting"], r["recomputed_layers"], r["tokens"]) for r in rows] == [
        ("all", 1, 64),
        ("balanced", 0, 64),
        ("0", 0, 64),
    ]
