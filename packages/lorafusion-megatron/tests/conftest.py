"""Shared fixtures: tiny CPU models, tiny datasets and configs (hidden 64, 2 layers, fp32)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def jsonl_factory(tmp_path: Path) -> Callable[..., Path]:
    """Write prompt/response records with seeded random words; returns the file."""
    import numpy as np

    words = ["alpha", "beta", "gamma", "delta", "pear", "plum", "fig", "kiwi", "lime", "date"]

    def make(name: str, count: int, *, seed: int = 0, max_words: int = 12) -> Path:
        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(count):
            prompt = " ".join(rng.choice(words, size=int(rng.integers(1, max_words))))
            response = " ".join(rng.choice(words, size=int(rng.integers(1, max_words))))
            rows.append({"prompt": prompt, "response": response})
        return write_jsonl(tmp_path / "data" / f"{name}.jsonl", rows)

    return make


@pytest.fixture
def config_dict(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """A run config mapping with synthetic jobs on the tiny preset (override keys by keyword)."""

    def make(*, jobs: list[dict[str, Any]] | None = None, **top: Any) -> dict[str, Any]:
        default_jobs = [
            {
                "name": name,
                "dataset": {"synthetic": dataset, "num_samples": 12, "length_scale": 0.05},
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj", "v_proj"],
                "learning_rate": 1e-3,
                "global_batch_size": 4,
            }
            for name, dataset in (("first", "xsum"), ("second", "wikisum"))
        ]
        data: dict[str, Any] = {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": "tiny", "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": jobs if jobs is not None else default_jobs,
            "scheduler": {"capacity": 256, "padding_multiple": 16},
            "runtime": {"device": "cpu", "seed": 0},
            "logging": {"progress_bar": False},
        }
        data.update(top)
        return data

    return make


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset with seeded random weights and a byte-level tokenizer, saved as a local model folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion_megatron.data.tokenizer import byte_level_tokenizer
    from lorafusion_megatron.presets import PRESETS

    folder = tmp_path_factory.mktemp("tiny-base")
    tokenizer = byte_level_tokenizer()
    preset = PRESETS["tiny"]
    config = AutoConfig.for_model(
        preset.model_type, **preset.config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
