"""The trainer on a CUDA GPU: the fused kernels' Triton path and bf16 (run on the device)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from lorafusion_megatron.config import DatasetConfig, JobConfig, parse_config
from lorafusion_megatron.dropout_seeds import drawing_for
from lorafusion_megatron.optim import AdapterOptimizer
from lorafusion_megatron.packing import pack_microbatch
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.testing import lora_grads, plan_microbatch, random_job, tiny_peft_model
from lorafusion_megatron.trainer import Trainer

pytestmark = pytest.mark.gpu


def _two_jobs() -> tuple[dict, dict]:
    data = {
        "first": random_job("first", [90, 50, 120], 3, seed=0),
        "second": random_job("second", [70, 110], 2, seed=1),
    }
    denominators = {(name, 0): job.global_batch_targets(0) for name, job in data.items()}
    return data, denominators


def _cuda_grads(*, fused: bool, requested_attn: str, recomputed_layers: int = 0) -> dict[str, torch.Tensor]:
    import lorafusion_kernels
    from lorafusion_megatron.model import resolve_attn_implementation

    device = torch.device("cuda")
    data, denominators = _two_jobs()
    mb = plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    model, _ = tiny_peft_model(attn_implementation=requested_attn, recomputed_layers=recomputed_layers)
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


def test_fused_kernels_recompute_in_autograds_device_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recomputation of a checkpointed layer runs in autograd's thread for the GPU, which does
    not see the forward's adapter routing unless the checkpoint re-enters it.

    Compared bit for bit, so the kernels sum without atomics (whose order varies from run to run:
    with the default backward this comparison failed once in five runs on 2x H100, 2026-11-27).
    """
    monkeypatch.setenv("LORAFUSION_DETERMINISTIC", "1")
    reference = _cuda_grads(fused=True, requested_attn="sdpa")
    for recomputed in (1, 2):
        grads = _cuda_grads(fused=True, requested_attn="sdpa", recomputed_layers=recomputed)
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


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


def test_queueing_a_microbatch_and_a_step_never_waits_for_the_gpu() -> None:
    """Packing, the host-to-GPU copies, forward + backward and the optimizer step only queue work.

    The GPU is kept busy by a long sleep kernel queued first: if anything on the way synchronises
    (a pageable copy, a read-back), the host cannot return before the sleep has ended.
    """
    import lorafusion_kernels
    from lorafusion_megatron.model import lora_parameters, resolve_attn_implementation

    device = torch.device("cuda")
    data, denominators = _two_jobs()
    mb = plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    model, _ = tiny_peft_model(attn_implementation="varlen", dropout=0.1)
    model.to(device=device, dtype=torch.bfloat16)
    lorafusion_kernels.patch_peft_model(model)
    attn = resolve_attn_implementation("varlen", device)
    runner = MicrobatchRunner(model, ["first", "second"], attn_implementation=attn, dtype=torch.bfloat16, fused=True)
    job = JobConfig(name="first", dataset=DatasetConfig(synthetic="xsum"), max_grad_norm=1.0)
    optimizer = AdapterOptimizer(job, lora_parameters(model, "first"), total_steps=4)

    def queue_microbatch_and_step() -> None:
        with drawing_for(mb):
            runner.forward_backward(pack_microbatch(mb, data).to(device), denominators)
        optimizer.step()

    queue_microbatch_and_step()  # compiles the kernels, fills the allocator's cache
    torch.cuda.synchronize()
    cycles_per_second = torch.cuda.get_device_properties(device).clock_rate * 1000
    torch.cuda._sleep(int(2 * cycles_per_second))
    slept = torch.cuda.Event()
    slept.record()
    queue_microbatch_and_step()
    assert not slept.query(), "the host waited for the GPU while queueing a microbatch or an optimizer step"
    torch.cuda.synchronize()


def test_a_resume_with_the_jobs_reordered_and_layers_recomputed_is_bit_identical_on_cuda(
    tmp_path, config_dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume accepts reordered jobs: the fused kernels number adapters in config order (their
    tables stack the adapters, of different ranks, in that order); no token's arithmetic may depend on it.
    It accepts activation checkpointing turned on too: a recomputed layer repeats its forward with
    the same dropout draws.

    Dropout on, adapters of two ranks; deterministic kernels, so that bits can be compared.
    """
    from lorafusion_megatron.testing import StopAfter

    monkeypatch.setenv("LORAFUSION_DETERMINISTIC", "1")
    jobs = config_dict()["jobs"]
    jobs[1]["r"] = 2
    for job in jobs:
        job["lora_dropout"] = 0.1

    def config(name: str, ordered: list[dict], *, recompute: bool = False):
        data = config_dict(
            jobs=ordered,
            base_model={"model_name_or_path": "tiny", "dtype": "bfloat16"},
            runtime={"device": "cuda", "seed": 0, "activation_checkpointing": recompute},
            output_dir=str(tmp_path / name),
        )
        data["scheduler"]["milp_time_limit"] = None  # the same plan for both runs
        return parse_config(data)

    straight = Trainer(config("straight", jobs)).train()
    assert Trainer(config("resumed", jobs), stop=StopAfter(2)).train().interrupted
    resumed = Trainer(config("resumed", jobs[::-1], recompute=True)).train(resume=True)
    assert list(resumed.state.jobs) == ["second", "first"]
    for name, folder in straight.adapters.items():
        expected = load_file(folder / "adapter_model.safetensors")
        actual = load_file(resumed.adapters[name] / "adapter_model.safetensors")
        for key, tensor in expected.items():
            torch.testing.assert_close(actual[key], tensor, rtol=0, atol=0, msg=f"{name} {key}")
