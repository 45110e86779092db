"""The example of a loop of one's own (``examples/own_training_loop.py``) trains losslessly.

Three PEFT adapters trained together along a lorafusion-sched plan, through the fused multi-adapter
op, end where plain PEFT takes each alone, one sample at a time, on the same global batches (CPU,
dropout 0). In fp64, so that the check is sharp: in fp32, AdamW's division by the root of tiny
second moments turns the summation order's rounding into differences of up to 0.2% of the weights'
movement; in fp64 they are about 1e-14.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    # PEFT (0.21) still calls transformers' deprecated `is_gradient_checkpointing`.
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

EXAMPLE = Path(__file__).parents[1] / "examples" / "own_training_loop.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_training_loop", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _alone(example: ModuleType, workload, name: str) -> list[torch.Tensor]:
    """Plain PEFT, no plan, no packing, no fused kernels: one adapter, sample by sample."""
    model = example.build_model(workload, torch.device("cpu"))
    model.set_adapter(name)
    model.train()
    params = example.adapter_parameters(model, name)
    optimizer = torch.optim.AdamW(params, lr=workload.learning_rate)
    samples, size = workload.samples[name], example.GLOBAL_BATCH_SIZES[name]
    for step in range(math.ceil(len(samples) / size)):
        batch = samples[step * size : (step + 1) * size]
        for tokens in batch:
            tokens = tokens[: workload.capacity] if workload.truncate else tokens
            logits = model(input_ids=tokens[None]).logits[0]
            (torch.nn.functional.cross_entropy(logits[:-1], tokens[1:]) / len(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("truncate", [False, True], ids=["whole", "truncated"])
def test_adapters_trained_together_equal_each_alone(truncate: bool) -> None:
    """With ``truncate``, samples longer than a 64-token capacity are cut to it, in both runs."""
    example = _example()
    workload = example.synthetic_workload(10, lora_dropout=0.0)
    changes = {"capacity": 64, "truncate": True} if truncate else {}
    workload = dataclasses.replace(workload, dtype=torch.float64, **changes)
    plan = example.make_plan(workload)
    assert any(len({s.adapter for s in mb.segments}) > 1 for mb in plan.microbatches), "no microbatch mixes adapters"
    assert any(n > 1 for n in _microbatches_per_global_batch(plan).values()), "no global batch was split"

    model, losses = example.train(workload, torch.device("cpu"))
    for name, size in example.GLOBAL_BATCH_SIZES.items():
        assert len(losses[name]) == math.ceil(10 / size)
        together = example.adapter_parameters(model, name)
        for got, want in zip(together, _alone(example, workload, name), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _microbatches_per_global_batch(plan) -> dict[tuple[str, int], int]:
    counts: dict[tuple[str, int], int] = {}
    for mb in plan.microbatches:
        for seg in mb.segments:
            counts[seg.adapter, seg.global_batch] = counts.get((seg.adapter, seg.global_batch), 0) + 1
    return counts


def test_the_example_runs_as_a_script(capsys: pytest.CaptureFixture[str]) -> None:
    _example().main(["--samples", "6"])
    out = capsys.readouterr().out
    assert "plan:" in out
    assert all(f"{name}: " in out for name in ("math", "code", "chat"))


def test_samples_without_a_target_are_refused() -> None:
    example = _example()
    samples = {"math": [torch.arange(5), torch.arange(1)], "code": [torch.arange(3)], "chat": [torch.arange(4)]}
    with pytest.raises(ValueError, match=r"adapter 'math': samples \[1\] have fewer than 2 tokens"):
        example.Workload(samples=samples)
