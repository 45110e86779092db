"""``benchmarks/bench_peft_model.py`` runs end to end (tiny model, CPU: the script, not the timings)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = pytest.mark.together

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_peft_model.py"


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])
def test_the_whole_model_benchmark_runs_every_mode(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_peft_model", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    result = module.measure(
        module.build_parser().parse_args(
            ["--preset", preset, "--device", "cpu", "--seq", "32", "--steps", "1", "--rounds", "1"]
        )
    )
    assert set(result["modes"]) == {"frozen", "peft", "lorafusion"}
    assert all(row["median_ms"] > 0 for row in result["modes"].values())
    assert set(result["ratios"]) == {"peft_over_lorafusion", "peft_over_frozen", "lorafusion_over_frozen"}
