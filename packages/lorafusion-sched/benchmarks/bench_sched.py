"""Scheduler benchmark: planning time, packing quality and simulated bubbles (issue 3, item 9).

Run from the repository root::

    python packages/lorafusion-sched/benchmarks/bench_sched.py            # full run, writes results
    python packages/lorafusion-sched/benchmarks/bench_sched.py --quick    # small sizes, prints only

Writes ``packages/lorafusion-sched/benchmarks/results/sched.json`` and the tables in
``results/sched-table.md`` next to it (included by ``docs/sched/benchmarks.md``). All workloads are
SYNTHETIC (see ``lorafusion_sched.workloads``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorafusion_sched import AdapterJob, CostModel, PlanOptions, plan, planner, simulate, verify
from lorafusion_sched.planner import default_workers
from lorafusion_sched.sequence import insert_noops
from lorafusion_sched.workloads import synthetic_jobs

RESULTS = Path(__file__).resolve().parent / "results" / "sched.json"
TABLE = RESULTS.parent / "sched-table.md"

CAPACITY, STAGES, PADDING, GBS = 4096, 4, 64, 32
SIZES = (640, 1280, 2560, 5120, 10240, 25600)


def options(**overrides: Any) -> PlanOptions:
    return PlanOptions(capacity=CAPACITY, pipeline_stages=STAGES, padding_multiple=PADDING, **overrides)


def plan_row(workload: str, samples: int, adapters: int = 4, **overrides: Any) -> dict[str, Any]:
    jobs = synthetic_jobs(workload, samples, num_adapters=adapters, global_batch_size=GBS, seed=0)
    start = time.perf_counter()
    p = plan(jobs, options(**overrides))
    seconds = time.perf_counter() - start
    s = p.stats
    compute = s.num_microbatches - s.num_noops
    return {
        "workload": workload,
        "samples": samples,
        "adapters": adapters,
        "seconds": round(seconds, 3),
        "microbatches": compute,
        "noops": s.num_noops,
        "lower_bound": s.lower_bound,
        "over_bound": round(compute / s.lower_bound - 1, 4),
        "fill": round(s.fill_ratio, 4),
        "tasks": s.num_tasks,
        "milp_runs": s.milp_runs,
        "milp_wins": s.milp_wins,
        "milp_win_share": round(s.milp_wins / s.num_tasks, 4) if s.num_tasks else 0.0,
        "violations": len(verify(p)),
        "plan": p,
    }


LAST_STAGE_SLOWER = CostModel(stage_factors=(1.0, 1.0, 1.0, 1.2))
"""The paper's residual 11 %: the last stage also runs the LM head and the loss (here 20 % slower)."""


def bubble_rows(samples_per_adapter: int) -> list[dict[str, Any]]:
    rows = []
    for adapters, cost in ((1, None), (2, None), (3, None), (4, None), (4, LAST_STAGE_SLOWER)):
        row = plan_row("het", samples_per_adapter * adapters, adapters)
        result = simulate(row.pop("plan"), cost)
        runs = {r.name: r for r in result.runs}
        rows.append(
            {
                "adapters": adapters,
                "cost_model": "uniform" if cost is None else "last stage x1.2",
                "violations": row["violations"],
                **{f"{name}_bubble": round(runs[name].bubble_ratio, 4) for name in ("lorafusion", "megatron", "mlora")},
                "speedup_vs_megatron": round(runs["lorafusion"].tokens_per_s / runs["megatron"].tokens_per_s, 3),
                "speedup_vs_mlora": round(runs["lorafusion"].tokens_per_s / runs["mlora"].tokens_per_s, 3),
            }
        )
    return rows


def many_job_rows() -> list[dict[str, Any]]:
    """Many small jobs: each group's global batch fills a fraction of a microbatch."""
    rows = []
    for jobs_count, gbs, samples in ((50, 1, 1), (50, 4, 40), (200, 2, 10)):
        jobs = []
        for i in range(jobs_count):
            lengths = synthetic_jobs("het", samples, num_adapters=1, global_batch_size=gbs, seed=i)[0].sample_tokens
            jobs.append(AdapterJob(name=f"job-{i}", sample_tokens=lengths, global_batch_size=gbs))
        p = plan(jobs, options(use_milp=False))
        s = p.stats
        rows.append(
            {
                "jobs": jobs_count,
                "gbs": gbs,
                "samples_per_job": samples,
                "microbatches": s.num_microbatches - s.num_noops,
                "noops": s.num_noops,
                "lower_bound": s.lower_bound,
                "fill": round(s.fill_ratio, 4),
                "violations": len(verify(p)),
            }
        )
    return rows


def data_parallel_rows(samples: int) -> list[dict[str, Any]]:
    """``het``, 4 adapters, S = 4, over data-parallel degrees: rounds of d microbatches."""
    rows = []
    jobs = synthetic_jobs("het", samples, num_adapters=4, global_batch_size=GBS, seed=0)
    for d in (1, 2, 4, 8):
        p = plan(jobs, options(data_parallel=d, use_milp=False))
        s = p.stats
        rows.append(
            {
                "data_parallel": d,
                "slots": s.num_microbatches,
                "noops": s.num_noops,
                "rounds": s.num_microbatches // d,
                "round_bound": -(-s.lower_bound // d),
                "groups": [list(g) for g in s.groups],
                "bubble": round(simulate(p).runs[0].bubble_ratio, 4),
                "violations": len(verify(p)),
            }
        )
    return rows


SPLIT_COST_MODELS = {
    "default (2 ms + 20 us/token)": CostModel(),
    "8B on H100, every layer recomputed (53 ms + 32 us/token)": CostModel(
        forward_fixed_s=0.0526, forward_per_token_s=3.18e-5, backward_factor=1.79
    ),
    "8B on H100, auto (126 ms + 20 us/token)": CostModel(
        forward_fixed_s=0.126, forward_per_token_s=1.97e-5, backward_factor=1.05
    ),
}
"""Cost models the lone-tail rows plan and simulate with: the simulator's default, and the lines that
``lorafusion-megatron profile`` fitted for LLaMa-3.1-8B on one H100 (``megatron`` benchmark results)."""


def lone_tail_jobs(long_samples: int) -> Iterator[tuple[str, list[AdapterJob]]]:
    """Workloads that end with long jobs alone: by themselves, or after four short jobs have finished.

    ``long_samples`` is the ``cnndm`` job's samples, each ``xsum`` job's twice over, and the four
    short jobs' eight times over.

    An ``xsum`` job with global batch 16 fills 1-3 microbatches per global batch, so the drain after
    each is a large share of its time; a ``cnndm`` job with global batch 32 (about 9) has less to
    save. Two long jobs fill part of each other's waits, so no global batch is followed by a whole
    drain: only the tail's split shortens them (alone, their microbatches mix where one's global
    batch ends and the other's begins).
    """
    short = synthetic_jobs("het", long_samples // 8, num_adapters=4, global_batch_size=GBS, seed=0)
    xsum = synthetic_jobs("xsum", long_samples, num_adapters=2, global_batch_size=16, seed=9)
    cnndm = synthetic_jobs("cnndm", long_samples, num_adapters=1, global_batch_size=GBS, seed=9)
    longs = [job.model_copy(update={"name": f"long-{i}"}) for i, job in enumerate(xsum)]
    beside = f"beside 4 x {long_samples // 32:,}"  # the four short jobs share long_samples // 8
    yield "one `xsum` (batch 16), alone", longs[:1]
    yield "two `xsum` (batch 16), alone", longs
    yield f"one `xsum` (batch 16), {beside}", [*short, longs[0]]
    yield f"two `xsum` (batch 16), {beside}", [*short, *longs]
    yield f"one `cnndm` (batch {GBS}), {beside}", [*short, cnndm[0].model_copy(update={"name": "long"})]


def lone_tail_rows(long_samples: int) -> list[dict[str, Any]]:
    """Plans with and without the cost model that splits lone global batches, simulated under it."""
    rows = []
    for workload, jobs in lone_tail_jobs(long_samples):
        for d in (1, 2):
            unsplit = plan(jobs, options(data_parallel=d, use_milp=False))
            split_by_default = plan(jobs, options(data_parallel=d, use_milp=False, cost_model=CostModel()))
            for name, cost in SPLIT_COST_MODELS.items():
                start = time.perf_counter()
                split = plan(jobs, options(data_parallel=d, use_milp=False, cost_model=cost))
                seconds = time.perf_counter() - start
                runs = {r.name: r.makespan_s for r in simulate(unsplit, cost).runs}
                ours = simulate(split, cost, baselines=False).runs[0].makespan_s
                rows.append(
                    {
                        "workload": workload,
                        "data_parallel": d,
                        "cost_model": name,
                        "split_batches": split.stats.split_batches,
                        "microbatches": [p.stats.num_microbatches - p.stats.num_noops for p in (unsplit, split)],
                        "noops": [p.stats.num_noops for p in (unsplit, split)],
                        "plan_seconds": round(seconds, 3),
                        "speedup_vs_unsplit": round(runs["lorafusion"] / ours, 4),
                        "default_split_vs_unsplit": round(
                            runs["lorafusion"] / simulate(split_by_default, cost, baselines=False).runs[0].makespan_s, 4
                        ),
                        "speedup_vs_megatron": [round(runs["megatron"] / t, 4) for t in (runs["lorafusion"], ours)],
                        "speedup_vs_mlora": [round(runs["mlora"] / t, 4) for t in (runs["lorafusion"], ours)],
                        "violations": len(verify(split)),
                    }
                )
    return rows


@contextlib.contextmanager
def given_order_only() -> Iterator[None]:
    """Plan as before the list schedule: no-ops inserted into the groups' order, nothing reordered."""
    saved = planner.fewest_noops  # type: ignore[attr-defined]
    planner.fewest_noops = insert_noops  # type: ignore[attr-defined]
    try:
        yield
    finally:
        planner.fewest_noops = saved  # type: ignore[attr-defined]


def random_workload(rng: random.Random, replicas: int) -> tuple[list[AdapterJob], PlanOptions]:
    """1-5 adapters of 1-40 samples (16-4,096 tokens, uniform), global batch 1-8, S = 1-6."""
    jobs = [
        AdapterJob(
            name=f"a{i}",
            sample_tokens=tuple(rng.randint(16, CAPACITY) for _ in range(rng.randint(1, 40))),
            global_batch_size=rng.randint(1, 8),
        )
        for i in range(rng.randint(1, 5))
    ]
    stages = rng.randint(1, 6)
    return jobs, PlanOptions(
        capacity=CAPACITY, pipeline_stages=stages, padding_multiple=PADDING, data_parallel=replicas, use_milp=False
    )


def reorder_rows(workloads: int) -> list[dict[str, Any]]:
    """Small random workloads planned twice: no-ops in the groups' order, and with the list schedule."""
    rows = []
    for d in (1, 2, 4):
        rng = random.Random(d)
        cases = [random_workload(rng, d) for _ in range(workloads)]
        with given_order_only():
            before = [plan(jobs, o) for jobs, o in cases]
        after = [plan(jobs, o) for jobs, o in cases]
        pairs = [(a.stats, b.stats) for a, b in zip(after, before, strict=True)]
        rows.append(
            {
                "data_parallel": d,
                "workloads": workloads,
                "with_noops": sum(b.num_noops > -(b.num_microbatches - b.num_noops) % d for _a, b in pairs),
                "shorter": sum(a.num_microbatches < b.num_microbatches for a, b in pairs),
                "longer": sum(a.num_microbatches > b.num_microbatches for a, b in pairs),
                "slots_before": sum(b.num_microbatches for _a, b in pairs),
                "slots_after": sum(a.num_microbatches for a, _b in pairs),
                "noops_before": sum(b.num_noops for _a, b in pairs),
                "noops_after": sum(a.num_noops for a, _b in pairs),
                "violations": sum(len(verify(a)) for a in after),
            }
        )
    return rows


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---" if i == 0 and not rows[0][0][:1].isdigit() else "---:" for i in range(len(header))]
    out = ["", f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out.extend("| " + " | ".join(row) + " |" for row in rows)
    return out


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"<!-- generated by packages/lorafusion-sched/benchmarks/bench_sched.py on {doc['date']}; do not edit -->",
        "",
        f"Machine: {m['cpus']} CPUs ({m['processor'] or m['machine']}), Python {m['python']}, highspy {m['highspy']}, "
        f"load average {m['load_before']} before and {m['load_after']} after the run. "
        f"Options: capacity {CAPACITY}, {STAGES} stages, padding {PADDING}, global batch {GBS}, "
        f"{doc['workers']} workers, default MILP limits.",
    ]
    header = ["samples", "seconds", "microbatches", "lower bound", "over bound", "fill"]
    lines += table(
        "Planning time and quality, 4 adapters (`het`), S = 4",
        [*header, "MILP wins / runs / tasks", "violations"],
        [
            [
                f"{r['samples']:,}",
                f"{r['seconds']:.2f}",
                f"{r['microbatches']:,}",
                f"{r['lower_bound']:,}",
                f"{r['over_bound']:+.2%}",
                f"{r['fill']:.2%}",
                f"{r['milp_wins']} / {r['milp_runs']} / {r['tasks']}",
                str(r["violations"]),
            ]
            for r in doc["timing"]
        ],
    )
    lines += table(
        "Greedy only (`use_milp=False`), same workloads",
        header,
        [
            [
                f"{r['samples']:,}",
                f"{r['seconds']:.2f}",
                f"{r['microbatches']:,}",
                f"{r['lower_bound']:,}",
                f"{r['over_bound']:+.2%}",
                f"{r['fill']:.2%}",
            ]
            for r in doc["greedy"]
        ],
    )
    lines += table(
        f"Quality per workload, {doc['quality_samples']:,} samples, 4 adapters",
        ["workload", "microbatches", "lower bound", "over bound", "fill", "MILP win share", "violations"],
        [
            [
                r["workload"],
                f"{r['microbatches']:,}",
                f"{r['lower_bound']:,}",
                f"{r['over_bound']:+.2%}",
                f"{r['fill']:.2%}",
                f"{r['milp_win_share']:.1%}",
                str(r["violations"]),
            ]
            for r in doc["quality"]
        ],
    )
    lines += table(
        f"Simulated bubble ratio, S = 4, `het` adapters, {doc['bubble_samples_per_adapter']} samples each",
        ["adapters", "stages", "LoRAFusion plan", "Megatron-style", "mLoRA-style", "speedup vs Megatron", "vs mLoRA"],
        [
            [
                str(r["adapters"]),
                r["cost_model"],
                f"{r['lorafusion_bubble']:.1%}",
                f"{r['megatron_bubble']:.1%}",
                f"{r['mlora_bubble']:.1%}",
                f"{r['speedup_vs_megatron']:.2f}x",
                f"{r['speedup_vs_mlora']:.2f}x",
            ]
            for r in doc["bubbles"]
        ],
    )
    lines += table(
        "Many small jobs, `het` lengths, greedy packing",
        ["jobs", "global batch", "samples per job", "microbatches", "no-ops", "lower bound", "fill", "violations"],
        [
            [
                str(r["jobs"]),
                str(r["gbs"]),
                str(r["samples_per_job"]),
                f"{r['microbatches']:,}",
                str(r["noops"]),
                f"{r['lower_bound']:,}",
                f"{r['fill']:.2%}",
                str(r["violations"]),
            ]
            for r in doc["many_jobs"]
        ],
    )
    lines += table(
        f"Data parallelism, 4 adapters (`het`), {doc['data_parallel_samples']:,} samples, S = 4, greedy packing",
        ["replicas d", "slots", "no-ops", "rounds", "bound on rounds", "groups", "simulated bubble", "violations"],
        [
            [
                str(r["data_parallel"]),
                f"{r['slots']:,}",
                str(r["noops"]),
                str(r["rounds"]),
                str(r["round_bound"]),
                " ".join("+".join(g) for g in r["groups"]),
                f"{r['bubble']:.1%}",
                str(r["violations"]),
            ]
            for r in doc["data_parallel"]
        ],
    )
    lines += table(
        f"Reordering where no-ops remain: {doc['reorder'][0]['workloads']} small random workloads per d, greedy",
        [
            "replicas d",
            "plans with no-ops (not padding)",
            "shorter / longer",
            "slots, given order",
            "slots, list schedule",
            "no-ops, given order",
            "no-ops, list schedule",
            "violations",
        ],
        [
            [
                str(r["data_parallel"]),
                str(r["with_noops"]),
                f"{r['shorter']} / {r['longer']}",
                f"{r['slots_before']:,}",
                f"{r['slots_after']:,}",
                f"{r['noops_before']:,}",
                f"{r['noops_after']:,}",
                str(r["violations"]),
            ]
            for r in doc["reorder"]
        ],
    )
    lines += table(
        f"Lone global batches split by a cost model (S = 4, greedy packing; an `xsum` job has "
        f"{doc['lone_tail_samples'] // 2:,} samples, the `cnndm` job {doc['lone_tail_samples']:,}, a short one "
        f"{doc['lone_tail_samples'] // 32:,}"
        + (f"; re-run on {doc['lone_tail_date']}" if "lone_tail_date" in doc else "")
        + ")",
        [
            "long jobs",
            "d",
            "cost model",
            "batches split",
            "microbatches + no-ops, unsplit → split",
            "speedup over unsplit",
            "split under the default model instead",
            "vs Megatron-style, unsplit → split",
            "vs mLoRA-style, unsplit → split",
            "violations",
        ],
        [
            [
                r["workload"],
                str(r["data_parallel"]),
                r["cost_model"],
                str(r["split_batches"]),
                f"{r['microbatches'][0]} + {r['noops'][0]} → {r['microbatches'][1]} + {r['noops'][1]}",
                f"{r['speedup_vs_unsplit']:.3f}x",
                f"{r['default_split_vs_unsplit']:.3f}x",
                f"{r['speedup_vs_megatron'][0]:.2f}x → {r['speedup_vs_megatron'][1]:.2f}x",
                f"{r['speedup_vs_mlora'][0]:.2f}x → {r['speedup_vs_mlora'][1]:.2f}x",
                str(r["violations"]),
            ]
            for r in doc["lone_tail"]
        ],
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; print, write nothing")
    parser.add_argument(
        "--only-lone-tail",
        action="store_true",
        help="re-run the lone-tail table alone into the results (the other tables and their date are kept)",
    )
    args = parser.parse_args()
    if args.only_lone_tail:
        doc = json.loads(RESULTS.read_text())
        doc["lone_tail"] = lone_tail_rows(doc["lone_tail_samples"])
        doc["lone_tail_date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        RESULTS.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        TABLE.write_text(markdown(doc))
        print(f"wrote the lone-tail table into {RESULTS} and {TABLE}")
        return
    sizes = SIZES[:3] if args.quick else SIZES
    before = load()
    timing, greedy = [], []
    for n in sizes:
        row = plan_row("het", n)
        row.pop("plan")
        timing.append(row)
        print(f"{n:>6} samples: {row['seconds']:.2f} s, {row['microbatches']} mbs, fill {row['fill']:.2%}", flush=True)
    for n in sizes:
        row = plan_row("het", n, use_milp=False)
        row.pop("plan")
        greedy.append(row)
    quality_samples = 2560
    quality = []
    for workload in ("xsum", "cnndm", "wikisum", "mixed", "het"):
        row = plan_row(workload, quality_samples)
        row.pop("plan")
        quality.append(row)
    per_adapter = 640
    bubbles = bubble_rows(per_adapter)
    many_jobs = many_job_rows()
    dp_samples = 2560
    data_parallel = data_parallel_rows(dp_samples)
    reorder = reorder_rows(50 if args.quick else 200)
    lone_tail_samples = 512 if args.quick else 2048
    lone_tail = lone_tail_rows(lone_tail_samples)
    doc = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "synthetic": True,
        "machine": {
            "cpus": default_workers(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "highspy": importlib.metadata.version("highspy"),
            "lorafusion_sched": importlib.metadata.version("lorafusion-sched"),
            "load_before": before,
            "load_after": load(),
        },
        "workers": default_workers(),
        "options": {"capacity": CAPACITY, "pipeline_stages": STAGES, "padding_multiple": PADDING, "gbs": GBS},
        "timing": timing,
        "greedy": greedy,
        "quality_samples": quality_samples,
        "quality": quality,
        "bubble_samples_per_adapter": per_adapter,
        "bubbles": bubbles,
        "many_jobs": many_jobs,
        "data_parallel_samples": dp_samples,
        "data_parallel": data_parallel,
        "reorder": reorder,
        "lone_tail_samples": lone_tail_samples,
        "lone_tail": lone_tail,
    }
    text = markdown(doc)
    print(text)
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        TABLE.write_text(text)
        print(f"wrote {RESULTS} and {TABLE}")


if __name__ == "__main__":
    main()
