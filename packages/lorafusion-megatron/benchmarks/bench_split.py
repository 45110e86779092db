"""Do the scheduler's lone-batch splits pay on a real pipeline? One lone job trained with and without them.

One job (``--dataset``, LoRA r=16 on all linear layers, ``--global-batch-size`` samples per
optimizer step) trains alone on ``S`` pipeline stages of a random-weight preset, where each of its
global batches is followed by a pipeline drain. Two variants of the same run, differing only in
the output folder's ``profile.json``:

- ``unsplit``: no profile, so no cost model: every global batch packed to the capacity;
- ``split``: the profile of these stages, from which the trainer hands the scheduler its cost
  model (``profiler.run.profiled_cost_model``); the scheduler splits the global batches where that
  model says the whole plan is at least 3% faster (``lorafusion_sched.lone_batches``).

Steps, in one invocation:

1. ``lorafusion-megatron profile`` on the run's config and stages, at ``--capacities`` (or
   ``--profile FILE`` reuses one measured before on the same config);
2. one launch of ``pipeline_cells.py`` (process group and stage model built once) runs a warm-up
   cell of each variant (``--warmup-samples`` samples: Triton loads the kernels of both plans'
   shapes), then ``--repeats`` rounds of both, their order alternated round by round;
3. per variant: the plan's microbatches and split global batches, its seconds simulated under the
   profiled cost model, and the measured wall time of the program (median, min and max over the
   rounds); the measured speedup beside the predicted one. Each run must train exactly the data's
   tokens.

Both variants train the same samples in the same optimizer steps (the scheduler's ``verify``
checks every plan, and a CPU test that a split plan ends with the single-process trainer's adapters
when LoRA dropout is off; with dropout, whose masks are drawn per microbatch, any other packing
draws other masks). In one launch the adapters' weights carry over from cell to cell, so the runs'
losses are not compared here.

    python packages/lorafusion-megatron/benchmarks/bench_split.py --preset qwen2.5-32b --stages 2 \\
        --capacity 8192 --out split_qwen2.5-32b_h200x2-capacity8192.json
    python packages/lorafusion-megatron/benchmarks/bench_split.py --preset tiny --stages 2 --dtype float32 \\
        --capacity 256 --capacities 64 128 256 --length-scale 0.03 --samples 8 --global-batch-size 4 \\
        --repeats 1 --warmup-samples 4 --out smoke.json   # a smoke test on a CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_pipeline import CHECKPOINTING, LORA, expected_tokens, measured, write_config
from provenance import provenance

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically

VARIANTS = ("unsplit", "split")
"""Without and with the profile's cost model."""


def run_config(args: argparse.Namespace, folder: Path, samples: int) -> dict[str, Any]:
    """The trainer config of one cell: ``samples`` samples of the lone job, outputs in ``folder``."""
    return {
        "output_dir": str(folder.resolve()),
        "base_model": {"model_name_or_path": args.preset, "dtype": args.dtype},
        "jobs": [
            {
                "name": args.dataset,
                "dataset": {"synthetic": args.dataset, "num_samples": samples, "length_scale": args.length_scale},
                **LORA,
                "global_batch_size": args.global_batch_size,
                "max_steps": samples // args.global_batch_size,
            }
        ],
        "scheduler": {"capacity": args.capacity, "padding_multiple": 64},
        "runtime": {"seed": 0, "activation_checkpointing": CHECKPOINTING[args.checkpointing], "fused_kernels": True},
        "logging": {"progress_bar": False, "logging_steps": 1000},
        "parallel": {"pipeline_stages": args.stages, "schedule": "lorafusion"},
    }


def run_logged(command: list[str], log: Path, cwd: Path) -> tuple[int, float]:
    """Run ``command`` with its output in ``log``; its exit status and seconds."""
    begin = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, check=False).returncode
    seconds = time.perf_counter() - begin
    if code != 0:
        print("\n".join(log.read_text(encoding="utf-8").splitlines()[-40:]), flush=True)
    return code, seconds


def profile(args: argparse.Namespace, work: Path) -> tuple[Path, float]:
    """``profile.json`` of the run's config on its stages (measured now, or ``--profile``) and the seconds taken."""
    if args.profile is not None:
        return args.profile, 0.0
    folder = work / "profile"
    folder.mkdir()
    write_config(folder / "config.yaml", run_config(args, folder, args.samples))
    command = [sys.executable, "-m", "lorafusion_megatron.cli", "profile", "config.yaml", "--capacities"]
    code, seconds = run_logged(command + [str(c) for c in args.capacities], folder / "profile.log", folder)
    if code != 0:
        raise SystemExit(f"profile failed with exit status {code}")
    return folder / "profile.json", seconds


def prepare_cells(args: argparse.Namespace, work: Path, profile_file: Path) -> list[tuple[str, int, Path]]:
    """``(variant, round, folder)`` of every cell in launch order: a warm-up of each (round -1), then ABBA... rounds."""
    rounds = [(variant, -1) for variant in VARIANTS]
    for r in range(args.repeats):
        rounds += [(variant, r) for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]
    cells = []
    for variant, r in rounds:
        folder = work / f"{variant}-{'warmup' if r < 0 else r}"
        folder.mkdir()
        samples = args.warmup_samples if r < 0 else args.samples
        write_config(folder / "config.yaml", run_config(args, folder, samples))
        if variant == "split":
            shutil.copyfile(profile_file, folder / "profile.json")
        cells.append((variant, r, folder))
    return cells


def plan_record(folder: Path, cost: Any) -> dict[str, Any]:
    """The cell's plan: microbatches, split global batches and its seconds simulated under ``cost``."""
    from lorafusion_megatron.planning import plan_from_json
    from lorafusion_sched import simulate

    plan = plan_from_json((folder / "plan.json").read_text(encoding="utf-8"))
    run = simulate(plan, cost).runs[0]
    return {
        "microbatches": sum(not mb.noop for mb in plan.microbatches),
        "split_batches": plan.stats.split_batches,
        "simulated_seconds": run.makespan_s,
        "simulated_bubble_ratio": run.bubble_ratio,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant the median, min and max wall seconds of the timed rounds; the speedups measured and predicted."""
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        timed = [r for r in runs if r["variant"] == variant and r["round"] >= 0 and r["status"] == "ok"]
        if not timed:
            continue
        walls = [r["wall_seconds"] for r in timed]
        out[variant] = {
            "rounds": len(timed),
            "median_wall_seconds": statistics.median(walls),
            "min_wall_seconds": min(walls),
            "max_wall_seconds": max(walls),
            "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in timed),
            **{k: timed[0][k] for k in ("microbatches", "split_batches", "simulated_seconds")},
        }
    if len(out) == len(VARIANTS):
        unsplit, split = out["unsplit"], out["split"]
        out["measured_speedup"] = unsplit["median_wall_seconds"] / split["median_wall_seconds"]
        out["predicted_speedup"] = unsplit["simulated_seconds"] / split["simulated_seconds"]
    return out


def markdown(document: dict[str, Any]) -> str:
    """The results as a table: one row per variant, then the speedups."""
    s, summary, p = document["settings"], document["summary"], document["provenance"]
    lines = [
        f"# Lone-batch splits on a real pipeline: {s['preset']}, {s['pipeline_stages']} stages, "
        f"one `{s['dataset']}` job (global batch {s['global_batch_size']}), capacity {s['capacity']:,}",
        "",
        f"{p['device']['count']} x {p['device']['name']}; {p['date'][:10]}; torch {p['versions'].get('torch')}, "
        f"triton {p['versions'].get('triton')}. Median of {document['method']['repeats']} round(s).",
        "",
        "| variant | microbatches | split global batches | simulated s | measured s (min-max) | tokens/s |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for variant in VARIANTS:
        v = summary.get(variant)
        if v is None:
            lines.append(f"| {variant} | | | | not measured | |")
            continue
        lines.append(
            f"| {variant} | {v['microbatches']} | {v['split_batches']} | {v['simulated_seconds']:.1f} | "
            f"{v['median_wall_seconds']:.1f} ({v['min_wall_seconds']:.1f}-{v['max_wall_seconds']:.1f}) | "
            f"{v['median_tokens_per_second']:,.0f} |"
        )
    if "measured_speedup" in summary:
        lines += [
            "",
            f"Split over unsplit: {summary['measured_speedup']:.3f}x measured, "
            f"{summary['predicted_speedup']:.3f}x predicted by the profile's cost model.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="qwen2.5-32b")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dataset", default="xsum", help="the lone job's synthetic dataset")
    parser.add_argument("--samples", type=int, default=160, help="samples of each timed cell")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--capacities", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="profiled")
    parser.add_argument("--profile", type=Path, help="a profile.json measured before on this config (skips step 1)")
    parser.add_argument("--length-scale", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--checkpointing", choices=sorted(CHECKPOINTING), default="all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-samples", type=int, default=32)
    parser.add_argument("--work", type=Path, help="folder for the cells (default: a new temporary one)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.samples % args.global_batch_size or args.warmup_samples % args.global_batch_size:
        parser.error("--samples and --warmup-samples must be multiples of --global-batch-size")

    from lorafusion_megatron.config import load_config
    from lorafusion_megatron.profiler.run import profiled_cost_model

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-split."))
    work.mkdir(parents=True, exist_ok=True)
    profile_file, profile_seconds = profile(args, work)
    print(f"profile: {profile_seconds:.0f} s", flush=True)
    cells = prepare_cells(args, work, profile_file)
    spec = work / "cells.json"
    spec.write_text(json.dumps({"folders": [str(f) for _, _, f in cells], "warmup": 2, "deadline_seconds": None}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.stages}"]
    command += [str(Path(__file__).with_name("pipeline_cells.py")), str(spec)]
    code, seconds = run_logged(command, work / "cells.log", work)
    print(f"one launch of {len(cells)} cells: exit status {code}, {seconds:.0f} s", flush=True)

    split_folder = next(folder for variant, _, folder in cells if variant == "split")
    cost = profiled_cost_model(load_config(split_folder / "config.yaml"), args.stages)
    if cost is None:
        raise SystemExit(f"{profile_file} was not measured on {args.stages} stages: profile this config")
    runs = []
    for variant, r, folder in cells:
        record: dict[str, Any] = {"variant": variant, "round": r, "folder": folder.name}
        summary_file = folder / "pipeline_summary.json"
        if not summary_file.is_file():
            runs.append(record | {"status": "failed"})
            continue
        record |= measured(json.loads(summary_file.read_text(encoding="utf-8"))) | plan_record(folder, cost)
        want = expected_tokens(run_config(args, folder, args.warmup_samples if r < 0 else args.samples))
        if record["tokens"] != want:
            record |= {"status": "failed", "error": f"trained {record['tokens']} tokens, the data holds {want}"}
        runs.append(record)
        print(
            f"{folder.name:>16}: {record.get('wall_seconds', 0):7.2f} s, {record['microbatches']} microbatches, "
            f"{record['split_batches']} split, simulated {record['simulated_seconds']:.2f} s",
            flush=True,
        )
    document = {
        "benchmark": "lone-batch splits on a pipeline",
        "provenance": provenance(),
        "settings": {
            k: getattr(args, k)
            for k in ("preset", "dataset", "samples", "global_batch_size", "capacity", "capacities", "dtype")
        }
        | {"pipeline_stages": args.stages, "activation_checkpointing": CHECKPOINTING[args.checkpointing]},
        "method": {"repeats": args.repeats, "warmup_samples": args.warmup_samples, "order": "warm-ups, then ABBA"},
        "profile_seconds": profile_seconds,
        "profile": json.loads(profile_file.read_text(encoding="utf-8")),
        "cost_model": cost.model_dump(),
        "runs": runs,
        "summary": summarise(runs),
    }
    write_json_atomically(args.out, document)
    write_text_atomically(args.out.with_suffix(".md"), markdown(document))
    print(markdown(document), flush=True)
    return 0 if code == 0 and all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
