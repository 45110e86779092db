"""The trainer benchmark script runs end to end (tiny preset, CPU); its numbers are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_trainer.py"
MODES = {"frozen", "peft-sequential", "peft-mixed", "lorafusion", "lorafusion-siblings"}


@pytest.mark.slow
def test_bench_trainer_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--capacity", "512", "--length-scale", "0.05"]
    args += [
        "--samples",
        "8",
        "--global-batch-size",
        "4",
        "--repeats",
        "2",
        "--trainer",
        "2",
        "--trainer-profile",
        "--out",
        str(out),
    ]
    args += ["--baseline-capacity", "256"]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, cwd=tmp_path, capture_output=True)
    report = json.loads(out.read_text())
    assert (report["plan"]["capacity"], report["plan"]["baseline_capacity"]) == (512, 256)
    results = report["results"]
    assert set(results) == MODES | {"trainer"}
    assert all(r["tokens_per_s"] > 0 for r in results.values())
    # Every mode times the same samples, so the same tokens; the trainer runs them too.
    assert len({r["tokens"] for r in results.values()}) == 1
    assert len({results[mode]["samples"] for mode in MODES}) == 1
    for mode in MODES:
        r = results[mode]
        assert len(r["seconds_per_repeat"]) == 2
        assert r["tokens_per_s_min"] <= r["tokens_per_s_median"] == r["tokens_per_s"] <= r["tokens_per_s_max"]
    assert results["trainer"]["distinct_token_counts"] >= 1
    assert len(results["trainer"]["tokens_per_s_per_run"]) == 2
    profiled = results["trainer"]["profiled"]
    assert profiled["gpu"]["wall_ms"] > 0
    assert profiled["gpu"]["busy_ms"] == 0  # no GPU: no GPU events
