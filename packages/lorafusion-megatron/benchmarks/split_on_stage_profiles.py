"""The scheduler's lone-batch splits, judged by measured pipeline-stage times (CPU only, no GPU).

Reads the per-stage timings that ``profile_stage.py`` measured on a GPU (forward and backward of
one stage of a 4-stage partition, at several token counts), fits the line that the trainer hands
the scheduler (``profiler.run.profiled_cost_model``: every count up to the capacity), plans the
scheduler benchmark's lone-tail workloads with and without it, and simulates both plans under the
measured times themselves (piecewise linear between the counts measured, flat below the first,
proportional above the last; one backward factor, their median ratio). So it shows whether a split
the line asks for pays on the measured stage:

    python packages/lorafusion-megatron/benchmarks/split_on_stage_profiles.py \\
        results/profile_stage_llama-3.1-8b_h200-tokens.json:4096,8192 \\
        results/profile_stage_llama-3.1-70b_h200-tokens.json:4096,8192 --out results/split_on_stage_profiles.json

Every stage of the pipeline is taken to run as the measured one.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

from lorafusion_megatron.atomic_files import write_json_atomically, write_text_atomically
from lorafusion_megatron.profiler.fit import fit_cost_model
from lorafusion_megatron.profiler.measure import Measurement
from lorafusion_sched import SchedWarning, plan
from lorafusion_sched.models import Plan
from lorafusion_sched.simulate import sequence_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lorafusion-sched" / "benchmarks"))
import bench_sched  # the scheduler benchmark's workloads and options (a script, not a package)


class MeasuredStage:
    """A cost model of the simulator's shape whose forward time follows the measured counts."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.tokens = [int(r["tokens"]) for r in rows]
        self.forward = [float(r["forward_ms"]) / 1e3 for r in rows]
        self.backward_factor = statistics.median(float(r["backward_ms"]) / float(r["forward_ms"]) for r in rows)

    def forward_seconds(self, padded_tokens: int, stage: int) -> float:
        """Forward seconds at ``padded_tokens`` (0 for a no-op), interpolated between the measured counts."""
        if padded_tokens == 0:
            return 0.0
        if padded_tokens <= self.tokens[0]:
            return self.forward[0]
        if padded_tokens >= self.tokens[-1]:
            return self.forward[-1] * padded_tokens / self.tokens[-1]
        j = bisect.bisect_left(self.tokens, padded_tokens)
        share = (padded_tokens - self.tokens[j - 1]) / (self.tokens[j] - self.tokens[j - 1])
        return self.forward[j - 1] + share * (self.forward[j] - self.forward[j - 1])


def measured_seconds(p: Plan, stage: MeasuredStage) -> float:
    """The plan's makespan with every stage running as the measured one."""
    sizes = [mb.padded_tokens for mb in p.microbatches]
    return sequence_seconds(sizes, p.pipeline_stages, p.data_parallel, stage)  # type: ignore[arg-type]


def rows_for(path: Path, capacities: list[int]) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    measured = sorted((r for r in doc["rows"] if r["recomputed_layers"] == 0), key=lambda r: r["tokens"])
    stage = MeasuredStage(measured)
    out = []
    for capacity in capacities:
        points = [Measurement(0, r["tokens"], r["forward_ms"] / 1e3, r["backward_ms"] / 1e3, None) for r in measured]
        line = fit_cost_model([m for m in points if m.tokens <= capacity], every_count=True)
        for workload, jobs in bench_sched.lone_tail_jobs(2048):
            for d in (1, 2):
                options = bench_sched.options(data_parallel=d, use_milp=False).model_copy(update={"capacity": capacity})
                unsplit = plan(jobs, options)
                split = plan(jobs, options.model_copy(update={"cost_model": line}))
                out.append(
                    {
                        "profile": path.name,
                        "capacity": capacity,
                        "line": {
                            "fixed_ms": line.forward_fixed_s * 1e3,
                            "per_token_us": line.forward_per_token_s * 1e6,
                        },
                        "workload": workload,
                        "data_parallel": d,
                        "split_batches": split.stats.split_batches,
                        "measured_speedup": round(measured_seconds(unsplit, stage) / measured_seconds(split, stage), 4),
                    }
                )
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| stage profile | capacity | line (ms + us/token) | long jobs | d | batches split | speedup, measured times |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        line = f"{r['line']['fixed_ms']:.1f} + {r['line']['per_token_us']:.2f}"
        lines.append(
            f"| {r['profile']} | {r['capacity']} | {line} | {r['workload']} | {r['data_parallel']} | "
            f"{r['split_batches']} | {r['measured_speedup']:.3f}x |"
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
