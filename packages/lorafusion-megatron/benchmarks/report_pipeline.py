"""The pipeline benchmark as a markdown table (for docs/megatron/benchmarks.md) and a PNG plot.

Takes one or more results files of ``bench_pipeline.py`` measured with the same settings (e.g. two
device calls): their repeats count together. The plot has two panels: tokens/s per schedule at each
adapter count (bars: the median, whiskers: min and max over the repeats), and the measured bubble
ratio against the number of adapters (solid) beside the simulator's prediction for the same plan
(dashed). Drawing needs matplotlib (``lorafusion-sched[plot]``), imported only for ``--plot``.

    python packages/lorafusion-megatron/benchmarks/report_pipeline.py results/pipeline_qwen2.5-32b.json \\
        --markdown table.md --plot pipeline.png
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline_results import SCHEDULES, merge_results

from lorafusion_megatron.atomic_files import write_text_atomically

CHECKPOINTING_WORDS: dict[bool | str, str] = {True: "on", False: "off", "balanced": "balanced over the stages"}
"""How the setup paragraph names ``runtime.activation_checkpointing``."""

COLOURS = {"lorafusion": "#1b9e77", "megatron-1f1b": "#d95f02", "mlora": "#7570b3"}
"""One colour per schedule, the same in both panels."""


def _versions(header: dict[str, Any]) -> str:
    versions = header["versions"]
    names = ("torch", "triton", "transformers", "peft", "megatron-core")
    return ", ".join(f"{name} {versions[name]}" for name in names if versions.get(name))


def _setup(document: dict[str, Any]) -> str:
    """One paragraph: model, stages, workload, sizes, machine, software and dates."""
    s = document["settings"]
    headers = document["provenance"]
    device = headers[0]["device"]
    dates = sorted({header["date"][:10] for header in headers})
    kernels = "plain PEFT LoRA layers" if s["baseline_kernels"] == "plain" else "lorafusion-kernels"
    return (
        f"**{s['preset']}, {s['pipeline_stages']} pipeline stages** on {device['count']}x {device['name']} "
        f"({_versions(headers[0])}; {', '.join(dates)}; {len(headers)} call(s)). Het workload, "
        f"{s['steps_per_adapter']} global batches of {s['global_batch_size']} samples per adapter, "
        f"LoRA r={s['lora']['r']}, alpha={s['lora']['lora_alpha']}, dropout {s['lora']['lora_dropout']}, "
        f"capacity {s['capacity']} tokens, {s['dtype']}, activation checkpointing "
        f"{CHECKPOINTING_WORDS.get(s['activation_checkpointing'], s['activation_checkpointing'])}; "
        f"the baselines run {kernels}."
    )


def markdown(document: dict[str, Any]) -> str:
    """The setup paragraph and one table row per cell (adapters, schedule)."""
    simulated = document.get("simulated", {})
    lines = [
        _setup(document),
        "",
        "| adapters | schedule | runs | tokens/s (median) | min to max | LoRAFusion speedup "
        "| bubble ratio | per stage | simulated bubble | simulated, partition's stages |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for c in document["cells"]:
        speedup = "" if c["speedup"] is None else f"{c['speedup']:.2f}x"
        stages = ", ".join(f"{b:.1%}" for b in c["bubble_ratio_per_stage"])
        predicted = simulated.get(str(c["adapters"]), {}).get(c["schedule"])
        sim = "" if predicted is None else f"{predicted['bubble_ratio']:.1%}"
        weighted = None if predicted is None else predicted.get("bubble_ratio_with_partition")
        sim_partition = "" if weighted is None else f"{weighted:.1%}"  # results before this column: none
        lines.append(
            f"| {c['adapters']} | `{c['schedule']}` | {c['repeats']} | {c['tokens_per_second']:,.0f} "
            f"| {c['tokens_per_second_min']:,.0f} to {c['tokens_per_second_max']:,.0f} | {speedup} "
            f"| {c['bubble_ratio']:.1%} | {stages} | {sim} | {sim_partition} |"
        )
    failed = [run for run in document["runs"] if run["status"] != "ok"]
    if failed:
        lines += ["", "Launches that did not finish: " + ", ".join(_failure(run) for run in failed) + "."]
    return "\n".join(lines) + "\n"


def _failure(run: dict[str, Any]) -> str:
    what = f"`{run['schedule']}` with {run['adapters']} adapter(s){' (warm-up)' if run['warmup'] else ''}"
    return f"{what}: {run['status']}" + (f" ({run['error']})" if run.get("error") else "")


def plot(document: dict[str, Any], path: Path) -> None:
    """Tokens/s per schedule and bubble ratio against adapters, side by side, written atomically."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install 'lorafusion-sched[plot]'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = document["cells"]
    counts = sorted({c["adapters"] for c in cells})
    schedules = [s for s in SCHEDULES if any(c["schedule"] == s for c in cells)]
    width = 0.8 / max(1, len(schedules))
    fig, (rates, bubbles) = plt.subplots(1, 2, figsize=(11, 4))
    for k, schedule in enumerate(schedules):
        own = {c["adapters"]: c for c in cells if c["schedule"] == schedule}
        xs = [counts.index(n) + (k - (len(schedules) - 1) / 2) * width for n in own]
        medians = [c["tokens_per_second"] for c in own.values()]
        errors = [
            [c["tokens_per_second"] - c["tokens_per_second_min"] for c in own.values()],
            [c["tokens_per_second_max"] - c["tokens_per_second"] for c in own.values()],
        ]
        rates.bar(xs, medians, width, yerr=errors, capsize=3, color=COLOURS[schedule], label=schedule)
        line = sorted(own)
        bubbles.plot(line, [100 * own[n]["bubble_ratio"] for n in line], "o-", color=COLOURS[schedule], label=schedule)
        predicted = [
            (n, document["simulated"][str(n)][schedule])
            for n in counts
            if schedule in document.get("simulated", {}).get(str(n), {})
        ]
        if predicted:
            bubbles.plot(
                [n for n, _ in predicted],
                [100 * p["bubble_ratio"] for _, p in predicted],
                "--",
                color=COLOURS[schedule],
                alpha=0.5,
                label=f"{schedule} (simulated)",
            )
    s = document["settings"]
    rates.set_xticks(range(len(counts)), [str(n) for n in counts])
    rates.set_xlabel("adapters")
    rates.set_ylabel("tokens/s (median of repeats)")
    rates.legend()
    bubbles.set_xticks(counts)
    bubbles.set_xlabel("adapters")
    bubbles.set_ylabel("bubble ratio, mean over stages (%)")
    bubbles.set_ylim(bottom=0)
    bubbles.legend(fontsize="small")
    device = document["provenance"][0]["device"]
    fig.suptitle(f"{s['preset']}, {s['pipeline_stages']} stages, {device['count']}x {device['name']}, Het workload")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        fig.savefig(temporary, dpi=120, format="png")
        os.replace(temporary, path)
    finally:
        plt.close(fig)
        Path(temporary).unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="results files of bench_pipeline.py, same settings")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--plot", type=Path, help="draw the PNG here (needs matplotlib)")
    args = parser.parse_args(argv)
    document = merge_results(args.results)
    table = markdown(document)
    print(table, end="")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(args.markdown, table)
    if args.plot is not None:
        plot(document, args.plot)


if __name__ == "__main__":
    main()
