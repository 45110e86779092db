from __future__ import annotations

import pytest
import torch

from lorafusion_megatron.config import DatasetConfig, JobConfig
from lorafusion_megatron.optim import AdapterOptimizer, lr_multiplier


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_match_transformers(kind: str) -> None:
    from transformers import get_scheduler

    total, warmup = 23, 4
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    name = "constant_with_warmup" if kind == "constant" else kind
    hf = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        assert lr_multiplier(step, total_steps=total, warmup_steps=warmup, kind=kind) == pytest.approx(
            hf.get_last_lr()[0]
        ), step
        optimizer.step()
        hf.step()


def _job(**kw) -> JobConfig:
    return JobConfig(name="job", dataset=DatasetConfig(synthetic="xsum"), **kw)


def test_step_clips_steps_and_clears_gradients() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    opt = AdapterOptimizer(_job(max_grad_norm=1.0, learning_rate=0.1, warmup_ratio=0.0), {"p": param}, total_steps=10)
    param.grad = torch.full((4,), 3.0)
    stats = opt.step().stats()
    assert stats.step == 1
    assert stats.grad_norm == pytest.approx(6.0)
    assert stats.learning_rate == pytest.approx(0.1)
    assert param.grad is None
    assert not torch.equal(param.detach(), torch.ones(4))
    assert opt.scheduler.get_last_lr()[0] < 0.1


def test_state_round_trip_continues_identically() -> None:
    def run(split: bool) -> torch.Tensor:
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(5))
        job = _job(warmup_ratio=0.2, lr_scheduler_type="linear", max_grad_norm=None)
        opt = AdapterOptimizer(job, {"p": param}, total_steps=6)
        for step in range(6):
            if split and step == 3:
                state = opt.state_dict()
                opt = AdapterOptimizer(job, {"p": param}, total_steps=6)
                opt.load_state_dict(state)
            param.grad = torch.sin(param.detach() * (step + 1))
            opt.step()
        return param.detach()

    torch.testing.assert_close(run(False), run(True), rtol=0, atol=0)
