"""``lorafusion-megatron profile``: every rank measures its own stage, rank 0 models and chooses.

Writes ``<output_dir>/profile.json`` (measurements, the cost model through them, every candidate
capacity's predicted memory and simulated throughput, the choice) and ``profile.md``, the same as a
readable table. :func:`with_profiled_choices` reads the choice back, for ``capacity: auto`` and
``activation_checkpointing: auto``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.config import nearest_multiples
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.run_layout import PROFILE_REPORT, PROFILE_TABLE

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.pipeline.partition import StageSpec
    from lorafusion_megatron.pipeline.stage_model import StageModel
    from lorafusion_megatron.profiler.capacity import CapacityOption
    from lorafusion_megatron.profiler.measure import Measurement, StageMeasurements
    from lorafusion_megatron.profiler.recompute import RecomputeModel
    from lorafusion_sched.models import CostModel

__all__ = [
    "CPU_CANDIDATES",
    "DEFAULT_CANDIDATES",
    "MAX_CANDIDATE",
    "checked_candidates",
    "default_candidates",
    "profile_due",
    "profile_rank",
    "profiled_capacity",
    "profiled_cost_model",
    "with_profiled_choices",
    "write_report",
]

_log = logging.getLogger(__name__)

DEFAULT_CANDIDATES = (1024, 2048, 4096, 8192, 16384, 32768)
"""Capacities tried (and token counts measured) on GPUs unless told otherwise."""

CPU_CANDIDATES = (128, 256, 512, 1024)
"""Capacities tried on the CPU unless told otherwise: a GPU's range would take minutes per stage there."""

MAX_CANDIDATE = 1 << 20
"""The largest capacity ``--capacities`` takes: 32 times the GPU default's largest, far past any GPU's
memory for a real model (a larger one was allocated until the host killed the process)."""


def checked_candidates(candidates: list[int], padding_multiple: int) -> tuple[int, ...]:
    """``--capacities``, checked before any process starts: sorted, each once.

    Raises:
        TrainerError: a capacity below 1, above :data:`MAX_CANDIDATE`, or not a multiple of
            ``padding_multiple`` (the message names the nearest multiples).
    """
    for capacity in candidates:
        if not 1 <= capacity <= MAX_CANDIDATE:
            raise TrainerError(f"--capacities {capacity}: give token counts from 1 to {MAX_CANDIDATE:,}")
        if capacity % padding_multiple:
            raise TrainerError(
                f"--capacities {capacity} is not a multiple of scheduler.padding_multiple = {padding_multiple}: "
                f"{nearest_multiples(capacity, padding_multiple)}"
            )
    return tuple(sorted(set(candidates)))


def _report(output_dir: str | Path) -> dict[str, Any] | None:
    """The ``profile.json`` of this output folder, if a previous ``profile`` run wrote one."""
    path = Path(output_dir) / PROFILE_REPORT
    if not path.is_file():
        return None
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


def profiled_capacity(output_dir: str | Path) -> int | None:
    """The capacity a previous ``profile`` run chose for this output folder, if any."""
    report = _report(output_dir)
    return None if report is None else int(report["chosen_capacity"])


def profiled_cost_model(config: TrainerConfig, pipeline_stages: int) -> CostModel | None:
    """The cost model of a previous ``profile`` run in this output folder, for the planner's splits.

    The planner uses it to decide whether a global batch that runs alone goes faster in microbatches
    smaller than the capacity. It is the model ``profile`` simulated the capacities with, the
    measured times point by point (:func:`~lorafusion_megatron.profiler.fit.measured_cost_model`),
    made again from the report's measurements (a report of an earlier version holds a line). With
    the recomputed layers ``profile`` chose (``activation_checkpointing: auto``, resolved by
    :func:`with_profiled_choices`) the backward is the one those counts give at the capacity.

    Returns:
        ``None`` without a ``profile.json``, or with one measured on another number of pipeline
        stages (its stage times are for another partition of the layers).

    Raises:
        TrainerError: the ``profile.json`` has no measurements that make a model (e.g. edited by hand).
    """
    from lorafusion_megatron.profiler.fit import measured_cost_model
    from lorafusion_megatron.profiler.measure import Measurement
    from lorafusion_megatron.profiler.recompute import RecomputeModel, adjusted_cost

    report = _report(config.output_dir)
    if report is None or report.get("pipeline_stages") != pipeline_stages:
        return None
    try:
        cost = measured_cost_model([Measurement(**m) for m in report["measurements"]])
    except (KeyError, TypeError, ValueError) as exc:
        raise TrainerError(
            f"{Path(config.output_dir) / PROFILE_REPORT} holds no usable measurements ({exc}): "
            "run `lorafusion-megatron profile` again, or remove the file"
        ) from None
    if cost.stage_factors is not None and len(cost.stage_factors) != pipeline_stages:
        # A stage that ran out of memory at every count measured nothing, and has no factor.
        cost = cost.model_copy(update={"stage_factors": None})
    models, counts = report.get("recompute_models"), report.get("chosen_recomputed_layers")
    if models is not None and counts is not None and config.runtime.activation_checkpointing == counts:
        stages = [
            RecomputeModel(
                **{**m, "bytes_per_token": math.inf if m["bytes_per_token"] is None else m["bytes_per_token"]}
            )
            for m in models
        ]
        cost = adjusted_cost(cost, stages, counts, config.scheduler.resolved_capacity)
    return cost


def with_profiled_choices(config: TrainerConfig) -> TrainerConfig:
    """``config`` with its ``auto`` capacity and activation checkpointing replaced by the profiled choices.

    Without a ``profile.json`` in the output folder (or one profiled without ``auto`` checkpointing)
    that key stays ``auto``: the scheduler's default capacity, every layer recomputed.
    """
    report = _report(config.output_dir)
    if report is None:
        return config
    if config.scheduler.capacity == "auto":
        chosen = int(report["chosen_capacity"])
        scheduler = config.scheduler.model_validate({**config.scheduler.model_dump(), "capacity": chosen})
        config = config.model_copy(update={"scheduler": scheduler})
    if config.runtime.activation_checkpointing == "auto":
        counts = report.get("chosen_recomputed_layers")
        if counts is not None:
            recomputed = [int(count) for count in counts]
            runtime = config.runtime.model_validate(
                {**config.runtime.model_dump(), "activation_checkpointing": recomputed}
            )
            config = config.model_copy(update={"runtime": runtime})
    return config


def profile_due(config: TrainerConfig, *, device_type: str, resume: bool) -> bool:
    """Whether ``train`` profiles the model before it starts.

    It does on GPUs when ``capacity: auto`` or ``activation_checkpointing: auto`` has nothing to read
    yet: in a fresh run (a resumed one keeps its plan) whose output folder holds no
    ``profile.json``. On the CPU ``auto`` stays 4096 tokens and every layer recomputed (a GPU's
    range of token counts would take minutes there).
    """
    wants = config.scheduler.capacity == "auto" or config.runtime.activation_checkpointing == "auto"
    return wants and device_type == "cuda" and not resume and profiled_capacity(config.output_dir) is None


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
    recompute: list[RecomputeModel] | None = None,
) -> Path:
    """Write ``profile.json`` and ``profile.md``; returns the JSON's path.

    ``out_of_memory_at``: the smallest measured token count that ran out of memory on some stage.
    ``recompute``: the stages' models with ``activation_checkpointing: auto`` (the measurements are
    then those with every layer recomputed).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    chosen_option = next(o for o in options if o.capacity == chosen)
    document = {
        "device": device,
        "pipeline_stages": parallel.pipeline_stages,
        "data_parallel": parallel.data_parallel,
        "measurements": [asdict(m) for m in measurements],
        "out_of_memory_at": out_of_memory_at,
        "cost_model": cost.model_dump(mode="json"),
        # A stage that could not keep any layer's activations holds "infinite" bytes: null in JSON.
        "recompute_models": None
        if recompute is None
        else [
            {**asdict(r), "bytes_per_token": None if math.isinf(r.bytes_per_token) else r.bytes_per_token}
            for r in recompute
        ],
        "candidates": [asdict(o) for o in options],
        "chosen_capacity": chosen,
        "chosen_recomputed_layers": chosen_option.recomputed_layers,
    }
    path = output_dir / PROFILE_REPORT
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
    if recompute is not None:
        lines += [
            "",
            "Measured with every layer recomputed. A layer that keeps its activations instead:",
            "",
            "| stage | layers | MiB per 1,000 tokens held | backward ms saved per 1,000 tokens |",
            "|---:|---:|---:|---:|",
        ]
        for r in recompute:
            held = f"{r.bytes_per_token * 1000 / 2**20:.1f}" if not math.isinf(r.bytes_per_token) else "(no fit)"
            lines.append(f"| {r.stage} | {r.layers} | {held} | {r.seconds_per_token * 1e6:.2f} |")
    if out_of_memory_at is not None:
        lines += [
            "",
            f"A microbatch of {out_of_memory_at} tokens ran out of device memory: larger ones were not measured.",
        ]
    one_count = len({m.tokens for m in measurements}) < 2
    points = ", ".join(f"{n}: {seconds * 1e3:.2f} ms" for n, seconds in cost.forward_points)
    factors = "none" if cost.stage_factors is None else ", ".join(f"{f:.3f}" for f in cost.stage_factors)
    lines += [
        "",
        f"Cost model: forward per stage = the stage's factor x the measured forward, interpolated between "
        f"{points} (line through them: {cost.forward_fixed_s * 1e3:.3f} ms + {cost.forward_per_token_s * 1e6:.3f} us "
        f"x tokens); backward = {cost.backward_factor:.2f} x forward; stage factors {factors}. Each capacity is "
        "planned as `train` plans it, with this model (lone global batches split where that is faster)."
        + (
            " One token count was measured, so the peak memory is taken as the same for every count: "
            "measure two or more (--capacities) to compare capacities."
            if one_count
            else ""
        ),
        "",
        "| capacity | predicted peak GiB | fits | microbatches | simulated bubble | simulated tokens/s |"
        + (" recomputed layers per stage |" if recompute is not None else ""),
        "|---:|---:|:---:|---:|---:|---:|" + ("---|" if recompute is not None else ""),
    ]
    for o in options:
        ran_out = out_of_memory_at is not None and o.capacity >= out_of_memory_at
        peak = f"{o.peak_bytes / 2**30:.2f}" if o.peak_bytes is not None and not ran_out else "-"
        fits = "no (out of memory)" if ran_out else "yes" if o.fits else "no"
        numbers = ("-", "-") if ran_out else (f"{o.bubble_ratio:.1%}", f"{o.tokens_per_s:,.0f}")
        mark = " (chosen)" if o.capacity == chosen else ""
        row = f"| {o.capacity}{mark} | {peak} | {fits} | {o.microbatches} | {numbers[0]} | {numbers[1]} |"
        if recompute is not None:
            row += f" {', '.join(map(str, o.recomputed_layers)) if o.recomputed_layers and not ran_out else '-'} |"
        lines.append(row)
    write_text_atomically(output_dir / PROFILE_TABLE, "\n".join(lines) + "\n")
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
    from lorafusion_megatron.profiler.fit import measured_cost_model
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
        specs = partition_model(load_model_config(config.base_model).to_dict(), layout.num_stages)
        auto = config.runtime.activation_checkpointing == "auto"
        measured: tuple[StageMeasurements, StageMeasurements | None] | None = None
        if layout.replica == 0:
            # With `auto` the stage recomputes every layer here (`recomputed_layers`), then none.
            stage = build_stage_model(config, specs[layout.stage], layout.device)
            with_all = measure_stage(stage, candidates, sample_length=sample_length, repeats=repeats)
            kept = _without_recomputation(stage, with_all, sample_length, repeats) if auto else None
            measured = (with_all, kept)
        everyone: list[Any] = [None] * layout.world_size
        dist.all_gather_object(everyone, measured)
        if layout.rank != 0:
            return None
        stages: list[StageMeasurements] = [part[0] for part in everyone if part is not None]
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
        cost = measured_cost_model(measurements)
        scheduler = config.scheduler.model_copy(update={"capacity": max(candidates)})
        data = prepare_data(config.model_copy(update={"scheduler": scheduler})).jobs
        jobs = [
            AdapterJob(name=n, sample_tokens=j.sample_tokens, global_batch_size=j.global_batch_size)
            for n, j in data.items()
        ]
        limit = None
        if layout.device.type == "cuda":
            limit = memory_fraction * torch.cuda.get_device_properties(layout.device).total_memory
        recompute = None
        if auto:
            kept_parts = [part[1] for part in everyone if part is not None]
            recompute = [_recompute_model(spec, stages[spec.stage], kept_parts[spec.stage]) for spec in specs]
        fixed = config.scheduler.capacity
        chosen, options = choose_capacity(
            jobs,
            cost,
            measurements,
            # A fixed capacity with `auto` checkpointing: only the counts of recomputed layers are chosen.
            candidates=(fixed,) if auto and fixed != "auto" else candidates,
            stages=layout.num_stages,
            data_parallel=layout.num_replicas,
            padding_multiple=config.scheduler.padding_multiple,
            memory_limit_bytes=limit,
            out_of_memory_at=out_of_memory_at,
            recompute=recompute,
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
            recompute=recompute,
        )
        document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return document


def _without_recomputation(
    stage: StageModel, with_all: StageMeasurements, sample_length: int, repeats: int
) -> StageMeasurements:
    """``stage`` measured again with no layer recomputed, at the token counts that fit with all of them."""
    from lorafusion_megatron.profiler.measure import measure_stage

    every_layer = stage.recomputed_layers
    stage.recomputed_layers = 0
    try:
        counts = [m.tokens for m in with_all.measurements]
        return measure_stage(stage, counts, sample_length=sample_length, repeats=repeats)
    finally:
        stage.recomputed_layers = every_layer


def _recompute_model(spec: StageSpec, with_all: StageMeasurements, kept: StageMeasurements) -> RecomputeModel:
    """The stage's :class:`RecomputeModel` from its largest token count measured both ways.

    A stage that ran out of memory at every count without recomputation gets a model that never
    fits a kept layer (it recomputes all of them).
    """
    from lorafusion_megatron.profiler.recompute import RecomputeModel, fit_recompute

    both = {m.tokens: m for m in with_all.measurements}
    common = [m for m in kept.measurements if m.tokens in both]
    if not common:
        return RecomputeModel(
            stage=spec.stage, layers=len(spec.layers), bytes_per_token=math.inf, seconds_per_token=0.0
        )
    largest = common[-1]
    return fit_recompute(both[largest.tokens], largest, len(spec.layers))
