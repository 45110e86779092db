"""Sent activations are freed, and the backward through them gives the same gradients bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.data.job_data import JobData
from lorafusion_megatron.model import load_model_config
from lorafusion_megatron.packing import pack_microbatch
from lorafusion_megatron.pipeline.activations import backward_from, release_storage
from lorafusion_megatron.pipeline.p2p import Expect, Transfer
from lorafusion_megatron.pipeline.partition import partition_model
from lorafusion_megatron.pipeline.stage_model import StageModel, build_stage_model
from lorafusion_megatron.pipeline.stall import Heartbeat, no_heartbeat
from lorafusion_megatron.testing import cpu_stage_layout, plan_microbatch, random_job
from lorafusion_sched.models import Microbatch, Segment


def _two_stages(tmp_path: Path, *, activation_checkpointing: bool) -> list[StageModel]:
    jobs = [
        {"name": name, "dataset": {"synthetic": "xsum"}, "r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
        for name in ("first", "second")
    ]
    config = parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": "tiny", "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": jobs,
            "runtime": {"device": "cpu", "activation_checkpointing": activation_checkpointing},
        }
    )
    specs = partition_model(load_model_config(config.base_model).to_dict(), 2)
    return [build_stage_model(config, spec, torch.device("cpu")) for spec in specs]


def _first_stage_gradients(stages: list[StageModel], *, release: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    """The first stage's LoRA gradients after a microbatch's forward and backward, its output's storage bytes
    after the send, and the microbatch's tokens.

    ``release``: free the output once sent and go through :func:`backward_from`, as the engine does;
    else keep it and call :func:`torch.autograd.backward`, as the engine did before.
    """
    data = {"first": random_job("first", [5, 7, 4], 3, seed=1), "second": random_job("second", [6, 3], 2, seed=2)}
    batch = pack_microbatch(plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1))), data)
    first, last = stages
    for stage in stages:
        for name in ("first", "second"):
            for param in stage.lora_parameters(name).values():
                param.grad = None
    torch.manual_seed(0)
    output = first.forward(batch, None)
    received = output.detach().clone().requires_grad_(True)  # what the next stage receives
    if release:
        release_storage(output)
    last.forward(batch, received).sum().backward()
    assert received.grad is not None
    stored = output.untyped_storage().nbytes()
    if release:
        backward_from(output, received.grad)
    else:
        torch.autograd.backward(output, grad_tensors=received.grad)
    grads = {
        key: param.grad.clone()
        for name in ("first", "second")
        for key, param in first.lora_parameters(name).items()
        if param.grad is not None
    }
    return grads, stored, batch.num_tokens


@pytest.mark.parametrize("activation_checkpointing", [False, True], ids=["plain", "recompute"])
def test_a_released_output_keeps_its_gradients_bit_for_bit(tmp_path: Path, activation_checkpointing: bool) -> None:
    stages = _two_stages(tmp_path, activation_checkpointing=activation_checkpointing)
    kept, kept_bytes, tokens = _first_stage_gradients(stages, release=False)
    released, released_bytes, _ = _first_stage_gradients(stages, release=True)
    assert kept_bytes == tokens * stages[0].hidden_size * 4  # float32 [1, T, hidden]
    assert released_bytes == 4  # one float32
    assert kept.keys() == released.keys()
    assert kept
    for key, grad in kept.items():
        assert torch.equal(released[key], grad), key


def test_a_view_is_not_released() -> None:
    base = torch.zeros(4, 3, requires_grad=True) * 2
    with pytest.raises(ValueError, match="view"):
        release_storage(base[1:])


class _NextStage:
    """Stands in for stage 1 of 2: takes the activations, answers with seeded gradients of their shape."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.sent: list[int] = []

    def exchange(
        self,
        *,
        send_forward: Transfer | None = None,
        recv_backward: Expect | None = None,
        send_backward: Transfer | None = None,
        recv_forward: Expect | None = None,
    ) -> tuple[None, torch.Tensor | None]:
        if send_forward is not None:
            self.sent.append(send_forward.microbatch)
        if recv_backward is None:
            return None, None
        generator = torch.Generator().manual_seed(recv_backward.microbatch)
        return None, torch.randn(1, recv_backward.tokens, self.hidden_size, generator=generator)


def _microbatch(data: dict[str, JobData], *segments: tuple[str, tuple[int, ...]]) -> Microbatch:
    """A plan microbatch of global batch 0 with the samples' real token counts."""
    parts = []
    for adapter, samples in segments:
        tokens = sum(len(data[adapter].sample(i)) for i in samples)
        parts.append(Segment(adapter=adapter, global_batch=0, samples=samples, tokens=tokens, padded_tokens=tokens))
    return Microbatch(segments=tuple(parts))


def _engine_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, release: bool, heartbeat: Heartbeat = no_heartbeat
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Stage 0 of 2 runs three microbatches through the engine; returns its LoRA gradients and the
    storage bytes of each output when its backward starts."""
    from lorafusion_megatron.pipeline import engine as engine_module
    from lorafusion_megatron.pipeline.engine import StageEngine
    from lorafusion_megatron.pipeline.programs import Program

    stage = _two_stages(tmp_path, activation_checkpointing=False)[0]
    layout = cpu_stage_layout(0)
    data = {"first": random_job("first", [5, 7, 4], 3, seed=1), "second": random_job("second", [6, 3], 2, seed=2)}
    microbatches = tuple(
        _microbatch(data, *segments)
        for segments in ([("first", (0, 1))], [("first", (2,)), ("second", (0,))], [("second", (1,))])
    )
    stored: list[int] = []
    real_backward = engine_module.backward_from

    def backward(output: torch.Tensor, grad: torch.Tensor) -> None:
        stored.append(output.untyped_storage().nbytes())
        if release:
            real_backward(output, grad)
        else:
            torch.autograd.backward(output, grad_tensors=grad)

    monkeypatch.setattr(engine_module, "backward_from", backward)
    if not release:
        monkeypatch.setattr(engine_module, "release_storage", lambda tensor: None)
    link = _NextStage(stage.hidden_size)
    engine = StageEngine(layout=layout, stage=stage, link=link, data=data, optimizers={})  # type: ignore[arg-type]
    torch.manual_seed(0)
    program = Program(name="lorafusion", runs=(microbatches,), data_parallel=1)
    assert engine.execute(program, on_drain=lambda position: None, heartbeat=heartbeat) == 3
    assert link.sent == [0, 1, 2]
    grads = {
        key: param.grad.clone()
        for name in ("first", "second")
        for key, param in stage.lora_parameters(name).items()
        if param.grad is not None
    }
    return grads, stored


def test_the_engine_frees_each_sent_output_and_trains_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        kept, kept_bytes = _engine_gradients(tmp_path / "kept", patch, release=False)
    released, released_bytes = _engine_gradients(tmp_path / "released", monkeypatch, release=True)
    assert kept_bytes == [tokens * 64 * 4 for tokens in (12, 10, 3)]  # [1, T, 64] float32, kept until the backward
    assert released_bytes == [4, 4, 4]  # one float32 each, from the send to the backward
    assert kept.keys() == released.keys()
    assert kept
    for key, grad in kept.items():
        assert torch.equal(released[key], grad), key


def test_the_engine_tells_its_heartbeat_of_every_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stall watchdog hears: each forward and backward, each exchange (waiting), the drain."""
    heard: list[tuple[str, bool]] = []

    def heartbeat(doing: str, *, waiting: bool = False) -> None:
        heard.append((doing, waiting))

    _engine_gradients(tmp_path, monkeypatch, release=True, heartbeat=heartbeat)
    own = [doing for doing, waiting in heard if not waiting]
    assert [d for d in own if d.startswith("the forward")] == [f"the forward of microbatch {i}" for i in range(3)]
    assert [d for d in own if d.startswith("the backward")] == [f"the backward of microbatch {i}" for i in range(3)]
    assert own[-1] == "the drain at microbatch 3"
    waited = {doing for doing, waiting in heard if waiting}
    assert waited == {"an exchange with the neighbouring stages (and the steps after it)"}
