"""The trainer on a CUDA GPU: the fused kernels' Triton path and bf16 (run on the device)."""

from __future__ import annotations

import math

import pytest
import torch

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.packing import pack_microbatch
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.testing import lora_grads, plan_microbatch, random_job, tiny_peft_model
from lorafusion_megatron.trainer import Trainer

pytestmark = pytest.mark.gpu


def _cuda_grads(*, fused: bool, requested_attn: str) -> dict[str, torch.Tensor]:
    import lorafusion_kernels
    from lorafusion_megatron.model import resolve_attn_implementation

    device = torch.device("cuda")
    data = {
        "first": random_job("first", [90, 50, 120], 3, seed=0),
        "second": random_job("second", [70, 110], 2, seed=1),
    }
    denominators = {(name, 0): job.global_batch_targets(0) for name, job in data.items()}
    mb = plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    model, _ = tiny_peft_model(attn_implementation=requested_attn)
    model.to(device=device, dtype=torch.bfloat16)
    if fused:
        lorafusion_kernels.patch_peft_model(model)
    attn = resolve_attn_implementation(requested_attn, device)
    runner = MicrobatchRunner(model, ["first", "second"], attn_implementation=attn, dtype=torch.bfloat16, fused=fused)
    runner.forward_backward(pack_microbatch(mb, data).to(device), denominators)
    return lora_grads(model)


@pytest.mark.parametrize(("fused", "attn"), [(True, "sdpa"), (False, "varlen"), (True, "varlen")])
def test_fused_kernels_and_varlen_attention_match_plain_peft_on_cuda(fused: bool, attn: str) -> None:
    reference = _cuda_grads(fused=False, requested_attn="sdpa")
    grads = _cuda_grads(fused=fused, requested_attn=attn)
    for name, grad in reference.items():
        scale = float(grad.float().abs().max())
        torch.testing.assert_close(grads[name].float(), grad.float(), rtol=0.05, atol=0.05 * scale, msg=name)


def test_bf16_training_run_on_cuda(tmp_path, config_dict) -> None:
    data = config_dict(
        base_model={"model_name_or_path": "tiny", "dtype": "bfloat16"},
        runtime={"device": "cuda", "seed": 0},
        output_dir=str(tmp_path / "run"),
    )
    result = Trainer(parse_config(data)).train()
    for job in result.state.jobs.values():
        assert job.finished
        assert job.last_loss is not None
        assert math.isfinite(job.last_loss)
    assert all((path / "adapter_model.safetensors").is_file() for path in result.adapters.values())
