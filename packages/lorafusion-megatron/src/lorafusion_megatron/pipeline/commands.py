"""What the CLI's ``train``, ``profile`` and ``demo`` commands call for pipeline runs (torch-free import).

The CLI adds :func:`add_parallel_arguments` to those commands and hands the parsed values to
:func:`parallel_from_args`; :func:`train`, :func:`profile` and :func:`demo` print summary tables
and return the exit status.
"""

from __future__ import annotations

import argparse
import shlex
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from lorafusion_megatron.pipeline.options import SCHEDULES, ParallelConfig
from lorafusion_megatron.run_layout import PIPELINE_SUMMARY, PROFILE_TABLE

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig

__all__ = [
    "add_parallel_arguments",
    "at_least_one",
    "demo",
    "parallel_from_args",
    "profile",
    "report",
    "summary_table",
    "train",
]


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1 (refused before anything is written)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--pipeline-stages``, ``--data-parallel``, ``--schedule`` and ``--baseline-microbatch-samples``."""
    group = parser.add_argument_group("parallelism (default: the config's, else one process)")
    group.add_argument("--pipeline-stages", type=at_least_one, metavar="S", help="pipeline stages (one process each)")
    group.add_argument("--data-parallel", type=at_least_one, metavar="D", help="data-parallel replicas of the pipeline")
    group.add_argument("--schedule", choices=SCHEDULES, help="lorafusion (default) or a baseline")
    group.add_argument(
        "--baseline-microbatch-samples", type=at_least_one, metavar="N", help="samples per baseline microbatch"
    )


def parallel_from_args(args: argparse.Namespace, default: ParallelConfig | None = None) -> ParallelConfig:
    """``default`` (e.g. the config's section) with the flags given on the command line applied.

    Raises:
        pydantic.ValidationError: A value out of range (the parser's types refuse the flags' first).
    """
    values = (default or ParallelConfig()).model_dump()
    for key in ("pipeline_stages", "data_parallel", "schedule", "baseline_microbatch_samples"):
        given = getattr(args, key, None)
        if given is not None:
            values[key] = given
    return ParallelConfig.model_validate(values)


def summary_table(summary: dict[str, Any]) -> Table:
    """Throughput, bubble ratio per stage, and each job's steps and last loss."""
    table = Table(
        title=f"{summary['schedule']}: {summary['pipeline_stages']} stage(s) x {summary['data_parallel']} replica(s)"
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("tokens/s", f"{summary['tokens_per_second']:,.0f}")
    table.add_row("wall seconds", f"{summary['wall_seconds']:.1f}")
    for stage, bubble in enumerate(summary["bubble_ratio_per_stage"]):
        table.add_row(f"bubble ratio, stage {stage}", f"{bubble:.1%}")
    last: dict[str, dict[str, Any]] = {}
    for step in summary["steps"]:
        last[step["adapter"]] = step
    for adapter, step in last.items():
        table.add_row(f"{adapter}: steps / last loss", f"{step['step']} / {step['loss']:.4f}")
    return table


_RESUME = "lorafusion-megatron train CONFIG --resume (same parallel settings)"


def report(summary: dict[str, Any], output_dir: Path, console: Console, *, resume_command: str = _RESUME) -> int:
    """Print a run's summary: throughput, each job's counters and adapter; returns the exit status.

    A run stopped by Ctrl-C prints where it stopped and how to continue (``resume_command``), and returns 1.
    One whose signal came too late to stop it (``stopped_by``) is complete: that is said, and the status
    is ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM), as in the single-process trainer.
    """
    from lorafusion_megatron import reporting
    from lorafusion_megatron.state import RunState

    console.print(summary_table(summary))
    state = RunState.from_json(summary["run_state"])
    adapters = {name: Path(folder) for name, folder in summary["adapters"].items()}
    if summary["checkpoint"] is not None:
        console.print(
            f"Stopped at microbatch {summary['position']}/{summary['num_microbatches']}; "
            f"checkpoint: {summary['checkpoint']}"
        )
        console.print(f"Continue with: {resume_command}", soft_wrap=True, markup=False)
        return 1
    console.print(reporting.summary_table(state, adapters, output_dir))
    late = summary.get("stopped_by")
    if late is None:
        return 0
    console.print(
        f"{late} came as the run ended: every job's adapter and {PIPELINE_SUMMARY} were written first, "
        "so the run is complete (nothing to resume)"
    )
    return 128 + signal.Signals[late]


def train(
    config: TrainerConfig,
    parallel: ParallelConfig,
    console: Console,
    *,
    resume: bool = False,
    resume_command: str = _RESUME,
) -> int:
    """``lorafusion-megatron train [--resume]`` on ``parallel``; prints the summary on rank 0.

    Returns:
        0 when the run finished, 1 when Ctrl-C stopped it (after writing a checkpoint), ``128 +
        signal`` when a signal came too late to stop it (the run is complete).
    """
    from lorafusion_megatron.pipeline.launch import launch

    summary = launch(config, parallel, resume=resume)
    return 0 if summary is None else report(summary, Path(config.output_dir), console, resume_command=resume_command)


def profile(
    config: TrainerConfig, parallel: ParallelConfig, console: Console, *, candidates: list[int] | None = None
) -> int:
    """``lorafusion-megatron profile [--capacities N ...]``: measure, fit the cost model, choose the capacity."""
    from lorafusion_megatron.pipeline.launch import launch_profile
    from lorafusion_megatron.profiler.run import checked_candidates

    options: dict[str, Any] = {}
    if candidates:
        options["candidates"] = checked_candidates(candidates, config.scheduler.padding_multiple)
    report = launch_profile(config, parallel, **options)
    if report is not None:
        console.print((Path(config.output_dir) / PROFILE_TABLE).read_text(encoding="utf-8"), markup=False)
        console.print(f"Chosen capacity: {report['chosen_capacity']} tokens (used by `capacity: auto`)")
        if report["chosen_recomputed_layers"] is not None:
            counts = ", ".join(map(str, report["chosen_recomputed_layers"]))
            console.print(f"Recomputed layers per stage: {counts} (used by `activation_checkpointing: auto`)")
    return 0


def demo(output: Path, parallel: ParallelConfig, console: Console, *, samples_per_job: int, epochs: int) -> int:
    """``lorafusion-megatron demo --pipeline-stages S``: the demo on CPU processes over gloo."""
    from lorafusion_megatron.pipeline.launch import run_demo

    console.print(f"Building the demo in {output}: tiny LLaMA, 4 jobs, {parallel.world_size} CPU processes")
    summary = run_demo(
        output,
        parallel.pipeline_stages,
        samples_per_job=samples_per_job,
        epochs=epochs,
        schedule=parallel.schedule,
        data_parallel=parallel.data_parallel,
    )
    if summary is None:
        return 0
    resume = shlex.join(["lorafusion-megatron", "train", str(output / "demo.yaml"), "--resume"])  # parallel: in it
    status = report(summary, output, console, resume_command=resume)
    if status != 1:  # stopped with a checkpoint: the adapters are not written yet
        console.print(f"Adapters: {output / 'adapters'}; config: {output / 'demo.yaml'}")
    return status
