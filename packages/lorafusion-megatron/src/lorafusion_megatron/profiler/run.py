"""``lorafusion-megatron profile``: every rank measures its own stage, rank 0 fits and chooses.

Writes ``<output_dir>/profile.json`` (measurements, the fitted cost model, every candidate
capacity's predicted memory and simulated throughput, the choice) and ``profile.md``, the same as a
readable table. :func:`profiled_capacity` reads the choice back, for ``capacity: auto``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import ParallelConfig

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.profiler.capacity import CapacityOption
    from lorafusion_megatron.profiler.measure import Measurement, StageMeasurements

__all__ = [
    "CPU_CANDIDATES",
    "DEFAULT_CANDIDATES",
    "default_candidates",
    "profile_due",
    "profile_rank",
    "profiled_capacity",
    "with_profiled_capacity",
    "write_report",
]

_log = logging.getLogger(__name__)

DEFAULT_CANDIDATES = (1024, 2048, 4096, 8192, 16384, 32768)
"""Capacities tried (and token counts measured) on GPUs unless told otherwise."""

CPU_CANDIDATES = (128, 256, 512, 1024)
"""Capacities tried on the CPU unless told otherwise: a GPU's range would take minutes per stage there."""

_REPORT = "profile.json"


def profiled_capacity(output_dir: str | Path) -> int | None:
    """The capacity a previous ``profile`` run chose for this output folder, if any."""
    path = Path(output_dir) / _REPORT
    if not path.is_file():
        return None
    return int(json.loads(path.read_text(encoding="utf-8"))["chosen_capacity"])


def with_profiled_capacity(config: TrainerConfig) -> TrainerConfig:
    """``config`` with ``scheduler.capacity: auto`` replaced by the profiled choice, when there is one.

    Without a ``profile.json`` in the output folder the config is returned unchanged (``auto`` then
    means the scheduler's default).
    """
    if config.scheduler.capacity != "auto":
        return config
    chosen = profiled_capacity(config.output_dir)
    if chosen is None:
        return config
    scheduler = config.scheduler.model_validate({**config.scheduler.model_dump(), "capacity": chosen})
    return config.model_copy(update={"scheduler": scheduler})


def profile_due(config: TrainerConfig, *, device_type: str, resume: bool) -> bool:
    """Whether ``train`` profiles the model before it starts.

    It does on GPUs when ``capacity: auto`` has nothing to read yet: in a fresh run (a resumed one
    keeps its plan) whose output folder holds no ``profile.json``. On the CPU ``auto`` stays 4096
    (a GPU's range of token counts would take minutes there).
    """
    return (
        config.scheduler.capacity == "auto"
        and device_type == "cuda"
        and not resume
        and profiled_capacity(config.output_dir) is None
    )


def write_report(
    output_dir: Path,
    *,
    parallel: ParallelConfig,
    device: str,
    measurements: list[Measurement],
    cost: Any,
    chosen: int,
    options: list[CapacityOption],
    out_of_memory_at: int | None = None,
) -> Path:
    """Write ``profile.json`` and ``profile.md``; returns the JSON's path.

    ``out_of_memory_at``: the smallest measured token count that ran out of memory on some stage.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "device": device,
        "pipeline_stages": parallel.pipeline_stages,
        "data_parallel": parallel.data_parallel,
        "measurements": [asdict(m) for m in measurements],
        "out_of_memory_at": out_of_memory_at,
        "cost_model": cost.model_dump(mode="json"),
        "candidates": [asdict(o) for o in options],
        "chosen_capacity": chosen,
    }
    path = output_dir / _REPORT
    write_json_atomically(path, document)
    lines = [
        f"# Profile: {parallel.pipeline_stages} stage(s) x {parallel.data_parallel} replica(s) on {device}",
        "",
        "| stage | tokens | forward ms | backward ms | peak GiB |",
        "|---:|---:|---:|---:|---:|",
    ]
    for m in measurements:
        peak = f"{m.peak_bytes / 2**30:.2f}" if m.peak_bytes is not None else "-"
        lines.append(f"| {m.stage} | {m.tokens} | {m.forward_s * 1e3:.2f} | {m.backward_s * 1e3:.2f} | {peak} |")
    if out_of_memory_at is not None:
        lines += [
            "",
            f"A microbatch of {out_of_memory_at} tokens ran out of device memory: larger ones were not measured.",
        ]
    one_count = len({m.tokens for m in measurements}) < 2
    lines += [
        "",
        f"Cost model: forward = {cost.forward_fixed_s * 1e3:.3f} ms + "
        f"{cost.forward_per_token_s * 1e6:.3f} us x tokens; "
        f"backward = {cost.backward_factor:.2f} x forward; stage factors {cost.stage_factors}."
        + (
            " One token count was measured, so the forward time is taken as the same for every count "
            "and the peak memory too: measure two or more (--capacities) to compare capacities."
            if one_count
            else ""
        ),
        "",
        "| capacity | predicted peak GiB | fits | microbatches | simulated bubble | simulated tokens/s |",
        "|---:|---:|:---:|---:|---:|---:|",
    ]
    for o in options:
        ran_out = out_of_memory_at is not None and o.capacity >= out_of_memory_at
        peak = f"{o.peak_bytes / 2**30:.2f}" if o.peak_bytes is not None and not ran_out else "-"
        fits = "no (out of memory)" if ran_out else "yes" if o.fits else "no"
        numbers = ("-", "-") if ran_out else (f"{o.bubble_ratio:.1%}", f"{o.tokens_per_s:,.0f}")
        mark = " (chosen)" if o.capacity == chosen else ""
        lines.append(f"| {o.capacity}{mark} | {peak} | {fits} | {o.microbatches} | {numbers[0]} | {numbers[1]} |")
    write_text_atomically(output_dir / "profile.md", "\n".join(lines) + "\n")
    return path


def default_candidates(device_type: str, padding_multiple: int) -> tuple[int, ...]:
    """The capacities profiled when none are given, rounded up to multiples of ``padding_multiple``.

    :data:`DEFAULT_CANDIDATES` on CUDA, else :data:`CPU_CANDIDATES`.
    """
    base = DEFAULT_CANDIDATES if device_type == "cuda" else CPU_CANDIDATES
    return tuple(sorted({-(-c // padding_multiple) * padding_multiple for c in base}))


def profile_rank(
    config: TrainerConfig,
    parallel: ParallelConfig,
    *,
    candidates: tuple[int, ...] | None = None,
    sample_length: int = 1024,
    repeats: int = 3,
    memory_fraction: float = 0.9,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> dict[str, Any] | None:
    """Profile ``config``'s model on this rank's stage; rank 0 writes and returns the report.

    Args:
        config: The run (model, jobs, padding multiple).
        parallel: Stages and replicas (only replica 0 measures; the others wait).
        candidates: Capacities to measure and compare; default :func:`default_candidates` for the
            device (1k to 32k tokens on GPUs, 128 to 1k on the CPU).
        sample_length: Tokens per sample in the synthetic microbatches.
        repeats: Timed runs per token count.
        memory_fraction: Share of a GPU's memory a plan may use.
        backend: ``nccl`` or ``gloo``.
        init_method: Rendezvous URL when not under torchrun.
        rank: Global rank (with ``init_method``).
        world_size: Processes (with ``init_method``).

    Returns:
        The report document on rank 0, else ``None``.
    """
    import torch
    import torch.distributed as dist

    from lorafusion_megatron.model import load_model_config
    from lorafusion_megatron.pipeline.groups import parallel_layout
    from lorafusion_megatron.pipeline.partition import partition_model
    from lorafusion_megatron.pipeline.stage_model import build_stage_model
    from lorafusion_megatron.profiler.capacity import choose_capacity
    from lorafusion_megatron.profiler.fit import fit_cost_model
    from lorafusion_megatron.profiler.measure import measure_stage
    from lorafusion_megatron.trainer import prepare_data
    from lorafusion_sched.models import AdapterJob

    with parallel_layout(
        parallel.pipeline_stages, backend=backend, init_method=init_method, rank=rank, world_size=world_size
    ) as layout:
        if candidates is None:
            candidates = default_candidates(layout.device.type, config.scheduler.padding_multiple)
            if layout.device.type != "cuda" and layout.rank == 0:
                _log.warning(
                    "profiling on the CPU: capacities %s tokens (a GPU's default is %s..%s); pass --capacities N ... "
                    "to measure others",
                    ", ".join(map(str, candidates)),
                    DEFAULT_CANDIDATES[0],
                    DEFAULT_CANDIDATES[-1],
                )
        spec = partition_model(load_model_config(config.base_model).to_dict(), layout.num_stages)[layout.stage]
        measured: StageMeasurements | None = None
        if layout.replica == 0:
            stage = build_stage_model(config, spec, layout.device)
            measured = measure_stage(stage, candidates, sample_length=sample_length, repeats=repeats)
        everyone: list[Any] = [None] * layout.world_size
        dist.all_gather_object(everyone, measured)
        if layout.rank != 0:
            return None
        stages: list[StageMeasurements] = [part for part in everyone if part is not None]
        out_of_memory_at = min((p.out_of_memory_at for p in stages if p.out_of_memory_at is not None), default=None)
        # Every stage measured every count below the smallest one that ran out of memory anywhere.
        measurements = sorted(
            (
                m
                for part in stages
                for m in part.measurements
                if out_of_memory_at is None or m.tokens < out_of_memory_at
            ),
            key=lambda m: (m.stage, m.tokens),
        )
        if not measurements:
            raise TrainerError(
                f"a microbatch of {min(candidates)} tokens, the smallest capacity profiled, runs out of device memory: "
                "profile smaller ones (--capacities) or split the model over more pipeline stages"
            )
        cost = fit_cost_model(measurements)
        scheduler = config.scheduler.model_copy(update={"capacity": max(candidates)})
        data = prepare_data(config.model_copy(update={"scheduler": scheduler})).jobs
        jobs = [
            AdapterJob(name=n, sample_tokens=j.sample_tokens, global_batch_size=j.global_batch_size)
            for n, j in data.items()
        ]
        limit = None
        if layout.device.type == "cuda":
            limit = memory_fraction * torch.cuda.get_device_properties(layout.device).total_memory
        chosen, options = choose_capacity(
            jobs,
            cost,
            measurements,
            candidates=candidates,
            stages=layout.num_stages,
            data_parallel=layout.num_replicas,
            padding_multiple=config.scheduler.padding_multiple,
            memory_limit_bytes=limit,
            out_of_memory_at=out_of_memory_at,
        )
        device = torch.cuda.get_device_name(layout.device) if layout.device.type == "cuda" else "cpu"
        path = write_report(
            Path(config.output_dir),
            parallel=parallel,
            device=device,
            measurements=measurements,
            cost=cost,
            chosen=chosen,
            options=options,
            out_of_memory_at=out_of_memory_at,
        )
        document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return document
