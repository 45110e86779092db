"""With ``lora_dropout > 0``, a 2-stage pipeline over gloo ends with the single-process trainer's adapters.

The trainer runs the plan made for 2 stages (with its no-ops): the plan decides which samples share
a microbatch, and so where each sample's dropout masks fall; the pipeline must change nothing else.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.testing import assert_same_adapters, saved_adapters, two_job_config
from lorafusion_megatron.trainer import Trainer


def _config(tiny_base: Path, output: Path, *, fused: bool) -> TrainerConfig:
    return parse_config(two_job_config(tiny_base, output, lora_dropout=0.1, max_grad_norm=0.05, fused_kernels=fused))


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
    got, want = saved_adapters(tmp_path / "pipeline" / "adapters"), saved_adapters(tmp_path / "trainer" / "adapters")
    assert_same_adapters(got, want, rtol=1e-4, atol=2e-5)
