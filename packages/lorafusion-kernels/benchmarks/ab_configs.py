"""Launch-config files compared on the whole op, interleaved in one process: what a config change buys.

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/ab_configs.py \
        --variant before=path/to/dir --layers down --m 8192 --adapters 4 --rounds 6 --out results/

``lorafusion-tune`` times each kernel alone; a config change is meant to change the op, whose
timings move by 3-5% between runs of ``bench_multi_lora.py``. Here every variant (a directory
holding this GPU's ``<gpu-key>.json``, set as ``LORAFUSION_KERNELS_CONFIG_DIR``) and the shipped
files ("shipped") time the same forward + backward of ``fused_multi_lora_linear`` (bf16, r = 16 or
``--r``, p = 0.1 as in ``bench_multi_lora.py``; 4 adapters by default, even segments; 1 adapter takes the
FusedLoRA path) replayed from a CUDA graph, in rounds
that alternate their order (shipped first, then last), so a steady drift hits all alike. The frozen
layer is timed in each round too. Per row and variant: the median over rounds of ``variant /
shipped`` (below 1: the variant is faster) and the medians of each. Results go to
``<out>/<gpu-key>-ab<tag>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
from bench_lora import LAYERS, graph_time, provenance, write_results
from bench_multi_lora import make_provider, segment_lengths

from lorafusion_kernels.tuning.config import CONFIG_DIR_ENV, clear_caches

SHIPPED = "shipped"


def use_configs(directory: str | None) -> None:
    """Make the next launches look their configs up in ``directory`` (None: the shipped files)."""
    if directory is None:
        os.environ.pop(CONFIG_DIR_ENV, None)
    else:
        os.environ[CONFIG_DIR_ENV] = directory
    clear_caches()


def time_row(
    layer: tuple[str, int, int], m: int, r: int, adapters: int, variants: dict[str, str | None], rounds: int, rep: int
) -> dict[str, object]:
    """One (layer, m): every variant's and the frozen layer's CUDA-graph times per round, and their ratios."""
    name, n, k = layer
    lengths = segment_lengths(m, adapters, "even")
    fused = make_provider("fused_multi", m, n, k, r, 0.1, lengths, torch.bfloat16)["fwd_bwd"]
    frozen = make_provider("frozen", m, n, k, r, 0.1, lengths, torch.bfloat16)["fwd_bwd"]
    assert callable(fused)
    assert callable(frozen)
    times: dict[str, list[float]] = {label: [] for label in [*variants, "frozen"]}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for label in order:
            use_configs(variants[label])
            fused()  # compile this variant's configs outside the timing
            times[label].append(graph_time(fused, rep))
        times["frozen"].append(graph_time(frozen, rep))
    use_configs(None)
    base = times[SHIPPED]
    ratios = {
        label: round(statistics.median(t / b for t, b in zip(times[label], base, strict=True)), 4)
        for label in variants
        if label != SHIPPED
    }
    medians = {label: round(statistics.median(values), 5) for label, values in times.items()}
    print(
        f"{name:22s} m={m:6d} r={r} a={adapters} "
        + "  ".join(f"{label} {ms:.4f}" for label, ms in medians.items())
        + "  "
        + "  ".join(f"{label}/shipped {ratio:.4f}" for label, ratio in ratios.items()),
        flush=True,
    )
    return {
        "layer": name, "m": m, "n": n, "k": k, "r": r, "adapters": adapters, "segments": lengths,
        "times_ms": {label: [round(t, 5) for t in values] for label, values in times.items()},
        "median_ms": medians, "ratio_to_shipped": ratios,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, time every (layer, m), write ``<out>/<gpu-key>-ab<tag>.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, metavar="LABEL=DIR",
                        help="a config directory to compare with the shipped files (repeatable)")  # fmt: skip
    parser.add_argument("--layers", nargs="*", default=None, help="substrings of layer names to keep")
    parser.add_argument("--m", type=int, nargs="+", default=[8192])
    parser.add_argument("--r", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6, help="timings per variant and row")
    parser.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph repetition budget in ms")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--tag", default="", help="suffix of the results file name (<gpu-key>-ab<tag>.json)")
    args = parser.parse_args(argv)
    variants: dict[str, str | None] = {SHIPPED: None}
    for spec in args.variant:
        label, sep, directory = spec.partition("=")
        if not sep or not label or label in variants:
            parser.error(f"--variant takes LABEL=DIR with a new label, got {spec!r}")
        if not Path(directory).is_dir():
            parser.error(f"--variant {label}: {directory} is not a directory")
        variants[label] = str(Path(directory).resolve())
    layers = [lay for lay in LAYERS if args.layers is None or any(s in lay[0] for s in args.layers)]
    rows = [
        time_row(layer, m, args.r, args.adapters, variants, args.rounds, args.rep) for layer in layers for m in args.m
    ]
    labels = [label for label in variants if label != SHIPPED]
    summary = {
        label: round(statistics.geometric_mean(float(row["ratio_to_shipped"][label]) for row in rows), 4)  # type: ignore[index]
        for label in labels
    }
    print("geometric mean of variant / shipped:", summary, flush=True)
    result = {**provenance("ab_configs.py", argv), "variants": list(variants), "summary": summary, "rows": rows}
    write_results(args.out, f"-ab{args.tag}", result)


if __name__ == "__main__":
    main()
