"""With ``lora_dropout > 0``, a 2-stage pipeline over gloo ends with the single-process trainer's adapters.

The trainer runs the plan made for 2 stages (with its no-ops): the plan decides which samples share
a microbatch, and so where each sample's dropout masks fall; the pipeline must change nothing else.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.trainer import Trainer


def _config(tiny_base: Path, output: Path, *, fused: bool) -> TrainerConfig:
    jobs: list[dict[str, Any]] = [
        {
            "name": name,
            "dataset": {"synthetic": dataset, "num_samples": samples, "length_scale": 0.03},
            "r": 4,
            "lora_alpha": 8,
            "lora_dropout": 0.1,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "learning_rate": 1e-2,
            "global_batch_size": batch,
            "max_grad_norm": 0.05,
        }
        for name, dataset, samples, batch in (("first", "xsum", 10, 3), ("second", "wikisum", 7, 2))
    ]
    return parse_config(
        {
            "output_dir": str(output),
            "base_model": {"model_name_or_path": str(tiny_base), "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": jobs,
            "scheduler": {"capacity": 256, "padding_multiple": 16},
            "runtime": {"device": "cpu", "seed": 0, "fused_kernels": fused},
            "logging": {"progress_bar": False},
        }
    )


def _adapters(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {job.name: load_file(job / "adapter_model.safetensors") for job in sorted(folder.iterdir())}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain-peft"])
def test_two_stages_with_dropout_end_with_the_single_process_adapters(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """Two processes over gloo against the trainer, on the fused ops' CPU path and on plain PEFT."""
    from lorafusion_megatron import planning, trainer
    from lorafusion_megatron.pipeline.launch import launch

    reference = _config(tiny_base, tmp_path / "trainer", fused=fused)
    monkeypatch.setattr(trainer, "make_plan", functools.partial(planning.make_plan, pipeline_stages=2))
    Trainer(reference).train()
    config = _config(tiny_base, tmp_path / "pipeline", fused=fused)
    summary = launch(config, ParallelConfig(pipeline_stages=2), backend="gloo")
    assert summary is not None
    assert summary["pipeline_stages"] == 2
    plans = [json.loads((tmp_path / run / "plan.json").read_text()) for run in ("trainer", "pipeline")]
    assert plans[0]["microbatches"] == plans[1]["microbatches"]
    got, want = _adapters(tmp_path / "pipeline" / "adapters"), _adapters(tmp_path / "trainer" / "adapters")
    assert got.keys() == want.keys()
    for job, tensors in want.items():
        assert got[job].keys() == tensors.keys()
        for key, tensor in tensors.items():
            torch.testing.assert_close(got[job][key], tensor, rtol=1e-4, atol=2e-5, msg=f"{job}: {key}")
