"""``lorafusion-megatron``: validate, plan, train, demo and export.

``validate`` needs no GPU, and no torch unless ``runtime.device`` is ``cuda`` (then it asks torch
for a GPU); what this host lacks it prints as warnings (:mod:`lorafusion_megatron.host_checks`).
Every command turns a :class:`TrainerError` into one clear message and exit status 2 (1 for an
interrupted run that wrote a checkpoint, 3 with a traceback for any other error: a bug, or a host
failure that no check names). SIGTERM is taken like Ctrl-C (:mod:`lorafusion_megatron.interrupts`).
In training the first one stops at a checkpoint (status 1) or, once the plan is done, lets the final
adapters be written first (status 128 + the signal in one process; a pipeline run then exits 0);
anywhere else, and a second one in training, stops at once: staging folders and temporary files
are deleted on the way out (not those of pipeline ranks that a second signal kills), one line says
so, and the status is 128 + the signal (130 for Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from lorafusion_megatron.__about__ import __version__
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.interrupts import signal_of, sigterm_interrupts
from lorafusion_megatron.pipeline.commands import add_parallel_arguments, at_least_one, parallel_from_args
from lorafusion_megatron.run_layout import CHECKPOINTS

__all__ = ["main"]

_console = Console(stderr=True)


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    from lorafusion_megatron.config_yaml import UniqueKeyLoader

    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise TrainerError(f"--set {pair!r}: write KEY=VALUE, e.g. --set jobs.0.learning_rate=2e-4")
        try:
            parsed[key] = yaml.load(value, Loader=UniqueKeyLoader)  # a SafeLoader subclass: YAML 1.2's scalars
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise TrainerError(
                f"--set {pair!r}: the value is not valid YAML ({problem}): close its brackets, or put text in "
                f"quotes (--set '{key}=\"...\"')"
            ) from None
    return parsed


def _load(args: argparse.Namespace) -> Any:
    from lorafusion_megatron.checks import check_config
    from lorafusion_megatron.config import load_config

    config = load_config(args.config, _overrides(args.set))
    check_config(
        config, source=str(args.config), pipeline_stages=parallel_from_args(args, config.parallel).pipeline_stages
    )
    return config


def _warn(message: str) -> None:
    _console.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def _cmd_validate(args: argparse.Namespace) -> int:
    from lorafusion_megatron.host_checks import host_warnings

    config = _load(args)
    for warning in host_warnings(config):
        _warn(warning)
    table = Table(title=f"{args.config}: valid")
    for header in ("job", "dataset", "r / alpha", "lr", "batch", "length"):
        table.add_column(header)
    for job in config.jobs:
        length = f"{job.max_steps} steps" if job.max_steps is not None else f"{job.num_train_epochs} epoch(s)"
        source = Path(job.dataset.path).name if job.dataset.path else f"synthetic {job.dataset.synthetic}"
        table.add_row(
            job.name,
            source,
            f"{job.r} / {job.lora_alpha}",
            f"{job.learning_rate:g}",
            str(job.global_batch_size),
            length,
        )
    Console().print(table)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from lorafusion_megatron.atomic_files import write_text_atomically
    from lorafusion_megatron.plan_output import check_plan_output
    from lorafusion_megatron.planning import make_plan
    from lorafusion_megatron.profiler.run import profiled_cost_model, with_profiled_choices
    from lorafusion_megatron.trainer import prepare_data
    from lorafusion_sched import simulate
    from lorafusion_sched.models import CostModel

    config = _load(args)
    if args.output is not None:
        check_plan_output(args.output, config, args.config)
    parallel = parallel_from_args(args, config.parallel)
    config = with_profiled_choices(config)
    if config.scheduler.capacity == "auto":
        _console.print(
            f"scheduler.capacity is auto and the output folder holds no profile.json: planned at "
            f"{config.scheduler.resolved_capacity} tokens (`train` on a GPU profiles first and may choose another)"
        )
    plan = make_plan(
        config,
        prepare_data(config).jobs,
        pipeline_stages=parallel.pipeline_stages,
        data_parallel=parallel.data_parallel,
    )
    if args.output is not None:
        write_text_atomically(Path(args.output), plan.model_dump_json(indent=1))
    stats = plan.stats
    table = Table(title=f"Plan for {Path(args.config).name} (capacity {plan.capacity} tokens)")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in (
        ("microbatches", f"{stats.num_microbatches}"),
        ("lower bound", f"{stats.lower_bound}"),
        ("no-ops", f"{stats.num_noops}"),
        ("fill (padded tokens / capacity)", f"{stats.fill_ratio:.1%}"),
        ("MILP wins / runs", f"{stats.milp_wins} / {stats.milp_runs}"),
        ("lone global batches split (profile's cost model)", f"{stats.split_batches}"),
        ("planning seconds", f"{stats.solve_seconds:.2f}"),
    ):
        table.add_row(name, value)
    for adapter in plan.adapters:
        table.add_row(
            f"{adapter.name}: samples / optimizer steps", f"{adapter.num_samples} / {adapter.num_global_batches}"
        )
    Console().print(table)
    cost = profiled_cost_model(config, parallel.pipeline_stages)
    if cost is not None:
        title = "Simulated with the cost model of the output folder's profile.json (as planned)"
    else:
        factors = None
        if parallel.pipeline_stages > 1:
            from lorafusion_megatron.model import load_model_config
            from lorafusion_megatron.pipeline.partition import recomputed_layers, stage_cost_factors

            model_config = load_model_config(config.base_model).to_dict()
            stages = parallel.pipeline_stages
            recomputed = recomputed_layers(model_config, stages, config.runtime.activation_checkpointing)
            factors = stage_cost_factors(model_config, stages, recomputed)
        stages_note = "" if factors is None else ", stages weighted by the layer partition's costs and recomputation"
        title = f"Simulated with the scheduler's default cost model{stages_note} (ratios matter, not seconds)"
        cost = CostModel(stage_factors=factors)
    simulated = Table(title=title)
    for header in ("schedule", "bubble ratio", "tokens/s", "lorafusion speedup"):
        simulated.add_column(header, justify="left" if header == "schedule" else "right")
    runs = simulate(plan, cost).runs
    for run in runs:
        speedup = runs[0].tokens_per_s / run.tokens_per_s if run.tokens_per_s else 0.0
        simulated.add_row(run.name, f"{run.bubble_ratio:.1%}", f"{run.tokens_per_s:,.0f}", f"{speedup:.2f}x")
    Console().print(simulated)
    return 0


def _resume_command(args: argparse.Namespace) -> str:
    """The user's own ``train`` command line with ``--resume`` (and without ``--overwrite``), quoted for a shell."""
    words = [word for word in args.argv if word != "--overwrite"]
    return shlex.join(["lorafusion-megatron", *words, *([] if "--resume" in words else ["--resume"])])


def _after_interrupt(args: argparse.Namespace) -> str:
    """The rest of the line that an interrupt prints: what it left, and the command that goes on from there.

    ``--resume`` is named only where a checkpoint exists to continue from: one that came before the
    first checkpoint (while the data was tokenised or the model loaded) leaves none.
    """
    if args.handler is _cmd_train:
        again = shlex.join(["lorafusion-megatron", *(word for word in args.argv if word != "--resume")])
        return _run_to_continue(_checkpoint_dir(args), again=again, resume=_resume_command(args))
    if args.handler is not _cmd_demo:
        return ": outputs are written whole or not at all, so none was left half-written"
    output = Path(args.output).resolve()
    if not (output / "demo.yaml").is_file():  # renamed into place with the rest, once all is written
        again = shlex.join(["lorafusion-megatron", *args.argv])
        return f" before the demo was built: its half-built files were deleted, so `{again}` builds it afresh"
    train = ["lorafusion-megatron", "train", str(output / "demo.yaml"), *_parallel_flags(args)]
    return _run_to_continue(output / CHECKPOINTS, again=shlex.join(train), resume=shlex.join([*train, "--resume"]))


def _run_to_continue(checkpoint_dir: Path | None, *, again: str, resume: str) -> str:
    """How a run stopped at once goes on: ``resume`` from its newest checkpoint, else ``again`` from the start."""
    from lorafusion_megatron.checkpoint import latest_checkpoint

    newest = None if checkpoint_dir is None else latest_checkpoint(checkpoint_dir)
    if newest is None:
        return f" at once; no checkpoint was written, so there is nothing to resume: `{again}` starts the run again"
    return f" at once: checkpoints are written whole or not at all, so {newest} is intact; `{resume}` continues from it"


def _checkpoint_dir(args: argparse.Namespace) -> Path | None:
    """The checkpoint folder of ``train``'s config, read again; ``None`` where it cannot be read (no run started)."""
    from lorafusion_megatron.config import load_config

    try:
        return load_config(args.config, _overrides(args.set)).checkpoint_dir
    except TrainerError:
        return None


def _parallel_flags(args: argparse.Namespace) -> list[str]:
    """The parallelism flags given on the command line, as words (a pipeline run resumes only with the same)."""
    words = []
    for key in ("pipeline_stages", "data_parallel", "schedule", "baseline_microbatch_samples"):
        value = getattr(args, key, None)
        if value is not None:
            words += [f"--{key.replace('_', '-')}", str(value)]
    return words


def _cmd_train(args: argparse.Namespace) -> int:
    from lorafusion_megatron.adapters_io import check_fresh_run, check_run_outputs, earlier_runs_adapters
    from lorafusion_megatron.host_checks import tensorboard_missing
    from lorafusion_megatron.model import resolve_device
    from lorafusion_megatron.pipeline.launch import under_torchrun
    from lorafusion_megatron.profiler.run import profile_due

    config = _load(args)
    missing = tensorboard_missing(config.logging.tensorboard_dir)
    if missing is not None:
        # Said here, before the data and the model load, rather than when the first scalar is due;
        # the run goes on without TensorBoard as before, and no process of it says so again.
        _warn(missing)
        config = config.model_copy(update={"logging": config.logging.model_copy(update={"tensorboard_dir": None})})
    parallel = parallel_from_args(args, config.parallel)
    config.check_evaluation_supported(parallel, under_torchrun=under_torchrun())
    check_fresh_run(config, resume=args.resume, overwrite=args.overwrite)
    stale = earlier_runs_adapters(config) if args.overwrite and not args.resume else []
    if stale:
        _warn(
            f"{', '.join(map(str, stale))} hold(s) an earlier run's adapter that none of this run's jobs writes: "
            "--overwrite leaves it as it is, beside this run's adapters (delete it if it is not wanted)"
        )
    device_type = resolve_device(config.runtime.device).type
    # Under torchrun the ranks are already started: profiling needs its own launch (`profile` first).
    if not under_torchrun() and profile_due(config, device_type=device_type, resume=args.resume):
        from lorafusion_megatron.pipeline import commands

        check_run_outputs(config)
        _console.print(
            "scheduler.capacity is auto and the output folder holds no profile.json: profiling the model first "
            "(once per output folder; give scheduler.capacity a number to skip)"
        )
        commands.profile(config, parallel, _console)
    if parallel.needs_pipeline_runtime or under_torchrun():
        from lorafusion_megatron.pipeline import commands

        return commands.train(config, parallel, _console, resume=args.resume, resume_command=_resume_command(args))
    from lorafusion_megatron.trainer import Trainer

    trainer = Trainer(config, console=_console, resume_command=_resume_command(args))
    return trainer.train(resume=args.resume, overwrite=args.overwrite).exit_status


def _cmd_profile(args: argparse.Namespace) -> int:
    from lorafusion_megatron.pipeline import commands

    config = _load(args)
    parallel = parallel_from_args(args, config.parallel)
    return commands.profile(config, parallel, _console, candidates=args.capacities)


def _cmd_demo(args: argparse.Namespace) -> int:
    from lorafusion_megatron.adapters_io import holds_files

    output = Path(args.output)
    if output.is_file() or holds_files(output):
        raise TrainerError(
            f"--output {output} is not an empty folder: the demo writes base/, data/, demo.yaml and adapters/ "
            "there; choose a new folder, or delete that one"
        )
    parallel = parallel_from_args(args)
    if parallel.needs_pipeline_runtime:
        from lorafusion_megatron.pipeline import commands

        return commands.demo(output, parallel, _console, samples_per_job=args.samples_per_job, epochs=args.epochs)
    from lorafusion_megatron.demo import build_demo
    from lorafusion_megatron.trainer import Trainer

    _console.print(f"Building the demo in {output}: tiny LLaMA with random weights, 4 jobs, CPU")
    config = build_demo(output, samples_per_job=args.samples_per_job, epochs=args.epochs)
    resume = shlex.join(["lorafusion-megatron", "train", str(output / "demo.yaml"), "--resume"])
    result = Trainer(config, console=_console, resume_command=resume).train()
    if not result.interrupted:
        _console.print(f"Adapters: {output / 'adapters'}; config: {output / 'demo.yaml'}")
    return result.exit_status


def _cmd_export(args: argparse.Namespace) -> int:
    from lorafusion_megatron.export import merge_adapter

    target = merge_adapter(
        Path(args.adapter), Path(args.output), base=args.base, dtype=args.dtype, overwrite=args.overwrite
    )
    _console.print(f"Merged model written to {target}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafusion-megatron",
        description="Train several LoRA jobs on one shared base model together (LoRAFusion).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    # -v after the command too (`train run.yaml -v`); SUPPRESS keeps the one given before it.
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_text, description=help_text, parents=[verbosity])

    def with_config(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = command(name, help_text)
        sub.add_argument("config", type=Path, help="the run's YAML file")
        sub.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a key, e.g. jobs.0.r=8 or jobs.chat.r=8",
        )
        return sub

    with_config(
        "validate", "check a config and what it points to (no GPU; no torch unless runtime.device is cuda)"
    ).set_defaults(handler=_cmd_validate)
    plan = with_config("plan", "dry run: plan the microbatches and print the plan's statistics")
    plan.add_argument(
        "-o",
        "--output",
        type=Path,
        help="also write the plan JSON here (replaces a plan file; never the config, a dataset or a run folder)",
    )
    add_parallel_arguments(plan)
    plan.set_defaults(handler=_cmd_plan)
    train = with_config("train", "train every job of the config together")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    train.add_argument(
        "--overwrite", action="store_true", help="let a fresh run replace an earlier run's adapters and summary"
    )
    add_parallel_arguments(train)
    train.set_defaults(handler=_cmd_train)
    profile = with_config(
        "profile", "measure each stage's forward/backward time and memory, fit the cost model, choose the capacity"
    )
    profile.add_argument(
        "--capacities",
        type=at_least_one,
        nargs="+",
        help="capacities to measure (default 1024..32768 on GPUs, 128..1024 on the CPU)",
    )
    add_parallel_arguments(profile)
    profile.set_defaults(handler=_cmd_profile)
    demo = command("demo", "4 jobs on a tiny random LLaMA, on the CPU, in under a minute")
    demo.add_argument("--output", required=True, type=Path, help="folder for the model, data, config and adapters")
    demo.add_argument("--samples-per-job", type=at_least_one, default=128, help="records per job (default 128)")
    demo.add_argument("--epochs", type=at_least_one, default=2, help="passes over each job's data (default 2)")
    add_parallel_arguments(demo)
    demo.set_defaults(handler=_cmd_demo)
    export = command("export", "merge an adapter into its base model's weights")
    export.add_argument("adapter", type=Path, help="a PEFT adapter folder written by train")
    export.add_argument("--output", required=True, type=Path, help="folder for the merged model")
    export.add_argument(
        "--base",
        help="base model folder (default: the adapter's base_model_name_or_path); a preset's random weights are "
        "not saved, so an adapter trained on one cannot be merged",
    )
    export.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    export.set_defaults(handler=_cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=_console, show_path=False, show_time=False)],
    )
    try:
        with sigterm_interrupts():
            status: int = args.handler(args)
    except TrainerError as exc:
        _console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM before training started, or a second one during it
        stopped_by = signal_of(exc)
        by = "" if stopped_by == signal.SIGINT else f" by {stopped_by.name}"
        _console.print(f"[bold red]interrupted[/]{by}{escape(_after_interrupt(args))}", highlight=False, soft_wrap=True)
        return 128 + stopped_by
    except Exception:  # a bug (or the host's): its own status, as 1 means "interrupted, checkpoint written"
        _console.print_exception()
        trains = args.handler in (_cmd_train, _cmd_demo)
        _console.print(
            "[bold red]crashed[/] (status 3). Checkpoints are written whole or not at all: "
            "`train ... --resume` continues from the newest one (if any) once the cause is fixed"
            if trains
            else "[bold red]crashed[/] (status 3). Outputs are written whole or not at all, so none was left "
            "half-written",
            highlight=False,
            soft_wrap=True,
        )
        return 3
    return status


if __name__ == "__main__":
    sys.exit(main())
