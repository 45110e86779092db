"""Small CPU building blocks for tests of the runtime (here and in the pipeline runtime's tests).

Tiny random-weight PEFT models, seeded random job data, and hand-made plan microbatches, so a test
can drive :class:`~lorafusion_megatron.runner.MicrobatchRunner` or the executor without planning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lorafusion_megatron.config import BaseModelConfig, DatasetConfig, JobConfig, TrainerConfig
from lorafusion_megatron.data.job_data import JobData
from lorafusion_megatron.data.samples import Sample
from lorafusion_megatron.executor import StopSignal

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from lorafusion_megatron.pipeline.groups import Layout
    from lorafusion_sched.models import Microbatch

__all__ = [
    "INJECTED_FAILURE",
    "StopAfter",
    "assert_same_adapters",
    "cpu_stage_layout",
    "hang",
    "lora_grads",
    "plan_microbatch",
    "random_job",
    "run_rank_failing_in_first_forward",
    "run_rank_hanging_in_first_forward",
    "run_rank_hanging_while_reading_data",
    "saved_adapters",
    "tiny_peft_model",
    "two_job_config",
    "write_profile",
]

INJECTED_FAILURE = "rank 1 fails in its first forward (injected by a test)"
"""The message of the error :func:`run_rank_failing_in_first_forward` raises."""


class StopAfter(StopSignal):
    """Stops a run after ``count`` microbatches, as a first Ctrl-C would (a real one still does too)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def __call__(self) -> bool:
        """Whether to stop now: the ``count``-th call, or a stop asked for by a signal."""
        self.count -= 1
        return self.count <= 0 or super().__call__()


def two_job_config(
    base: Path,
    output: Path,
    *,
    lora_dropout: float = 0.0,
    max_grad_norm: float = 1.0,
    capacity: int = 256,
    fused_kernels: bool = True,
) -> dict[str, Any]:
    """The config mapping of a small CPU run: two jobs on the model in ``base``, fp32, sdpa.

    ``first`` trains 10 XSum-like samples in global batches of 3 and ``second`` 7 WikiSum-like
    samples in global batches of 2 (short synthetic lengths): several steps per job, a last global
    batch smaller than the others, and microbatches that mix the jobs. LoRA r=4, alpha 8 on
    ``q_proj``, ``v_proj`` and ``down_proj``.
    """
    jobs = [
        {
            "name": name,
            "dataset": {"synthetic": dataset, "num_samples": samples, "length_scale": 0.03},
            "r": 4,
            "lora_alpha": 8,
            "lora_dropout": lora_dropout,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "learning_rate": 1e-2,
            "global_batch_size": batch,
            "max_grad_norm": max_grad_norm,
        }
        for name, dataset, samples, batch in (("first", "xsum", 10, 3), ("second", "wikisum", 7, 2))
    ]
    return {
        "output_dir": str(output),
        "base_model": {"model_name_or_path": str(base), "dtype": "float32", "attn_implementation": "sdpa"},
        "jobs": jobs,
        "scheduler": {"capacity": capacity, "padding_multiple": 16},
        "runtime": {"device": "cpu", "seed": 0, "fused_kernels": fused_kernels},
        "logging": {"progress_bar": False},
    }


def write_profile(output_dir: str | Path, *, stages: int, fixed_s: float) -> None:
    """A ``profile.json`` in ``output_dir`` whose forward takes ``fixed_s + 1e-5 s`` per token on every stage.

    Measured at 64 to 512 tokens; the report's own line (``cost_model``) is far from those times, so
    a test sees which of the two the trainer uses.
    """
    import json

    measurements = [
        {
            "stage": s,
            "tokens": n,
            "forward_s": fixed_s + 1e-5 * n,
            "backward_s": 2 * (fixed_s + 1e-5 * n),
            "peak_bytes": None,
        }
        for s in range(stages)
        for n in (64, 128, 256, 512)
    ]
    report = {
        "pipeline_stages": stages,
        "measurements": measurements,
        "cost_model": {"forward_fixed_s": 9.0, "forward_per_token_s": 1e-9},
        "recompute_models": None,
        "chosen_capacity": 256,
        "chosen_recomputed_layers": None,
    }
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "profile.json").write_text(json.dumps(report), encoding="utf-8")


def tiny_peft_model(
    names: Sequence[str] = ("first", "second"),
    *,
    attn_implementation: str = "sdpa",
    dropout: float = 0.0,
    recomputed_layers: int = 0,
) -> tuple[PeftModel, list[JobConfig]]:
    """The ``tiny`` preset (fp32, CPU) with one LoRA adapter per name on q/v/down projections.

    PEFT initialises ``B`` to zero; here every ``B`` gets seeded random values so that each
    adapter visibly changes the outputs.
    """
    import torch

    from lorafusion_megatron.model import attach_adapters, build_base_model

    base = build_base_model(
        BaseModelConfig(model_name_or_path="tiny", dtype="float32", attn_implementation=attn_implementation),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        seed=0,
        recomputed_layers=recomputed_layers,
    )
    jobs = [
        JobConfig(
            name=name,
            dataset=DatasetConfig(synthetic="xsum"),
            r=4,
            lora_alpha=8,
            lora_dropout=dropout,
            target_modules=["q_proj", "v_proj", "down_proj"],
        )
        for name in names
    ]
    model = attach_adapters(base, jobs, seed=0, name_or_path="tiny")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model, jobs


def random_job(name: str, lengths: Sequence[int], global_batch_size: int, *, seed: int, prompt: int = 2) -> JobData:
    """A job whose samples have the given lengths, random token ids below 512, ``prompt`` masked tokens."""
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        ids = rng.integers(0, 512, size=n).tolist()
        samples.append(Sample.from_tokens(ids[:prompt], ids[prompt:]))
    return JobData(name=name, samples=samples, order=np.arange(len(samples)), global_batch_size=global_batch_size)


def plan_microbatch(*segments: tuple[str, int, tuple[int, ...]], step_after: tuple[str, ...] = ()) -> Microbatch:
    """A plan microbatch from ``(adapter, global batch, sample indices)`` segments (token counts unused)."""
    from lorafusion_sched.models import Microbatch, Segment

    return Microbatch(
        segments=tuple(
            Segment(adapter=a, global_batch=g, samples=s, tokens=len(s), padded_tokens=len(s)) for a, g, s in segments
        ),
        step_after=step_after,
    )


def cpu_stage_layout(stage: int) -> Layout:
    """Stage ``stage`` of a 2-stage pipeline on the CPU, one replica, no process groups (for one-process tests)."""
    import torch

    from lorafusion_megatron.pipeline.groups import Layout

    return Layout(
        rank=stage,
        world_size=2,
        stage=stage,
        num_stages=2,
        replica=0,
        num_replicas=1,
        prev_rank=0 if stage == 1 else None,
        next_rank=1 if stage == 0 else None,
        pipeline_group=None,
        data_group=None,
        device=torch.device("cpu"),
    )


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every LoRA gradient, by parameter name."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def saved_adapters(source: Path | TrainerConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Each job's saved adapter tensors, by job name then key.

    Args:
        source: A run's ``adapters`` folder (one sub-folder per job, named after it), or a run's
            config, whose jobs' adapters are read where it puts them (``job_output_dir``).
    """
    from safetensors.torch import load_file

    if isinstance(source, Path):
        folders = {folder.name: folder for folder in sorted(source.iterdir())}
    else:
        folders = {job.name: source.job_output_dir(job) for job in source.jobs}
    return {name: load_file(folder / "adapter_model.safetensors") for name, folder in folders.items()}


def assert_same_adapters(
    actual: Mapping[str, Mapping[str, torch.Tensor]],
    expected: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> None:
    """The same jobs with the same tensors: bit for bit, or within ``rtol``/``atol`` (as ``assert_close``)."""
    import torch

    assert actual.keys() == expected.keys()
    for name, tensors in expected.items():
        assert actual[name].keys() == tensors.keys(), name
        for key, tensor in tensors.items():
            torch.testing.assert_close(actual[name][key], tensor, rtol=rtol, atol=atol, msg=f"{name}: {key}")


def run_rank_failing_in_first_forward(config: Any, parallel: Any, **kwargs: Any) -> dict[str, Any] | None:
    """:func:`~lorafusion_megatron.pipeline.worker.run_rank`, except that global rank 1 raises in its first forward.

    For tests of the launcher: patch ``lorafusion_megatron.pipeline.worker.run_rank`` with this,
    then call ``launch`` (the ranks, started afresh, import this module and run the real
    ``run_rank``). Rank 1 raises ``RuntimeError(INJECTED_FAILURE)`` and, once its process groups
    are torn down, waits 2 s before its process exits, so that its neighbour, which fails on
    losing it, exits first.
    """
    import time

    from lorafusion_megatron.pipeline.engine import StageEngine
    from lorafusion_megatron.pipeline.worker import run_rank

    if kwargs.get("rank") != 1:
        return run_rank(config, parallel, **kwargs)

    def fail(*args: Any, **options: Any) -> Any:
        raise RuntimeError(INJECTED_FAILURE)

    StageEngine._forward = fail  # type: ignore[method-assign]  # this rank's own process
    try:
        return run_rank(config, parallel, **kwargs)
    except RuntimeError:
        time.sleep(2)
        raise


def hang(*args: Any, **options: Any) -> Any:
    """Sleep for an hour, whatever it is called with: the hang that the tests inject into a rank."""
    import time

    time.sleep(3600)


def run_rank_hanging_while_reading_data(config: Any, parallel: Any, **kwargs: Any) -> dict[str, Any] | None:
    """As :func:`run_rank_hanging_in_first_forward`, except that rank 1 sleeps while reading the jobs' data."""
    import lorafusion_megatron.trainer
    from lorafusion_megatron.pipeline.worker import run_rank

    if kwargs.get("rank") == 1:
        lorafusion_megatron.trainer.prepare_data = hang  # this rank's own process
    return run_rank(config, parallel, **kwargs)


def run_rank_hanging_in_first_forward(config: Any, parallel: Any, **kwargs: Any) -> dict[str, Any] | None:
    """As :func:`run_rank_failing_in_first_forward`, except that rank 1 sleeps in its first forward and never fails.

    Its stall watchdog ends it after 0.9 of ``parallel.collective_timeout_minutes``
    (:mod:`~lorafusion_megatron.pipeline.stall`), before its neighbour's wait for it times out.
    """
    from lorafusion_megatron.pipeline.engine import StageEngine
    from lorafusion_megatron.pipeline.worker import run_rank

    if kwargs.get("rank") == 1:
        StageEngine._forward = hang  # type: ignore[method-assign]  # this rank's own process
    return run_rank(config, parallel, **kwargs)
