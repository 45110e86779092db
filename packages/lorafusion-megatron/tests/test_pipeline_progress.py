"""Progress of a pipeline run: per-job TensorBoard scalars and the final summary table, from one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.pipeline import commands
from lorafusion_megatron.pipeline.options import ParallelConfig


@pytest.mark.together
def test_two_stages_write_tensorboard_scalars_per_job_and_print_the_summary(tiny_base: Path, tmp_path: Path) -> None:
    """Two processes over gloo; the last stage (it has the losses) reports."""
    pytest.importorskip("tensorboard")
    jobs = [
        {
            "name": name,
            "dataset": {"synthetic": dataset, "num_samples": samples, "length_scale": 0.03},
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ["q_proj", "v_proj"],
            "global_batch_size": batch,
        }
        for name, dataset, samples, batch in (("first", "xsum", 8, 4), ("second", "wikisum", 6, 3))
    ]
    config = parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": str(tiny_base), "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": jobs,
            "scheduler": {"capacity": 256, "padding_multiple": 16},
            "runtime": {"device": "cpu", "seed": 0},
            "logging": {"progress_bar": True, "tensorboard_dir": str(tmp_path / "tb"), "logging_steps": 1},
        }
    )
    console = Console(record=True, width=160)
    assert commands.train(config, ParallelConfig(pipeline_stages=2), console) == 0

    for name in ("first", "second"):
        events = list((tmp_path / "tb" / name).glob("events.out.tfevents.*"))
        assert len(events) == 1, events
        content = events[0].read_bytes()
        for tag in (b"train/loss", b"train/learning_rate", b"train/grad_norm", b"train/tokens_per_second"):
            assert tag in content, (name, tag)
    text = console.export_text()
    assert "LoRAFusion training summary" in text
    assert "bubble ratio, stage 1" in text
    summary = json.loads((Path(config.output_dir) / "pipeline_summary.json").read_text())
    plan = json.loads((Path(config.output_dir) / "plan.json").read_text())
    state = {job["name"]: job for job in summary["run_state"]["jobs"]}
    assert summary["run_state"]["position"] == len(plan["microbatches"])
    for adapter in plan["adapters"]:
        job = state[adapter["name"]]
        assert job["steps_done"] == job["total_steps"] == 2
        assert job["tokens"] == sum(adapter["sample_tokens"])
        assert job["first_loss"] > 0
        assert job["last_loss"] > 0
        assert f"{job['steps_done']}/{job['total_steps']}" in text
