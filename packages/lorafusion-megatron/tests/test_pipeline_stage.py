"""Stage models in one process: only the stage's own weights are real, and chained stages equal the full model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.model import attach_adapters, build_base_model, load_model_config
from lorafusion_megatron.packing import pack_microbatch
from lorafusion_megatron.pipeline.p2p import Expect, PipelineMismatchError, StageLink, Transfer
from lorafusion_megatron.pipeline.partition import StageSpec, partition_model
from lorafusion_megatron.pipeline.stage_model import StageModel, build_stage_model
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.testing import cpu_stage_layout, plan_microbatch, random_job

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def three_layer_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer tiny LLaMA saved as a local folder (3 layers: stages of unequal size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion_megatron.presets import PRESETS

    folder = tmp_path_factory.mktemp("three-layer")
    preset = PRESETS["tiny"]
    config = AutoConfig.for_model(preset.model_type, **{**preset.config, "num_hidden_layers": 3})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _config(
    model: str,
    tmp_path: Path,
    *,
    activation_checkpointing: bool | str | list[int] = False,
    attn: str = "sdpa",
    fused: bool = True,
) -> TrainerConfig:
    jobs = [
        {"name": name, "dataset": {"synthetic": "xsum"}, "r": r, "lora_alpha": 8, "target_modules": targets}
        for name, r, targets in (("first", 4, "all-linear"), ("second", 2, ["q_proj", "down_proj"]))
    ]
    return parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": model, "dtype": "float32", "attn_implementation": attn},
            "jobs": jobs,
            "runtime": {
                "device": "cpu",
                "activation_checkpointing": activation_checkpointing,
                "fused_kernels": fused,
            },
        }
    )


def _stages(config: TrainerConfig, count: int) -> list[StageModel]:
    specs = partition_model(load_model_config(config.base_model).to_dict(), count)
    return [build_stage_model(config, spec, CPU) for spec in specs]


@pytest.mark.parametrize(
    ("activation_checkpointing", "attn", "recomputed"),
    [
        (False, "sdpa", [0, 0]),
        (True, "sdpa", [2, 1]),
        ([1, 0], "sdpa", [1, 0]),
        (False, "eager", [0, 0]),
        (False, "varlen", [0, 0]),
    ],
)
def test_two_stages_give_the_full_models_losses_gradients_and_initial_adapters(
    three_layer_base: Path, tmp_path: Path, activation_checkpointing: bool | list[int], attn: str, recomputed: list[int]
) -> None:
    from lorafusion_megatron.attention import torch_varlen_available

    if attn == "varlen" and not torch_varlen_available():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    config = _config(str(three_layer_base), tmp_path, activation_checkpointing=activation_checkpointing, attn=attn)
    stages = _stages(config, 2)
    assert [list(s.spec.layers) for s in stages] == [[0, 1], [2]]
    assert [s.recomputed_layers for s in stages] == recomputed
    data = {"first": random_job("first", [5, 7, 4], 3, seed=1), "second": random_job("second", [6, 3], 2, seed=2)}
    batch = pack_microbatch(plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1))), data)
    denominators = {("first", 0): 13, ("second", 0): 7}

    import lorafusion_kernels

    reference = attach_adapters(
        build_base_model(config.base_model, device=CPU, seed=0), config.jobs, seed=0, name_or_path=str(three_layer_base)
    )
    lorafusion_kernels.patch_peft_model(reference)
    runner = MicrobatchRunner(
        reference,
        ["first", "second"],
        attn_implementation=stages[0].attn_implementation,
        dtype=torch.float32,
        fused=True,
    )
    expected = runner.forward_backward(batch, denominators).get()

    # Each layer's attention runs once in the forward, and again where the backward recomputes it.
    calls: dict[int, int] = {}
    for stage in stages:
        for i in stage.spec.layers:
            attention = stage.model.base_model.model.model.layers[i].self_attn
            attention.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    hidden = stages[0].forward(batch, None)
    received = hidden.detach().requires_grad_(True)
    token_loss = stages[1].forward(batch, received)
    sums = [token_loss[s.start : s.start + s.length].sum() for s in batch.segments]
    objective = sum(total / denominators[(s.adapter, 0)] for total, s in zip(sums, batch.segments, strict=True))
    assert [float(v.detach()) for v in sums] == pytest.approx([r.loss_sum for r in expected], rel=1e-6)
    objective.backward()
    hidden.backward(received.grad)
    assert calls == {0: 1 + (recomputed[0] > 0), 1: 1 + (recomputed[0] > 1), 2: 1 + (recomputed[1] > 0)}

    full = dict(reference.named_parameters())
    checked = 0
    for stage in stages:
        for name in ("first", "second"):
            for key, param in stage.lora_parameters(name).items():
                assert torch.equal(param.detach(), full[key].detach()), key
                torch.testing.assert_close(param.grad, full[key].grad, rtol=1e-5, atol=1e-7)
                checked += 1
    assert checked == sum(1 for k in full if ".lora_" in k)


@pytest.mark.parametrize("activation_checkpointing", [False, True], ids=["plain", "recompute"])
def test_plain_peft_stages_give_the_plain_trainers_losses_and_gradients(
    three_layer_base: Path, tmp_path: Path, activation_checkpointing: bool
) -> None:
    """``fused_kernels: false``: PEFT's own layers, one segment at a time (also when recomputed)."""
    config = _config(str(three_layer_base), tmp_path, activation_checkpointing=activation_checkpointing, fused=False)
    stages = _stages(config, 2)
    for stage in stages:
        assert not stage.fused
        patched = [name for name, module in stage.model.named_modules() if "forward" in vars(module)]
        assert not patched, patched
    data = {"first": random_job("first", [5, 7, 4], 3, seed=1), "second": random_job("second", [6, 3], 2, seed=2)}
    batch = pack_microbatch(plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1))), data)
    denominators = {("first", 0): 13, ("second", 0): 7}
    reference = attach_adapters(
        build_base_model(config.base_model, device=CPU, seed=0), config.jobs, seed=0, name_or_path=str(three_layer_base)
    )
    runner = MicrobatchRunner(
        reference, ["first", "second"], attn_implementation="sdpa", dtype=torch.float32, fused=False
    )
    expected = runner.forward_backward(batch, denominators).get()

    hidden = stages[0].forward(batch, None)
    received = hidden.detach().requires_grad_(True)
    token_loss = stages[1].forward(batch, received)
    sums = [token_loss[s.start : s.start + s.length].sum() for s in batch.segments]
    assert [float(v.detach()) for v in sums] == pytest.approx([r.loss_sum for r in expected], rel=1e-6)
    objective = sum(total / denominators[(s.adapter, 0)] for total, s in zip(sums, batch.segments, strict=True))
    objective.backward()
    hidden.backward(received.grad)
    full = dict(reference.named_parameters())
    checked = 0
    for stage in stages:
        for name in ("first", "second"):
            for key, param in stage.lora_parameters(name).items():
                torch.testing.assert_close(param.grad, full[key].grad, rtol=1e-5, atol=1e-7, msg=key)
                checked += 1
    assert checked == sum(1 for k in full if ".lora_" in k)


def test_a_stage_holds_only_its_own_weights(three_layer_base: Path, tmp_path: Path) -> None:
    last = _stages(_config(str(three_layer_base), tmp_path), 2)[1]
    real = {n for n, p in last.model.named_parameters() if p.device.type != "meta"}
    assert all(".layers.2." in n or n.endswith(("model.norm.weight", "lm_head.weight")) for n in real)
    assert any(".layers.2." in n and ".lora_A.second." in n for n in real)
    assert not any("embed_tokens" in n for n in real)
    # Other stages' layers carry no LoRA tensors at all (not even on the meta device).
    assert all(".layers.2." in n for n, _ in last.model.named_parameters() if ".lora_" in n)


def test_preset_weights_do_not_depend_on_the_partition(tmp_path: Path) -> None:
    config = _config("tiny", tmp_path)
    whole = _stages(config, 1)[0]
    first, last = _stages(config, 2)
    whole_params = dict(whole.model.named_parameters())
    for stage in (first, last):
        for name, param in stage.model.named_parameters():
            if param.device.type != "meta":
                assert torch.equal(param, whole_params[name]), name


def test_a_checkpoint_missing_a_stage_tensor_is_reported(three_layer_base: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((three_layer_base / "config.json").read_text())
    tensors = load_file(three_layer_base / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    spec = StageSpec(stage=1, num_stages=2, start=2, stop=3, cost=1.0)
    with pytest.raises(TrainerError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        build_stage_model(_config(str(folder), tmp_path), spec, CPU)


def test_a_tensor_of_the_wrong_length_is_refused_before_sending() -> None:
    link = StageLink(cpu_stage_layout(0), hidden_size=8, dtype=torch.float32)
    with pytest.raises(PipelineMismatchError, match="microbatch 17"):
        link.exchange(send_forward=Transfer(17, 5, torch.zeros(1, 6, 8)))


def test_activations_of_another_microbatch_are_refused_on_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    class Done:
        def wait(self) -> None:
            pass

    class Op:
        def __init__(self, op: object, tensor: torch.Tensor, peer: int, group: object) -> None:
            self.tensor = tensor

    def deliver(ops: list[Op]) -> list[Done]:
        # The neighbour is one microbatch ahead: it sends microbatch 4 (of 6 tokens) instead of 3.
        ops[0].tensor.copy_(torch.tensor([4, 6]))
        return [Done() for _ in ops]

    monkeypatch.setattr(dist, "P2POp", Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", deliver)
    link = StageLink(cpu_stage_layout(1), hidden_size=8, dtype=torch.float32)
    with pytest.raises(PipelineMismatchError, match=r"expected activations of microbatch 3 \(6 tokens\).*microbatch 4"):
        link.exchange(recv_forward=Expect(3, 6))
