"""Training adapters together with a plan gives the weights of training each alone (Contract 1).

The scheduler only reorders and packs samples inside a global batch, and the trainer normalises
each adapter's loss over its whole global batch and steps it exactly at the plan's ``step_after``,
so two jobs trained together in mixed microbatches must end (fp32, CPU, to rounding) where each
ends when trained alone on the same global batches: by the trainer with a one-job config, and by a
plain HF + PEFT loop that knows nothing of plans, packing or fused kernels.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

WORDS = ["alpha", "beta", "gamma", "delta", "pear", "plum", "fig", "kiwi", "lime", "date"]


def _write_data(path: Path, count: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))
        response = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 10))))
        rows.append(json.dumps({"prompt": prompt, "response": response}))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion_megatron.data.tokenizer import byte_level_tokenizer
    from lorafusion_megatron.presets import PRESETS

    root = tmp_path_factory.mktemp("equivalence")
    base = root / "base"
    tokenizer = byte_level_tokenizer()
    preset = PRESETS["tiny"]
    config = AutoConfig.for_model(
        preset.model_type, **preset.config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base)
    tokenizer.save_pretrained(base)
    jobs = [
        {
            "name": "summaries",
            "dataset": {"path": str(_write_data(root / "summaries.jsonl", 14, seed=1))},
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "learning_rate": 3e-3,
            "warmup_ratio": 0.2,
            "global_batch_size": 4,
            "num_train_epochs": 1,
            "max_grad_norm": 0.5,
        },
        {
            "name": "questions",
            "dataset": {"path": str(_write_data(root / "questions.jsonl", 12, seed=2))},
            "r": 8,
            "lora_alpha": 8,
            "use_rslora": True,
            "target_modules": ["gate_proj", "up_proj", "down_proj", "v_proj"],
            "learning_rate": 2e-3,
            "lr_scheduler_type": "linear",
            "weight_decay": 0.01,
            "global_batch_size": 3,
            "num_train_epochs": 1,
        },
    ]

    def config_for(names: list[str], output: str):
        from lorafusion_megatron.config import parse_config

        return parse_config(
            {
                "output_dir": str(root / output),
                "base_model": {"model_name_or_path": str(base), "dtype": "float32", "attn_implementation": "sdpa"},
                "jobs": [job for job in jobs if job["name"] in names],
                # Small microbatches, so global batches are split and adapters share microbatches.
                "scheduler": {"capacity": 96, "padding_multiple": 8},
                "runtime": {"device": "cpu", "seed": 0},
                "logging": {"progress_bar": False},
            }
        )

    return config_for


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=2e-4, atol=2e-6, msg=key)


def _plain_peft_loop(config) -> dict[str, torch.Tensor]:
    """Train the config's only job alone: padded global batches, HF's own loss, AdamW, HF schedule."""
    from peft import get_peft_model_state_dict
    from transformers import get_scheduler

    from lorafusion_megatron.data.samples import IGNORE_INDEX
    from lorafusion_megatron.model import attach_adapters, build_base_model, lora_parameters
    from lorafusion_megatron.trainer import prepare_data

    [job] = config.jobs
    data = prepare_data(config).jobs[job.name]
    base = build_base_model(config.base_model, device=torch.device("cpu"), seed=0)
    model = attach_adapters(base, [job], seed=config.runtime.seed, name_or_path=config.base_model.model_name_or_path)
    params = list(lora_parameters(model, job.name).values())
    optimizer = torch.optim.AdamW(
        params,
        lr=job.learning_rate,
        betas=(job.adam_beta1, job.adam_beta2),
        eps=job.adam_epsilon,
        weight_decay=job.weight_decay,
    )
    steps = data.num_global_batches(drop_last=False)
    scheduler = get_scheduler(
        job.lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(job.warmup_ratio * steps), num_training_steps=steps
    )
    for step in range(steps):
        samples = [
            data.sample(i)
            for i in range(step * job.global_batch_size, min((step + 1) * job.global_batch_size, len(data)))
        ]
        length = max(len(s) for s in samples)
        ids = torch.zeros(len(samples), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for row, sample in enumerate(samples):
            n = len(sample)
            ids[row, :n] = torch.from_numpy(sample.input_ids)
            mask[row, :n] = 1
            trained = torch.from_numpy(sample.targets[:-1]) != IGNORE_INDEX
            labels[row, 1:n] = torch.where(trained, torch.from_numpy(sample.input_ids[1:]), IGNORE_INDEX)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=job.name).items()}


# PEFT (0.21) still calls transformers' deprecated `is_gradient_checkpointing`.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_two_adapters_together_equal_each_alone(setup) -> None:
    from lorafusion_megatron.trainer import Trainer

    together = setup(["summaries", "questions"], "together")
    result = Trainer(together).train()
    plan = json.loads((Path(together.output_dir) / "plan.json").read_text())
    assert any(len(mb["segments"]) > 1 for mb in plan["microbatches"]), "the plan never mixed the adapters"
    split = {
        name: sum(
            1 for mb in plan["microbatches"] for s in mb["segments"] if s["adapter"] == name and s["global_batch"] == 0
        )
        for name in ("summaries", "questions")
    }
    assert max(split.values()) > 1, "no global batch was split over microbatches"

    for name in ("summaries", "questions"):
        alone = setup([name], f"alone-{name}")
        Trainer(alone).train()
        joint = _weights(result.adapters[name])
        _assert_same(joint, _weights(Path(alone.output_dir) / "adapters" / name))
        _assert_same(joint, _plain_peft_loop(alone))
