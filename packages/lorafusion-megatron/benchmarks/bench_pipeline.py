"""Tokens/s and per-stage bubble ratios of the pipeline runtime's three schedules, through the real launcher.

For a random-weight preset on ``S`` pipeline stages (one GPU each, NCCL; or CPU processes over
gloo), each *cell* (a number of adapters ``n`` of the Het workload and a schedule,
``parallel.schedule`` = ``lorafusion``, ``megatron-1f1b`` or ``mlora``) is one launch of
``python -m lorafusion_megatron.cli train CONFIG.yaml`` with a generated config: the first ``n``
jobs of XSum, CNN/DM, WikiSum, Mixed (synthetic lengths), LoRA r=16, alpha=32, dropout 0.1 on all
linear layers, ``--steps`` global batches of ``--global-batch-size`` samples per job. Every
schedule of one ``n`` trains the same samples (the config differs only in ``parallel.schedule``);
the script checks that every run's tokens equal the data's. Tokens/s and the bubble ratio per
stage are the run's own ``pipeline_summary.json`` (tokens of stage 0 over the slowest rank's wall
time of the program; the bubble ratio of a stage is ``1 - busy / wall`` of its slowest replica).

Method, as for ``bench_trainer.py``: an untimed warm-up launch first (the first cell with
``--warmup-samples`` samples per job, one global batch by default: Triton compiles the kernels for
the specialisations the timed cells meet, into its on-disk cache, which the later launches read;
with ``--one-launch``, into the process itself), then ``--repeats`` rounds over the cells, the
schedules of each ``n`` interleaved and their order rotated each round; the results give the
median, min and max over the repeats. The baselines run plain PEFT LoRA layers
(``runtime.fused_kernels: false``, as in the paper, which gives Megatron-LM and mLoRA the unfused
LoRA kernel) unless ``--baseline-kernels fused``.
Cells run in priority order (all schedules at the first ``--adapters`` count, then ``lorafusion``
at the other counts, then the baselines there, round by round); with ``--deadline-seconds`` a launch
predicted (from the launches before it) to end past the deadline is skipped and recorded as such.
The results file is rewritten after every launch, so a killed call keeps what it measured. Each
run's record also holds the bubble its measured compute durations imply (``replayed_bubble_ratio``,
:func:`lorafusion_megatron.pipeline.trace.replay`) and, with ``--one-launch``, the Triton kernels
compiled and the garbage collector's pauses during the run; each run's ``pipeline_trace.json`` is
copied to ``<out>-traces/``.

    python packages/lorafusion-megatron/benchmarks/bench_pipeline.py --preset qwen2.5-32b --stages 2 \\
        --checkpointing --deadline-seconds 480 --out pipeline.json
    python packages/lorafusion-megatron/benchmarks/bench_pipeline.py --preset tiny --stages 2 --dtype float32 \\
        --capacity 256 --length-scale 0.03 --global-batch-size 2 --adapters 2 1 --baseline-adapters 2 1 \\
        --repeats 1 --warmup-samples 0 --out smoke.json   # a smoke test on a CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pipeline_results import SCHEDULES, expected_rate, summarise_cells
from provenance import provenance

from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.pipeline.partition import CheckpointSetting

HET = ("xsum", "cnndm", "wikisum", "mixed")
"""The paper's heterogeneous workload: adapter ``i`` trains on ``HET[i]``."""

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": "all-linear"}
"""Every job's adapter (the issue's and the paper's setting)."""

CHECKPOINTING: dict[str, CheckpointSetting] = {"none": False, "all": True, "balanced": "balanced"}
"""``--checkpointing`` to ``runtime.activation_checkpointing``."""

SIMULATED_AS = {"megatron": "megatron-1f1b"}
"""The simulator's run names that differ from the schedule's."""

LOG_TAIL_LINES = 40
"""Lines of a failed launch's output kept in the results (and printed)."""


@dataclass(frozen=True)
class Cell:
    """One launch's shape: ``adapters`` jobs of :data:`HET` under ``schedule``."""

    adapters: int
    schedule: str

    @property
    def name(self) -> str:
        return f"{self.schedule}-{self.adapters}a"


def run_config(args: argparse.Namespace, cell: Cell, *, samples: int, steps: int) -> dict[str, Any]:
    """The trainer config of one launch (the mapping its YAML file holds; outputs go next to it).

    Args:
        args: The script's arguments (preset, stages, sizes, dtype, checkpointing, kernels).
        cell: Adapters and schedule.
        samples: Samples per job.
        steps: Optimizer steps per job (``max_steps``: exactly ``samples / steps`` per global batch).
    """
    fused = cell.schedule == "lorafusion" or args.baseline_kernels == "fused"
    return {
        "output_dir": ".",
        "base_model": {"model_name_or_path": args.preset, "dtype": args.dtype},
        "jobs": [
            {
                "name": name,
                "dataset": {"synthetic": name, "num_samples": samples, "length_scale": args.length_scale},
                **LORA,
                "global_batch_size": samples // steps,
                "max_steps": steps,
            }
            for name in HET[: cell.adapters]
        ],
        "scheduler": {"capacity": args.capacity, "padding_multiple": 64},
        "runtime": {"seed": 0, "activation_checkpointing": CHECKPOINTING[args.checkpointing], "fused_kernels": fused},
        "logging": {"progress_bar": False, "logging_steps": 1000},
        "parallel": {"pipeline_stages": args.stages, "schedule": cell.schedule},
    }


def train_command(config_file: Path) -> list[str]:
    """The launcher, run from source or installed alike (no console script needed)."""
    return [sys.executable, "-m", "lorafusion_megatron.cli", "train", str(config_file)]


def write_config(path: Path, mapping: dict[str, Any]) -> None:
    """The YAML config, headed by the command that runs it."""
    command = shlex.join(["python", "-m", "lorafusion_megatron.cli", "train", path.name])
    path.write_text(f"# {command}\n" + yaml.safe_dump(mapping, sort_keys=False), encoding="utf-8")


def expected_tokens(mapping: dict[str, Any]) -> int:
    """Real tokens of every job's training sequence (every schedule must train exactly these)."""
    from lorafusion_megatron.config import parse_config
    from lorafusion_megatron.trainer import prepare_data

    jobs = prepare_data(parse_config(mapping)).jobs
    return sum(sum(job.sample_tokens) for job in jobs.values())


def cells_in_order(args: argparse.Namespace, repeat: int) -> list[Cell]:
    """Round ``repeat``'s launches: every schedule at the first adapter count, then ``lorafusion``, then the rest.

    The schedules of one adapter count run back to back, their order rotated by ``repeat`` so that
    no schedule always runs first.
    """
    counts = list(dict.fromkeys([*args.adapters, *args.baseline_adapters]))
    shift = repeat % len(args.schedules)
    rotated = args.schedules[shift:] + args.schedules[:shift]
    wanted = {
        Cell(n, s)
        for n in counts
        for s in args.schedules
        if n in (args.adapters if s == "lorafusion" else args.baseline_adapters)
    }
    first = [Cell(counts[0], s) for s in rotated]
    fused_rest = [Cell(n, "lorafusion") for n in counts[1:]]
    baselines_rest = [Cell(n, s) for n in counts[1:] for s in rotated if s != "lorafusion"]
    return [cell for cell in first + fused_rest + baselines_rest if cell in wanted]


def predict_seconds(runs: Sequence[dict[str, Any]], schedule: str, tokens: int) -> float | None:
    """A launch's expected seconds from the timed launches before it; ``None`` before the first.

    The largest launch overhead seen so far, plus ``tokens`` at :func:`~pipeline_results.expected_rate`
    of the timed runs. The warm-up's rate is left out: it includes compiling the kernels.
    """
    done = [run for run in runs if run["status"] == "ok"]
    rate = expected_rate([(run["schedule"], run["tokens_per_second"]) for run in done if not run["warmup"]], schedule)
    if rate is None:
        return None
    overhead = max(run["launch_overhead_seconds"] for run in done)
    return overhead + tokens / rate


def _tail(text: str, work: Path) -> str:
    lines = text.replace(str(work), "<work>").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def launch(folder: Path, work: Path, timeout: float | None) -> dict[str, Any]:
    """Run the launcher on ``folder/config.yaml``; the run's measurements, or why it failed.

    The launcher runs in its own process group, so a launch past ``timeout`` is stopped with all
    the ranks it spawned.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = folder / "launch.log"
    begin = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        process = subprocess.Popen(
            train_command(folder / "config.yaml"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=folder,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.perf_counter() - begin
    summary_file = folder / "pipeline_summary.json"
    failure = {"status": "failed", "process_seconds": seconds, "log_tail": _tail(log.read_text(), work)}
    if code != 0 or not summary_file.is_file():
        return failure | {"error": "timed out" if code is None else f"exit status {code}"}
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    if summary.get("position", 0) < summary.get("num_microbatches", 0):
        return failure | {"error": f"stopped at microbatch {summary['position']} of {summary['num_microbatches']}"}
    overhead = seconds - summary["wall_seconds"]
    return measured(summary) | {"process_seconds": seconds, "launch_overhead_seconds": overhead}


def measured(summary: dict[str, Any]) -> dict[str, Any]:
    """A run record's measurements from the run's ``pipeline_summary.json``."""
    return {
        "status": "ok",
        "wall_seconds": summary["wall_seconds"],
        "tokens": summary["tokens"],
        "tokens_per_second": summary["tokens_per_second"],
        "bubble_ratio": summary["bubble_ratio"],
        "bubble_ratio_per_stage": summary["bubble_ratio_per_stage"],
        "optimizer_steps": len(summary["steps"]),
        "rank0_phase_seconds": summary["rank0_phase_seconds"],
        "idle_shares_per_stage": summary["idle_shares_per_stage"],
        "first_forward_seconds_per_stage": summary["first_forward_seconds_per_stage"],
        "replayed_bubble_ratio": summary["replayed_bubble_ratio"],
        "replayed_bubble_ratio_per_stage": summary["replayed_bubble_ratio_per_stage"],
        "kernel_compiles_per_stage": summary.get("kernel_compiles_per_stage"),
        "gc_pauses_per_stage": summary.get("gc_pauses_per_stage"),
        "pipeline_stages": summary["pipeline_stages"],
    }


def simulated(plan_file: Path, stage_factors: tuple[float, ...] | None) -> dict[str, Any]:
    """The scheduler's simulator on the run's plan: what the measurement should resemble.

    With the default cost model (equal stages), and again with the stages weighted by the layer
    partition's estimated costs (``stage_factors``; ``*_with_partition``): whole layers do not
    divide evenly over the stages, and the slowest stage sets the pace.
    """
    from lorafusion_megatron.planning import plan_from_json
    from lorafusion_sched import simulate
    from lorafusion_sched.models import CostModel

    plan = plan_from_json(plan_file.read_text(encoding="utf-8"))
    runs = simulate(plan, CostModel()).runs
    weighted = {run.name: run for run in simulate(plan, CostModel(stage_factors=stage_factors)).runs}
    fused = runs[0].tokens_per_s
    return {
        SIMULATED_AS.get(run.name, run.name): {
            "bubble_ratio": run.bubble_ratio,
            "bubble_ratio_per_stage": list(run.bubble_ratio_per_stage),
            "bubble_ratio_with_partition": weighted[run.name].bubble_ratio,
            "bubble_ratio_per_stage_with_partition": list(weighted[run.name].bubble_ratio_per_stage),
            "microbatches": run.num_microbatches,
            "lorafusion_speedup": fused / run.tokens_per_s if run.tokens_per_s else None,
        }
        for run in runs
    }


def partition_factors(preset: str, stages: int, checkpointing: str) -> tuple[float, ...] | None:
    """``stage_cost_factors`` of a random-weight preset's layer partition over ``stages``, recomputation included."""
    from lorafusion_megatron.pipeline.partition import recomputed_layers, stage_cost_factors
    from lorafusion_megatron.presets import PRESETS

    config = PRESETS[preset].config
    return stage_cost_factors(config, stages, recomputed_layers(config, stages, CHECKPOINTING[checkpointing]))


class Benchmark:
    """The launches of one invocation, and the results file rewritten after each."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        args.out.parent.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.begin = time.perf_counter()
        self.runs: list[dict[str, Any]] = []
        self.prepared = 0
        """Launch folders made so far (their number starts each folder's name)."""
        self.simulated: dict[str, Any] = {}
        self.header = provenance()

    def elapsed(self) -> float:
        return time.perf_counter() - self.begin

    def settings(self) -> dict[str, Any]:
        """What makes two result files comparable (their repeats may then be merged)."""
        a = self.args
        return {
            "preset": a.preset,
            "pipeline_stages": a.stages,
            "workload": "het",
            "lora": LORA,
            "steps_per_adapter": a.steps,
            "global_batch_size": a.global_batch_size,
            "capacity": a.capacity,
            "length_scale": a.length_scale,
            "dtype": a.dtype,
            "activation_checkpointing": CHECKPOINTING[a.checkpointing],
            "baseline_kernels": a.baseline_kernels,
        }

    def write(self) -> None:
        write_json_atomically(
            self.args.out,
            {
                "benchmark": "pipeline",
                "provenance": self.header,
                "settings": self.settings(),
                "method": {
                    "repeats": self.args.repeats,
                    "warmup_samples": self.args.warmup_samples,
                    "deadline_seconds": self.args.deadline_seconds,
                    "timed": "the program of each launch: pipeline_summary.json's wall time (stage 0's tokens)",
                    "one_launch": self.args.one_launch,
                },
                "elapsed_seconds": self.elapsed(),
                "runs": self.runs,
                "cells": summarise_cells(self.runs),
                "simulated": self.simulated,
            },
        )

    def _prepare(self, cell: Cell, repeat: int, *, warmup: bool) -> tuple[Path, dict[str, Any]]:
        """The cell's folder with its config, and its record so far (what it should train)."""
        a = self.args
        samples, steps = (a.warmup_samples, 1) if warmup else (a.steps * a.global_batch_size, a.steps)
        folder = self.work / f"{self.prepared:02d}-{'warmup' if warmup else cell.name}"
        self.prepared += 1
        folder.mkdir(parents=True)
        mapping = run_config(a, cell, samples=samples, steps=steps)
        if a.one_launch:
            mapping["output_dir"] = str(folder.resolve())
        write_config(folder / "config.yaml", mapping)
        return folder, {
            "adapters": cell.adapters,
            "schedule": cell.schedule,
            "repeat": repeat,
            "warmup": warmup,
            "fused_kernels": mapping["runtime"]["fused_kernels"],
            "expected_tokens": expected_tokens(mapping),
        }

    def _record(self, folder: Path, cell: Cell, record: dict[str, Any]) -> None:
        """Check, report, simulate (once per adapter count) and keep a finished launch's record."""
        if record["status"] == "ok" and record["tokens"] != record["expected_tokens"]:
            record["status"] = "failed"
            record["error"] = (
                f"trained {record['tokens']} tokens, the data holds {record['expected_tokens']}: not the same samples"
            )
        self._report(folder.name, record)
        trace = folder / "pipeline_trace.json"
        if trace.is_file():
            traces = self.args.out.with_name(f"{self.args.out.stem}-traces")
            traces.mkdir(exist_ok=True)
            shutil.copyfile(trace, traces / f"{folder.name}.json")
        if record["status"] == "ok" and not record["warmup"] and str(cell.adapters) not in self.simulated:
            factors = partition_factors(self.args.preset, self.args.stages, self.args.checkpointing)
            self.simulated[str(cell.adapters)] = simulated(folder / "plan.json", factors)
        self.runs.append(record)
        self.write()

    def run(self, cell: Cell, repeat: int, *, warmup: bool) -> None:
        """One launch of the launcher for ``cell`` (skipped if predicted to end past the deadline)."""
        a = self.args
        folder, record = self._prepare(cell, repeat, warmup=warmup)
        predicted = predict_seconds(self.runs, cell.schedule, record["expected_tokens"])
        record["predicted_seconds"] = predicted
        left = None if a.deadline_seconds is None else a.deadline_seconds - self.elapsed()
        if left is not None and predicted is not None and predicted > left:
            record["status"] = "skipped"
            print(f"{folder.name:>24}: skipped, predicted {predicted:.0f} s with {left:.0f} s left", flush=True)
            self.runs.append(record)
            self.write()
            return
        # A launch may overrun its prediction a little; one that hangs is stopped after the deadline.
        self._record(folder, cell, record | launch(folder, self.work, None if left is None else left + a.grace_seconds))

    def run_in_one_launch(self, cells: list[tuple[Cell, int, bool]]) -> None:
        """Every ``(cell, repeat, warmup)`` in one launch of ``pipeline_cells.py`` (start-up paid once)."""
        a = self.args
        prepared = [(cell, *self._prepare(cell, repeat, warmup=warmup)) for cell, repeat, warmup in cells]
        spec = self.work / "cells.json"
        deadline = None if a.deadline_seconds is None else a.deadline_seconds - self.elapsed()
        spec.write_text(
            json.dumps(
                {
                    "folders": [str(folder.resolve()) for _, folder, _ in prepared],
                    "warmup": sum(warmup for _, _, warmup in cells),
                    "deadline_seconds": deadline,
                }
            ),
            encoding="utf-8",
        )
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.stages}"]
        command += [str(Path(__file__).with_name("pipeline_cells.py")), str(spec)]
        log = self.work / "one-launch.log"
        begin = time.perf_counter()
        with log.open("w", encoding="utf-8") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = process.wait(timeout=None if deadline is None else deadline + a.grace_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                code = None
        seconds = time.perf_counter() - begin
        print(f"one launch of {len(cells)} cell(s): exit status {code}, {seconds:.0f} s", flush=True)
        for cell, folder, record in prepared:
            summary_file = folder / "pipeline_summary.json"
            if summary_file.is_file():
                summary = json.loads(summary_file.read_text(encoding="utf-8"))
                self._record(folder, cell, record | measured(summary) | {"launch_overhead_seconds": None})
            elif code == 0:
                print(f"{folder.name:>24}: skipped (predicted past the deadline)", flush=True)
                self.runs.append(record | {"status": "skipped"})
            else:
                error = "timed out" if code is None else f"exit status {code}"
                self._record(folder, cell, record | {"status": "failed", "error": error, "log_tail": ""})
        if code != 0:
            print(_tail(log.read_text(encoding="utf-8"), self.work), flush=True)
        self.write()

    def _report(self, name: str, record: dict[str, Any]) -> None:
        if record["status"] != "ok":
            after = f" after {record['process_seconds']:.0f} s" if "process_seconds" in record else ""
            print(f"{name:>24}: FAILED ({record['error']}){after}", flush=True)
            print(record.get("log_tail", ""), flush=True)
            return
        stages = ", ".join(f"{b:.1%}" for b in record["bubble_ratio_per_stage"])
        overhead = record.get("launch_overhead_seconds")
        launched = "" if overhead is None else f", launch {record['process_seconds']:.0f} s (overhead {overhead:.0f} s)"
        print(
            f"{name:>24}: {record['tokens_per_second']:>9,.0f} tokens/s, "
            f"bubble {record['bubble_ratio']:.1%} ({stages}); "
            f"{record['tokens']:,} tokens in {record['wall_seconds']:.1f} s{launched}; {self.elapsed():.0f} s elapsed",
            flush=True,
        )
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in record["rank0_phase_seconds"].items())
        print(f"{'':>24}  rank 0: {phases}", flush=True)
        for stage, (shares, first) in enumerate(
            zip(record["idle_shares_per_stage"], record["first_forward_seconds_per_stage"], strict=True)
        ):
            idle = ", ".join(f"{part} {share:.1%}" for part, share in shares.items())
            print(f"{'':>24}  stage {stage} idle: {idle}; first forward {first or 0:.2f} s", flush=True)
        replayed = ", ".join(f"{b:.1%}" for b in record["replayed_bubble_ratio_per_stage"])
        print(
            f"{'':>24}  replayed from the measured durations: bubble {record['replayed_bubble_ratio']:.1%} ({replayed})"
        )
        for stage, compiles in enumerate(record["kernel_compiles_per_stage"] or []):
            if compiles["count"]:
                print(f"{'':>24}  stage {stage}: {compiles['count']} kernel compilations, {compiles['seconds']:.1f} s")
                names = sorted({kernel["name"] for kernel in compiles["kernels"]})
                print(f"{'':>26}  {', '.join(names)}")
        for stage, pauses in enumerate(record["gc_pauses_per_stage"] or []):
            print(
                f"{'':>24}  stage {stage}: {pauses['count']} gc pauses, {pauses['seconds']:.2f} s, "
                f"longest {pauses['longest_seconds'] * 1e3:.0f} ms ({pauses['full_count']} full)",
                flush=True,
            )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-32b", help="a random-weight preset of lorafusion_megatron")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages S (one GPU or CPU process each)")
    parser.add_argument("--adapters", type=int, nargs="+", default=[4, 3, 2, 1], help="adapter counts of lorafusion")
    parser.add_argument("--baseline-adapters", type=int, nargs="+", default=[4], help="adapter counts of the baselines")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=2, help="global batches (optimizer steps) per adapter")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=4096, help="tokens per microbatch (a multiple of 64)")
    parser.add_argument("--length-scale", type=float, default=1.0, help="scales the synthetic lengths")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--checkpointing",
        nargs="?",
        const="all",
        default="none",
        choices=tuple(CHECKPOINTING),
        help="activation checkpointing: of every layer (alone: all), none, or balanced over the stages",
    )
    parser.add_argument(
        "--baseline-kernels",
        choices=("plain", "fused"),
        default="plain",
        help="LoRA layers of the baselines: plain PEFT (the paper's setting) or lorafusion-kernels",
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the cells")
    parser.add_argument(
        "--warmup-samples",
        type=int,
        help="samples per job of the untimed warm-up (0: none; default: one global batch, so that the kernels "
        "are compiled for the microbatch shapes the timed cells meet)",
    )
    parser.add_argument("--deadline-seconds", type=float, help="launch nothing predicted to end after this")
    parser.add_argument(
        "--one-launch",
        action="store_true",
        help="run every cell in one launch of pipeline_cells.py (process group and stage model built once)",
    )
    parser.add_argument("--grace-seconds", type=float, default=60.0, help="a launch's allowance past the deadline")
    parser.add_argument("--work", type=Path, help="folder for the launches' configs, logs and outputs (default: temp)")
    parser.add_argument("--out", type=Path, default=Path("bench_pipeline.json"))
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    if args.stages < 2:
        parser.error("--stages must be at least 2: with one stage `train` runs the single-process trainer")
    if any(not 1 <= n <= len(HET) for n in [*args.adapters, *args.baseline_adapters]):
        parser.error(f"adapter counts must lie in 1..{len(HET)} (the Het workload has {len(HET)} datasets)")
    if args.warmup_samples is None:
        args.warmup_samples = args.global_batch_size
    if args.warmup_samples < 0:
        parser.error("--warmup-samples must be 0 (no warm-up) or more")


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as temporary:
        work = args.work or Path(temporary)
        bench = Benchmark(args, work)
        print(
            f"{args.preset} on {args.stages} stage(s), {bench.header['device']['name']}: "
            f"{args.steps} global batches of {args.global_batch_size} per adapter, capacity {args.capacity}",
            flush=True,
        )
        warmup = [(cells_in_order(args, 0)[0], 0, True)] if args.warmup_samples else []
        timed = [(cell, repeat, False) for repeat in range(args.repeats) for cell in cells_in_order(args, repeat)]
        if args.one_launch:
            bench.run_in_one_launch(warmup + timed)
        else:
            for cell, repeat, is_warmup in warmup:
                bench.run(cell, repeat, warmup=is_warmup)
                if bench.runs[-1]["status"] != "ok":
                    raise SystemExit("the warm-up launch failed (its log is above): every other launch would fail too")
            for cell, repeat, is_warmup in timed:
                bench.run(cell, repeat, warmup=is_warmup)
        bench.write()
    cells = summarise_cells(bench.runs)
    print(f"\n{'cell':>18} {'runs':>4} {'tokens/s':>10} {'bubble':>7} {'lorafusion x':>12}")
    for c in cells:
        speedup = "" if c["speedup"] is None else f"{c['speedup']:.2f}x"
        name = Cell(c["adapters"], c["schedule"]).name
        print(f"{name:>18} {c['repeats']:>4} {c['tokens_per_second']:>10,.0f} {c['bubble_ratio']:>7.1%} {speedup:>12}")
    print(f"{bench.elapsed():.0f} s in all; results in {args.out.name}")


if __name__ == "__main__":
    main()
