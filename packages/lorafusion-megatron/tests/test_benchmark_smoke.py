"""The trainer benchmark script runs end to end (tiny preset, CPU); its numbers are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_trainer.py"


@pytest.mark.slow
def test_bench_trainer_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--capacity", "512", "--length-scale", "0.05"]
    args += ["--samples", "16", "--global-batch-size", "4", "--microbatches", "4", "--trainer", "--out", str(out)]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, cwd=tmp_path, capture_output=True)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"frozen", "peft-sequential", "peft-mixed", "lorafusion", "trainer"}
    assert all(r["tokens_per_s"] > 0 for r in results.values())
