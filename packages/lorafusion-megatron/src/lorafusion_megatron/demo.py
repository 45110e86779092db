"""``lorafusion-megatron demo``: four jobs on a tiny random LLaMA, on the CPU, in under a minute.

Everything is built locally: the ``tiny`` preset with random weights is saved to ``DIR/base``
with a byte-level BPE tokenizer trained on the demo's own text, exactly as a downloaded checkpoint
would sit in a folder. Each job learns a small text task; their sample lengths follow the four
synthetic distributions of the paper's heterogeneous (Het) workload, scaled down to the tiny model.
The files are built in a hidden folder beside ``DIR`` and renamed to ``DIR`` once complete, so a
build cut short (Ctrl-C, SIGTERM, an error) leaves nothing half-built that would block running the
same command again. The run then goes through the same path as ``lorafusion-megatron train`` with a
generated config.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_lock import absent_folders, removed_if_unused_on_error

if TYPE_CHECKING:
    from collections.abc import Callable

    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.pipeline.options import ParallelConfig

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


def build_demo(
    output: Path, *, samples_per_job: int = 128, epochs: int = 2, seed: int = 0, parallel: ParallelConfig | None = None
) -> TrainerConfig:
    """Write the demo's base model, datasets and config under ``output``; return the config.

    The files are built in a hidden folder beside ``output`` and renamed to ``output`` once all are
    written, so an interrupt or an error while they are built leaves ``output`` as it was (absent,
    or an empty folder) and no folder this created: the same command can simply run again.

    Args:
        output: Demo folder, absent or empty: ``base/``, ``data/``, ``demo.yaml``, and later ``adapters/``.
        samples_per_job: Records per job.
        epochs: Passes over each job's data.
        seed: Seed of the data, the base weights and the run.
        parallel: The run's parallelism, written into ``demo.yaml`` (so that ``train DIR/demo.yaml``
            and its ``--resume`` run it alike); ``None``: one process.

    Raises:
        TrainerError: ``output`` came to hold files while the demo was built (nothing is replaced).
    """
    output = output.resolve()
    document = _demo_document(output, epochs, seed)
    if parallel is not None and (settings := parallel.model_dump(mode="json", exclude_defaults=True)):
        document["parallel"] = settings
    with removed_if_unused_on_error(absent_folders(output.parent)):
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = output.with_name(f".{output.name}.tmp-{secrets.token_hex(4)}")
        try:
            staging.mkdir()  # not mkdtemp's 0700: the folder keeps its mode once renamed to ``output``
            _write_demo_files(staging, document, samples_per_job=samples_per_job, seed=seed)
            _place(staging, output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return parse_config(document, source=str(output / "demo.yaml"))


def _demo_document(output: Path, epochs: int, seed: int) -> dict[str, Any]:
    """The demo's config as a mapping: the four jobs on ``output/base``, their data in ``output/data``."""
    return {
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


def _write_demo_files(folder: Path, document: dict[str, Any], *, samples_per_job: int, seed: int) -> None:
    """Write the datasets, the base model and ``demo.yaml`` into ``folder`` (whose paths the document names)."""
    records = {task.name: demo_records(task, samples_per_job, seed + i) for i, task in enumerate(DEMO_JOBS)}
    for name, rows in records.items():
        _write_jsonl(folder / "data" / f"{name}.jsonl", rows)
    texts = [row[field] for rows in records.values() for row in rows for field in ("prompt", "response")]
    _save_base(folder / "base", texts, seed)
    config_file = Path(document["output_dir"]) / "demo.yaml"
    header = f"# lorafusion-megatron train {config_file}\n# Written by `lorafusion-megatron demo`.\n"
    (folder / "demo.yaml").write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")


def _place(staging: Path, output: Path) -> None:
    """Rename the finished ``staging`` folder to ``output``, which must be absent or an empty folder.

    ``rename`` itself refuses a folder that holds anything (and a file), so whatever another process
    wrote to ``output`` meanwhile is kept, never replaced.

    Raises:
        TrainerError: ``output`` holds files or is a file by now.
    """
    try:
        os.rename(staging, output)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise TrainerError(
            f"{output} came to hold files while the demo was built there, so the demo was not put in place: "
            "choose a new folder, or delete that one"
        ) from None
