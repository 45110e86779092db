"""``profile`` on one CPU rank: measurements, the fitted model and the choice land in readable files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.profiler.run import profile_rank, profiled_capacity, with_profiled_capacity


def _config(tmp_path: Path) -> TrainerConfig:
    return parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": "tiny", "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": [
                {"name": name, "dataset": {"synthetic": data, "num_samples": 16, "length_scale": 0.05}, "r": 4}
                for name, data in (("first", "xsum"), ("second", "cnndm"))
            ],
            "scheduler": {"capacity": "auto", "padding_multiple": 16},
            "runtime": {"device": "cpu"},
        }
    )


def test_profile_writes_the_report_and_the_chosen_capacity(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert profiled_capacity(config.output_dir) is None
    assert with_profiled_capacity(config) is config
    report = profile_rank(
        config,
        ParallelConfig(),
        candidates=(64, 128, 256),
        sample_length=32,
        repeats=1,
        backend="gloo",
        init_method=(tmp_path / "store").as_uri(),
        rank=0,
        world_size=1,
    )
    assert report is not None
    assert [m["tokens"] for m in report["measurements"]] == [64, 128, 256]
    assert all(m["forward_s"] > 0 and m["backward_s"] > 0 for m in report["measurements"])
    assert report["chosen_capacity"] in (64, 128, 256)
    assert profiled_capacity(config.output_dir) == report["chosen_capacity"]
    assert with_profiled_capacity(config).scheduler.capacity == report["chosen_capacity"]
    saved = json.loads((Path(config.output_dir) / "profile.json").read_text())
    assert saved["cost_model"]["forward_per_token_s"] >= 0
    table = (Path(config.output_dir) / "profile.md").read_text()
    assert "(chosen)" in table


@pytest.mark.slow
def test_profile_on_two_stages_fits_one_factor_per_stage(tmp_path: Path) -> None:
    """Two processes over gloo (slow on two cores: about 15 s)."""
    from lorafusion_megatron.pipeline.launch import launch_profile

    config = _config(tmp_path)
    parallel = ParallelConfig(pipeline_stages=2)
    report = launch_profile(config, parallel, backend="gloo", candidates=(64, 128), sample_length=32, repeats=1)
    assert report is not None
    assert sorted({m["stage"] for m in report["measurements"]}) == [0, 1]
    assert len(report["cost_model"]["stage_factors"]) == 2
