"""The CLI helpers of pipeline runs (torch-free)."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError
from rich.console import Console

from lorafusion_megatron.pipeline.commands import add_parallel_arguments, parallel_from_args, summary_table
from lorafusion_megatron.pipeline.options import ParallelConfig


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    return parser.parse_args(argv)


def test_flags_override_the_configs_section() -> None:
    parallel = parallel_from_args(
        _parse("--pipeline-stages", "2", "--schedule", "mlora"), ParallelConfig(data_parallel=2)
    )
    assert parallel == ParallelConfig(pipeline_stages=2, data_parallel=2, schedule="mlora")
    assert parallel.world_size == 4
    assert parallel_from_args(_parse()) == ParallelConfig()


def test_bad_values_are_refused() -> None:
    with pytest.raises(SystemExit):
        _parse("--pipeline-stages", "0")
    with pytest.raises(ValidationError, match="pipeline_stages"):
        parallel_from_args(argparse.Namespace(pipeline_stages=0))
    with pytest.raises(SystemExit):
        _parse("--schedule", "gpipe")


def test_summary_table_shows_throughput_bubbles_and_jobs() -> None:
    summary = {
        "schedule": "lorafusion",
        "pipeline_stages": 2,
        "data_parallel": 1,
        "tokens_per_second": 12345.0,
        "wall_seconds": 3.5,
        "bubble_ratio_per_stage": [0.12, 0.08],
        "steps": [{"adapter": "first", "step": 1, "loss": 6.5}, {"adapter": "first", "step": 2, "loss": 6.25}],
    }
    console = Console(record=True, width=100)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "12,345" in text
    assert "bubble ratio, stage 1" in text
    assert "8.0%" in text
    assert "2 / 6.2500" in text
