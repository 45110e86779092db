"""The scheduler's lone-batch splits, judged by measured pipeline-stage times (CPU only, no GPU).

Reads the per-stage timings that ``profile_stage.py`` measured on a GPU (forward and backward of
one stage of a 4-stage partition, at several token counts), plans the scheduler benchmark's
lone-tail workloads without a cost model and with each of two: the measured points themselves, as
the trainer hands them to the scheduler (``profiler.fit.measured_cost_model``), and the line
through them (the form of the trainer's model before). Every plan is simulated under the measured
points (made non-decreasing and interpolated as the trainer's are: flat below the first count,
proportional above the last; one backward factor, their median ratio), so it shows what each
model's splits gain on the measured stage:

    python packages/lorafusion-megatron/benchmarks/split_on_stage_profiles.py \\
        results/profile_stage_llama-3.1-8b_h200-tokens.json:4096,8192 \\
        results/profile_stage_llama-3.1-70b_h200-tokens.json:4096,8192 --out results/split_on_stage_profiles.json

Every stage of the pipeline is taken to run as the measured one, alone: in a running pipeline the
times differ (``bench_split.py`` measures a split there).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.profiler.fit import measured_cost_model
from lorafusion_megatron.profiler.measure import Measurement
from lorafusion_sched import CostModel, SchedWarning, plan
from lorafusion_sched.models import Plan
from lorafusion_sched.simulate import sequence_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lorafusion-sched" / "benchmarks"))
import bench_sched  # the scheduler benchmark's workloads and options (a script, not a package)


def seconds(p: Plan, cost: CostModel) -> float:
    """The plan's makespan under ``cost``."""
    return sequence_seconds([mb.padded_tokens for mb in p.microbatches], p.pipeline_stages, p.data_parallel, cost)


def rows_for(path: Path, capacities: list[int]) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    measured = sorted((r for r in doc["rows"] if r["recomputed_layers"] == 0), key=lambda r: r["tokens"])
    points = measured_cost_model(
        [Measurement(0, r["tokens"], r["forward_ms"] / 1e3, r["backward_ms"] / 1e3, None) for r in measured]
    )
    line = points.model_copy(update={"forward_points": None})
    out = []
    for capacity in capacities:
        for workload, jobs in bench_sched.lone_tail_jobs(2048):
            for d in (1, 2):
                options = bench_sched.options(data_parallel=d, use_milp=False).model_copy(update={"capacity": capacity})
                unsplit = seconds(plan(jobs, options), points)
                row: dict[str, Any] = {"profile": path.name, "capacity": capacity, "workload": workload}
                row |= {"data_parallel": d, "line_fixed_ms": line.forward_fixed_s * 1e3}
                row |= {"line_per_token_us": line.forward_per_token_s * 1e6}
                for name, cost in (("line", line), ("points", points)):
                    split = plan(jobs, options.model_copy(update={"cost_model": cost}))
                    row[f"{name}_split_batches"] = split.stats.split_batches
                    row[f"{name}_speedup"] = round(unsplit / seconds(split, points), 4)
                out.append(row)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| stage profile | capacity | long jobs | d | line (ms + us/token): batches split, speedup "
        "| measured points: batches split, speedup |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        line = f"{r['line_fixed_ms']:.1f} + {r['line_per_token_us']:.2f}"
        lines.append(
            f"| {r['profile']} | {r['capacity']} | {r['workload']} | {r['data_parallel']} | "
            f"{line}: {r['line_split_batches']}, {r['line_speedup']:.3f}x | "
            f"{r['points_split_batches']}, {r['points_speedup']:.3f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", help="PATH:CAPACITY,CAPACITY (profile_stage.py output)")
    parser.add_argument("--out", type=Path, required=True, help="results JSON; the table goes beside it (.md)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", SchedWarning)  # the workloads end with lone tails on purpose
    rows = []
    for spec in args.profiles:
        path, _, capacities = spec.rpartition(":")
        rows += rows_for(Path(path), [int(c) for c in capacities.split(",")])
    write_json_atomically(args.out, {"rows": rows})
    table = markdown(rows)
    write_text_atomically(args.out.with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
