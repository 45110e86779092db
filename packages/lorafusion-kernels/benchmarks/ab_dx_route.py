"""The two routes of FusedMultiLoRA's input gradient compared on the whole op, interleaved in one process.

``dx = dy W + keep_a * (dS A_a) / (1 - p_a)`` is computed one of two ways
(``lorafusion_kernels.multi_lora_core.dx_from_da_pass`` picks, by the weight's shape):

- ``fused_gemm``: one Triton GEMM adds the LoRA term to ``dy W`` in its accumulator (the mask drawn
  again for each output tile);
- ``da_pass``: the ``dA`` pass writes the LoRA term from the mask it draws anyway, and cuBLAS adds
  ``dy W`` onto it in place (``dx.addmm_``).

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/ab_dx_route.py \
        --layers down --m 4096 8192 16384 --rounds 4 --out results/

Each row times forward + backward of ``fused_multi_lora_linear`` (bf16, 4 even adapters, r = 16, p
as given) replayed from a CUDA graph with each route, and the frozen layer, in rounds that alternate
the routes' order. Results go to ``<out>/<gpu-key>-ab-dx-route<tag>.json``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from bench_lora import LAYERS, graph_time, provenance, write_results
from bench_multi_lora import make_provider, segment_lengths

from lorafusion_kernels import multi_lora_core

ROUTES = {"fused_gemm": lambda n, k: False, "da_pass": lambda n, k: True}
"""What ``dx_from_da_pass`` answers under each route."""


def time_row(layer: tuple[str, int, int], m: int, p: float, rounds: int, rep: int) -> dict[str, object]:
    """One (layer, m): both routes' and the frozen layer's CUDA-graph times per round."""
    name, n, k = layer
    lengths = segment_lengths(m, 4, "even")
    fused = make_provider("fused_multi", m, n, k, 16, p, lengths, torch.bfloat16)["fwd_bwd"]
    frozen = make_provider("frozen", m, n, k, 16, p, lengths, torch.bfloat16)["fwd_bwd"]
    assert callable(fused)
    assert callable(frozen)
    shipped = multi_lora_core.dx_from_da_pass
    times: dict[str, list[float]] = {label: [] for label in [*ROUTES, "frozen"]}
    try:
        for round_index in range(rounds):
            for label in list(ROUTES) if round_index % 2 == 0 else list(reversed(ROUTES)):
                multi_lora_core.dx_from_da_pass = ROUTES[label]
                fused()  # compile this route's kernels outside the timing
                times[label].append(graph_time(fused, rep))
            times["frozen"].append(graph_time(frozen, rep))
    finally:
        multi_lora_core.dx_from_da_pass = shipped
    medians = {label: round(statistics.median(values), 5) for label, values in times.items()}
    ratio = round(statistics.median(a / b for a, b in zip(times["da_pass"], times["fused_gemm"], strict=True)), 4)
    print(
        f"{name:22s} m={m:6d} p={p} " + "  ".join(f"{label} {ms:.4f}" for label, ms in medians.items())
        + f"  da_pass/fused_gemm {ratio:.4f}  shipped {'da_pass' if shipped(n, k) else 'fused_gemm'}",
        flush=True,
    )  # fmt: skip
    return {
        "layer": name, "m": m, "n": n, "k": k, "p": p, "segments": lengths,
        "shipped_route": "da_pass" if shipped(n, k) else "fused_gemm",
        "times_ms": {label: [round(t, 5) for t in values] for label, values in times.items()},
        "median_ms": medians, "da_pass_over_fused_gemm": ratio,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, time every (layer, m), write ``<out>/<gpu-key>-ab-dx-route<tag>.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="*", default=None, help="substrings of layer names to keep")
    parser.add_argument("--m", type=int, nargs="+", default=[8192])
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=4, help="timings per route and row")
    parser.add_argument("--rep", type=int, default=25, help="do_bench_cudagraph repetition budget in ms")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    args = parser.parse_args(argv)
    layers = [lay for lay in LAYERS if args.layers is None or any(s in lay[0] for s in args.layers)]
    rows = [time_row(layer, m, args.p, args.rounds, args.rep) for layer in layers for m in args.m]
    mean = round(statistics.geometric_mean(float(row["da_pass_over_fused_gemm"]) for row in rows), 4)  # type: ignore[arg-type]
    print("geometric mean of da_pass / fused_gemm:", mean, flush=True)
    result = {**provenance("ab_dx_route.py", argv), "summary": {"da_pass_over_fused_gemm": mean}, "rows": rows}
    write_results(args.out, f"-ab-dx-route{args.tag}", result)


if __name__ == "__main__":
    main()
