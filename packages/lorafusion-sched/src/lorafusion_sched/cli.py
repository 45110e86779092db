"""The ``lorafusion-sched`` command: plan, verify, simulate, demo.

Exit codes: 0 success, 1 the plan has violations, 2 bad input (the message, on standard error, says
what to change). Output paths are checked before any planning starts, and written atomically.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lorafusion_sched.__about__ import __version__
from lorafusion_sched.errors import InvalidPlanError, SchedError, SchedWarning
from lorafusion_sched.io import check_writable, describe_validation_error, load_jobs, load_plan, save_plan
from lorafusion_sched.models import (
    AdapterJob,
    CostModel,
    Plan,
    PlanOptions,
    RuntimeSettings,
    SimulationResult,
    Violation,
)
from lorafusion_sched.planner import plan as make_plan
from lorafusion_sched.simulate import simulate
from lorafusion_sched.verify import verify
from lorafusion_sched.workloads import WORKLOADS, synthetic_jobs

__all__ = ["main"]


_VIOLATIONS_SHOWN = 50
"""The most violations ``verify`` and ``simulate`` print one per line."""


def _plan_with_progress(
    jobs: list[AdapterJob], options: PlanOptions, console: Console, quiet: bool
) -> tuple[Plan, list[str]]:
    """The plan, and the warnings that planning raised (printed by the caller after the summary, not mid-bar)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SchedWarning)
        if quiet:
            plan = make_plan(jobs, options)
        else:
            columns = (
                TextColumn("[bold]packing global batches"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console, transient=True) as bar:
                task = bar.add_task("pack", total=None)

                def update(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                plan = make_plan(jobs, options, progress=update)
    return plan, [str(w.message) for w in caught]


def _print_warnings(messages: list[str]) -> None:
    """Each warning as one ``warning:`` line on standard error, unwrapped."""
    errors = Console(stderr=True, soft_wrap=True)
    for message in messages:
        errors.print(f"[bold yellow]warning:[/bold yellow] {escape(message)}", highlight=False)


def _print_violations(violations: Sequence[Violation], where: str, console: Console) -> None:
    """One line per violation, then the count; past :data:`_VIOLATIONS_SHOWN`, the first few of each kind.

    ``verify`` lists violations by kind of check, so the first 50 alone can all be of one kind (a
    reordered plan: 50 ``replica`` lines, its ``bubble_lemma`` ones unseen); each kind gets its share
    of the lines instead, and a count per kind ends the list.
    """
    kinds = Counter(v.kind for v in violations)
    per_kind = max(1, _VIOLATIONS_SHOWN // len(kinds)) if len(violations) > _VIOLATIONS_SHOWN else len(violations)
    taken: Counter[str] = Counter()
    shown = 0
    for v in violations:
        if taken[v.kind] < per_kind:
            taken[v.kind] += 1
            shown += 1
            # one line each, unwrapped (a path stays whole), for grep
            console.print(f"[red]violation[/red] {escape(str(v))}", highlight=False, soft_wrap=True)
    if shown < len(violations):
        console.print(f"... and {len(violations) - shown} more (at most {per_kind} of each kind shown)")
        console.print("by kind: " + ", ".join(f"{kind} {count}" for kind, count in kinds.most_common()))
    console.print(f"[red]{len(violations)} violation(s)[/red] in {escape(where)}", soft_wrap=True)


def _plan_table(plan: Plan) -> Table:
    s = plan.stats
    table = Table(title="plan", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    samples = sum(min(len(a.sample_tokens), a.num_global_batches * a.global_batch_size) for a in plan.adapters)
    table.add_row("adapters / samples", f"{len(plan.adapters)} / {samples:,}")
    table.add_row("groups (first phase)", escape("  ".join("+".join(g) for g in s.groups)))  # names are not markup
    share = f" ({s.num_noops / s.num_microbatches:.0%})" if s.num_noops else ""
    table.add_row("microbatches", f"{s.num_microbatches - s.num_noops:,} + {s.num_noops:,} no-ops{share}")
    over = (s.num_microbatches - s.num_noops) / s.lower_bound - 1 if s.lower_bound else 0.0
    table.add_row("lower bound", f"{s.lower_bound:,} ({over:+.1%}{', splits included' if s.split_batches else ''})")
    table.add_row("fill (padded / real tokens)", f"{s.fill_ratio:.1%} / {s.token_ratio:.1%}")
    table.add_row("MILP wins / runs / tasks", f"{s.milp_wins} / {s.milp_runs} / {s.num_tasks}")
    table.add_row("samples merged forward", f"{s.merged_samples:,}")
    if s.split_batches:
        table.add_row("lone global batches split", f"{s.split_batches:,} (cost model)")
    table.add_row("solve time", f"{s.solve_seconds:.2f} s on {s.workers} process(es)")
    return table


def _simulation_table(result: SimulationResult) -> Table:
    table = Table(title=f"simulated pipeline, {result.pipeline_stages} stages", title_justify="left")
    for name in ("run", "microbatches", "makespan (s)", "bubble ratio", "tokens/s", "speedup"):
        table.add_column(name, justify="left" if name == "run" else "right")
    reference = {r.name: r for r in result.runs}.get("megatron", result.runs[0])
    for run in result.runs:
        style = "bold green" if run.name == "lorafusion" else None
        table.add_row(
            run.name,
            f"{run.num_microbatches:,}",
            f"{run.makespan_s:,.1f}",
            f"{run.bubble_ratio:.1%}",
            f"{run.tokens_per_s:,.0f}",
            f"{run.tokens_per_s / reference.tokens_per_s:.2f}x",
            style=style,
        )
    return table


def _whole_number_from(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


_positive_int = _whole_number_from(1)


def _positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0 (--no-time-limit lifts the limit)")
    return value


def _check_outputs(output: Path | None, png: Path | None) -> None:
    """Refuse output paths that cannot be written before the work that fills them starts."""
    if output is not None:
        check_writable(output)
    if png is not None:
        from lorafusion_sched.plot import check_png_path, require_matplotlib

        check_png_path(png)
        check_writable(png)
        require_matplotlib()


def _cost_model(args: argparse.Namespace) -> CostModel:
    factors = None
    if args.stage_factors:
        try:
            factors = tuple(float(x) for x in args.stage_factors.split(","))
        except ValueError:
            raise SchedError(f"--stage-factors = {args.stage_factors!r}: give comma-separated numbers") from None
    points = None
    if args.forward_points:
        try:
            points = tuple((int(t), float(x)) for t, x in (pair.split(":") for pair in args.forward_points.split(",")))
        except ValueError:
            raise SchedError(
                f"--forward-points = {args.forward_points!r}: give comma-separated TOKENS:SECONDS pairs, "
                "e.g. 1024:0.17,4096:0.27"
            ) from None
    line = {"forward_fixed_s": args.forward_fixed, "forward_per_token_s": args.forward_per_token}
    if points is not None and any(value is not None for value in line.values()):
        raise SchedError(
            "--forward-points replace the line: give them, or --forward-fixed and --forward-per-token, not both"
        )
    return CostModel(
        **{name: value for name, value in line.items() if value is not None},
        backward_factor=args.backward_factor,
        stage_factors=factors,
        forward_points=points,
    )


def _override(options: PlanOptions, args: argparse.Namespace) -> PlanOptions:
    updates: dict[str, object] = {}
    if args.workers is not None:
        updates["workers"] = args.workers
    if args.time_limit is not None:
        updates["time_limit"] = args.time_limit
    if args.no_time_limit:
        updates["time_limit"] = None
    if args.no_milp:
        updates["use_milp"] = False
    return PlanOptions.model_validate(options.model_dump() | updates) if updates else options


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    _check_outputs(args.output, None)
    jobs, options = load_jobs(args.jobs)
    options = _override(options, args)
    try:
        plan, warned = _plan_with_progress(jobs, options, console, args.quiet)
    except SchedError as err:
        raise SchedError(f"{args.jobs}: {err}") from None
    save_plan(plan, args.output)
    if not args.quiet:
        console.print(_plan_table(plan))
    _print_warnings(warned)
    console.print(f"wrote [bold]{escape(str(args.output))}[/bold] ({plan.stats.num_microbatches:,} microbatches)")
    return 0


def _cmd_verify(args: argparse.Namespace, console: Console) -> int:
    plan = load_plan(args.plan)
    jobs, options = load_jobs(args.jobs) if args.jobs is not None else (None, None)
    runtime = RuntimeSettings(
        capacity=args.capacity,
        pipeline_stages=args.stages,
        data_parallel=args.data_parallel,
        padding_multiple=args.padding,
        drop_last=None if options is None else options.drop_last,
    )
    violations = verify(plan, runtime=runtime, jobs=jobs)
    if not violations:
        where = escape(str(args.plan))
        given = ", ".join(f"{name} {value}" for name, value in runtime.model_dump(exclude_none=True).items())
        fits = f", fits the runtime's {given}" if given else ""
        fits += f", is for the jobs of {escape(str(args.jobs))}" if args.jobs is not None else ""
        console.print(
            f"[green]ok[/green]: {where} verifies clean ({len(plan.microbatches):,} microbatches{fits})", soft_wrap=True
        )
        return 0
    _print_violations(violations, str(args.plan), console)
    return 1


def _draw(plan: Plan, png: Path, cost: CostModel, console: Console) -> None:
    from lorafusion_sched.plot import plot_timeline

    plot_timeline(plan, png, cost_model=cost)
    console.print(f"wrote timeline [bold]{escape(str(png))}[/bold]")


def _cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    _check_outputs(None, args.png)
    cost = _cost_model(args)
    plan = load_plan(args.plan)
    try:
        result = simulate(plan, cost, baselines=not args.no_baselines)
    except InvalidPlanError as invalid:  # listed as verify lists them
        _print_violations(invalid.violations, str(args.plan), console)
        console.print("not simulated: a plan with violations must not run; plan again", soft_wrap=True)
        return 1
    console.print(_simulation_table(result))
    if args.png:
        _draw(plan, args.png, cost, console)
    return 0


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    _check_outputs(args.output, args.png)
    cost = _cost_model(args)
    if args.samples < args.adapters:
        raise SchedError(f"--samples {args.samples} < --adapters {args.adapters}: each adapter needs a sample")
    jobs = synthetic_jobs(
        args.workload,
        args.samples,
        num_adapters=args.adapters,
        global_batch_size=args.global_batch_size,
        seed=args.seed,
    )
    options = _override(
        PlanOptions(
            capacity=args.capacity,
            pipeline_stages=args.stages,
            padding_multiple=args.padding,
            truncate=args.truncate,
            cost_model=cost,
        ),
        args,
    )
    console.rule(f"[bold]lorafusion-sched {__version__} demo")
    console.print(
        f"{len(jobs)} LoRA jobs on the [bold]{args.workload}[/bold] workload (SYNTHETIC lengths, seed {args.seed}), "
        f"{args.samples:,} samples, global batch {args.global_batch_size}, capacity {args.capacity} tokens, "
        f"{args.stages} pipeline stages, padding {args.padding}"
    )
    jobs_table = Table(title="jobs", title_justify="left")
    for name in ("adapter", "samples", "mean tokens", "max tokens"):
        jobs_table.add_column(name, justify="left" if name == "adapter" else "right")
    for job in jobs:
        mean = sum(job.sample_tokens) / len(job.sample_tokens)
        jobs_table.add_row(job.name, f"{len(job.sample_tokens):,}", f"{mean:,.0f}", f"{max(job.sample_tokens):,}")
    console.print(jobs_table)
    plan, warned = _plan_with_progress(jobs, options, console, quiet=False)
    console.print(_plan_table(plan))
    _print_warnings(warned)
    violations = verify(plan)
    if violations:  # plan() never returns one; a bug, reported as verify would
        _print_violations(violations, "the demo's plan", console)
        return 1
    console.print("[green]verify: no violations[/green]")
    result = simulate(plan, cost)
    console.print(_simulation_table(result))
    ours, megatron, mlora = (result.run(n) for n in ("lorafusion", "megatron", "mlora"))
    console.print(
        f"bubbles: [bold green]{ours.bubble_ratio:.1%}[/bold green] vs Megatron-style {megatron.bubble_ratio:.1%} "
        f"and mLoRA-style {mlora.bubble_ratio:.1%}; throughput [bold]{ours.tokens_per_s / megatron.tokens_per_s:.2f}x"
        f"[/bold] Megatron-style, {ours.tokens_per_s / mlora.tokens_per_s:.2f}x mLoRA-style "
        "(simulated)"
    )
    if args.output:
        save_plan(plan, args.output)
        console.print(f"wrote [bold]{escape(str(args.output))}[/bold]")
    if args.png:
        _draw(plan, args.png, cost, console)
    return 0


def _add_cost_args(parser: argparse.ArgumentParser) -> None:
    defaults = CostModel()
    group = parser.add_argument_group(
        "cost model (seconds per stage; forward = fixed + per_token x padded tokens, or measured points)"
    )
    group.add_argument("--forward-fixed", type=float, metavar="S", help=f"default {defaults.forward_fixed_s}")
    group.add_argument("--forward-per-token", type=float, metavar="S", help=f"default {defaults.forward_per_token_s}")
    group.add_argument("--backward-factor", type=float, default=defaults.backward_factor, metavar="X")
    group.add_argument("--stage-factors", default=None, metavar="F,F,...", help="one multiplier per stage")
    group.add_argument(
        "--forward-points",
        default=None,
        metavar="T:S,...",
        help="measured forward seconds S at T tokens, interpolated; replace --forward-fixed and --forward-per-token",
    )


def _add_solver_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=_positive_int, default=None, help="processes for MILP solves (default, and at most: the CPUs)"
    )
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="S", help="seconds per MILP solve")
    limit.add_argument(
        "--no-time-limit",
        action="store_true",
        help="only the node limit per MILP solve: the same plan on every run, several times slower",
    )
    parser.add_argument("--no-milp", action="store_true", help="greedy packing only")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafusion-sched", description="Plan, verify and simulate multi-adapter LoRA microbatch schedules."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a jobs file (JSON or YAML) into a plan JSON")
    p.add_argument("jobs", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True, help="plan JSON to write")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or table")
    _add_solver_args(p)

    v = sub.add_parser("verify", help="check every invariant of a plan JSON, and that it fits the runtime's settings")
    v.add_argument("plan", type=Path)
    runtime = v.add_argument_group("the runtime's settings (each one given is checked against the plan's)")
    runtime.add_argument(
        "--capacity", type=_positive_int, metavar="N", help="tokens per microbatch; the plan's must not exceed it"
    )
    runtime.add_argument("--stages", type=_positive_int, metavar="S", help="pipeline stages; the plan's must be >= S")
    runtime.add_argument("--data-parallel", type=_positive_int, metavar="D", help="replicas; the plan's must equal D")
    runtime.add_argument(
        "--padding", type=_positive_int, metavar="M", help="segment padding multiple; M must divide the plan's"
    )
    runtime.add_argument(
        "--jobs",
        type=Path,
        metavar="JOBS",
        help="the jobs file the runtime trains: the plan must be for its adapters, global batch sizes and sample "
        "lengths, and follow its drop_last",
    )

    s = sub.add_parser("simulate", help="simulate a plan against the Megatron-style and mLoRA-style baselines")
    s.add_argument("plan", type=Path)
    s.add_argument("--png", type=Path, default=None, help="also draw the timelines (needs the plot extra)")
    s.add_argument("--no-baselines", action="store_true")
    _add_cost_args(s)

    d = sub.add_parser("demo", help="plan and simulate a synthetic workload in a few seconds")
    d.add_argument("--workload", choices=WORKLOADS, default="het")
    d.add_argument("--samples", type=_positive_int, default=2560, help="samples over all adapters (default: 2560)")
    d.add_argument("--adapters", type=_positive_int, default=4, help="LoRA jobs (default: 4)")
    d.add_argument("--global-batch-size", type=_positive_int, default=32, help="samples per step (default: 32)")
    d.add_argument("--stages", type=_positive_int, default=4, help="pipeline stages (default: 4)")
    d.add_argument("--capacity", type=_positive_int, default=4096, help="tokens per microbatch (default: 4096)")
    d.add_argument("--padding", type=_positive_int, default=64, help="segment padding multiple (default: 64)")
    d.add_argument("--truncate", action="store_true", help="cut samples longer than the capacity to it")
    d.add_argument("--seed", type=_whole_number_from(0), default=0, help="synthetic lengths' seed (default: 0)")
    d.add_argument("-o", "--output", type=Path, default=None, help="also write the plan JSON")
    d.add_argument("--png", type=Path, default=None, help="also draw the timelines (needs the plot extra)")
    _add_solver_args(d)
    _add_cost_args(d)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    console, errors = Console(), Console(stderr=True, soft_wrap=True)  # a path stays whole
    commands = {"plan": _cmd_plan, "verify": _cmd_verify, "simulate": _cmd_simulate, "demo": _cmd_demo}
    try:
        return commands[args.command](args, console)
    except SchedError as err:
        message = str(err)
    except ValidationError as err:  # a command-line value the models refuse
        message = describe_validation_error(err)
    except OSError as err:  # a file that could not be read or written after the checks
        message = f"{err.filename or ''}: {err.strerror or err}".lstrip(": ")
    errors.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
    return 2


if __name__ == "__main__":
    sys.exit(main())
