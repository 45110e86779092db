"""The profiler's default capacities follow the device: a GPU's 1k-32k tokens, a small range on the CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.profiler.run import CPU_CANDIDATES, DEFAULT_CANDIDATES, default_candidates, profile_rank


def test_default_candidates_per_device_are_multiples_of_the_padding() -> None:
    assert default_candidates("cuda", 64) == DEFAULT_CANDIDATES
    assert default_candidates("cpu", 64) == CPU_CANDIDATES == (128, 256, 512, 1024)
    assert default_candidates("cpu", 384) == (384, 768, 1152)


def test_profiling_on_the_cpu_without_capacities_measures_the_small_range(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": "tiny", "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": [{"name": "only", "dataset": {"synthetic": "xsum", "num_samples": 16, "length_scale": 0.05}}],
            "scheduler": {"capacity": "auto", "padding_multiple": 64},
            "runtime": {"device": "cpu"},
        }
    )
    with caplog.at_level(logging.WARNING):
        report = profile_rank(
            config,
            ParallelConfig(),
            sample_length=128,
            repeats=1,
            backend="gloo",
            init_method=(tmp_path / "store").as_uri(),
            rank=0,
            world_size=1,
        )
    assert report is not None
    assert [m["tokens"] for m in report["measurements"]] == list(CPU_CANDIDATES)
    assert report["chosen_capacity"] in CPU_CANDIDATES
    assert "pass --capacities" in caplog.text
