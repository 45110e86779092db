"""``lorafusion-megatron demo``: four jobs on a tiny random LLaMA, on the CPU, in under a minute.

Everything is built locally: the ``tiny`` preset with random weights is saved to ``DIR/base``
with a byte-level BPE tokenizer trained on the demo's own text, exactly as a downloaded checkpoint
would sit in a folder. Each job learns a small text task; their sample lengths follow the four
synthetic distributions of the paper's heterogeneous (Het) workload, scaled down to the tiny model.
The run then goes through the same path as ``lorafusion-megatron train`` with a generated config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from lorafusion_megatron.config import parse_config

if TYPE_CHECKING:
    from collections.abc import Callable

    from lorafusion_megatron.config import TrainerConfig

__all__ = ["DEMO_JOBS", "DemoTask", "build_demo", "demo_records"]

_WORDS = (
    *("red", "green", "blue", "gold", "grey", "pink", "cat", "dog", "fox", "owl"),
    *("bee", "ant", "yak", "elk", "cow", "pig", "one", "two", "six", "ten"),
    *("sun", "moon", "star", "rain", "snow", "wind", "tree", "leaf", "rock", "sand"),
)

_LENGTH_SCALE = 1 / 16
"""Het lengths (median ~500 to ~1500 tokens, cap 4096) scaled to the tiny model (capacity 320)."""


@dataclass(frozen=True)
class DemoTask:
    """One demo job: a name, its Het length distribution, and how a response follows a prompt."""

    name: str
    lengths: str
    instruction: str
    respond: Callable[[list[str]], list[str]]


DEMO_JOBS = (
    DemoTask("copy", "xsum", "repeat:", lambda words: words),
    DemoTask("reverse", "cnndm", "reverse:", lambda words: words[::-1]),
    DemoTask("sort", "wikisum", "sort:", sorted),
    DemoTask("shout", "mixed", "shout:", lambda words: [w.upper() for w in words]),
)
"""The four jobs, one per synthetic distribution of the Het workload."""


def demo_records(task: DemoTask, num_samples: int, seed: int) -> list[dict[str, str]]:
    """Prompt/response records of ``task`` whose lengths follow its Het distribution.

    A word is about one token of the demo tokenizer, and prompt and response are equally long, so
    a sample of ``n`` tokens holds about ``n / 2`` words.
    """
    from lorafusion_sched.workloads import synthetic_lengths

    rng = np.random.default_rng(seed)
    records = []
    for tokens in synthetic_lengths(task.lengths, num_samples, seed):
        count = max(1, round(tokens * _LENGTH_SCALE / 2))
        words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=count)]
        prompt = f"{task.instruction} {' '.join(words)} ="
        records.append({"prompt": prompt, "response": " " + " ".join(task.respond(words))})
    return records


def _write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _save_base(directory: Path, texts: list[str], seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion_megatron.data.tokenizer import train_bpe_tokenizer
    from lorafusion_megatron.presets import PRESETS

    preset = PRESETS["tiny"]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=int(preset.config["vocab_size"]))
    config = AutoConfig.for_model(
        preset.model_type,
        **preset.config,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # With the usual std of 0.02, a 64-wide random model's logits stay within about +-1.3, so no
        # adapter could take the loss far below ln(vocab); 0.1 lets the demo's losses visibly fall.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def build_demo(output: Path, *, samples_per_job: int = 128, epochs: int = 2, seed: int = 0) -> TrainerConfig:
    """Write the demo's base model, datasets and config under ``output``; return the config.

    Args:
        output: Demo folder: ``base/``, ``data/``, ``demo.yaml``, and later ``adapters/``.
        samples_per_job: Records per job.
        epochs: Passes over each job's data.
        seed: Seed of the data, the base weights and the run.
    """
    output = output.resolve()
    records = {task.name: demo_records(task, samples_per_job, seed + i) for i, task in enumerate(DEMO_JOBS)}
    for name, rows in records.items():
        _write_jsonl(output / "data" / f"{name}.jsonl", rows)
    texts = [row[field] for rows in records.values() for row in rows for field in ("prompt", "response")]
    _save_base(output / "base", texts, seed)
    document: dict[str, Any] = {
        "output_dir": str(output),
        "base_model": {"model_name_or_path": str(output / "base"), "dtype": "float32", "attn_implementation": "sdpa"},
        "jobs": [
            {
                "name": task.name,
                "dataset": {"path": str(output / "data" / f"{task.name}.jsonl")},
                "r": 8,
                "lora_alpha": 16,
                "target_modules": "all-linear",
                "learning_rate": 5e-3,
                "warmup_ratio": 0.1,
                "global_batch_size": 8,
                "num_train_epochs": epochs,
            }
            for task in DEMO_JOBS
        ],
        "scheduler": {"capacity": 320, "padding_multiple": 16},
        "runtime": {"device": "cpu", "seed": seed},
        "logging": {"logging_steps": 8},
    }
    header = f"# lorafusion-megatron train {output / 'demo.yaml'}\n# Written by `lorafusion-megatron demo`.\n"
    (output / "demo.yaml").write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return parse_config(document, source=str(output / "demo.yaml"))
