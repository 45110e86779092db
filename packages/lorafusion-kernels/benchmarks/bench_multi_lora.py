"""Benchmark one LoRA linear layer on a packed microbatch of several adapters (FusedMultiLoRA).

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/bench_multi_lora.py \
        --out packages/lorafusion-kernels/benchmarks/results/

Same layer shapes, M, rank (16), p (0.1) and dtype (bf16) as ``bench_lora.py``; the M tokens are split
among 1, 2, 4 or 8 adapters, ``even`` (equal segments) or ``skewed`` (segment ``i`` gets a share
proportional to ``2**-i``). Providers: ``frozen`` (``x W^T`` alone, the floor), ``eager`` (one frozen
GEMM plus a PEFT-style LoRA branch per segment, :func:`lorafusion_kernels.reference.per_segment_lora_linear`),
``fused_single`` (FusedLoRA on each segment, outputs concatenated) and ``fused_multi``
(:func:`lorafusion_kernels.fused_multi_lora_linear` with the batch metadata built once, outside the
timing, as a trainer does per microbatch). ``fused_multi_tma`` forces the sm_90 TMA variants of the
two GEMMs (``--tma``). Times are medians of ``triton.testing.do_bench`` (eager launches, CPU overhead
included) and, for forward + backward, of ``do_bench_cudagraph`` (``fwd_bwd_graph_ms``: the same call
replayed from a CUDA graph, GPU time alone; ``--no-graphs`` skips it). The adapters are bf16, or fp32
with ``--adapter-dtype float32`` (PEFT's default for a bf16 model, which the kernels read as they are).
Results go to ``<out>/<gpu-key>-multi.json`` (rows with ``op = "multi_lora_linear"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from bench_lora import LAYERS, M_VALUES, graph_time, provenance, saved_bytes, write_results
from triton.testing import do_bench

from lorafusion_kernels import MultiLoRABatch, fused_lora_linear, fused_multi_lora_linear
from lorafusion_kernels._kernels import multi_lora_bwd, multi_lora_fwd
from lorafusion_kernels.reference import per_segment_lora_linear
from lorafusion_kernels.tuning.config import KernelConfig, ShapeKey, lookup_config, override_configs
from lorafusion_kernels.tuning.device import capability, device_name
from lorafusion_kernels.tuning.launches import LayerProblem, multi_adapter_launches

ADAPTER_COUNTS = [1, 2, 4, 8]
DISTRIBUTIONS = ["even", "skewed"]
PROVIDERS = ["frozen", "eager", "fused_single", "fused_multi"]


def segment_lengths(m: int, adapters: int, distribution: str) -> list[int]:
    """Tokens per adapter (one segment each), summing to ``m``."""
    weights = [1.0] * adapters if distribution == "even" else [2.0**-i for i in range(adapters)]
    lengths = [int(m * w / sum(weights)) for w in weights]
    lengths[0] += m - sum(lengths)
    return lengths


def make_provider(
    name: str,
    m: int,
    n: int,
    k: int,
    r: int,
    p: float,
    lengths: list[int],
    dtype: torch.dtype,
    adapter_dtype: torch.dtype | None = None,
) -> dict[str, object]:
    """Tensors and closures ``fwd()`` / ``fwd_bwd()`` for one provider and problem (adapters in ``adapter_dtype``,
    default ``dtype``)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    count = len(lengths)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / math.sqrt(k)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        values = torch.randn(*shape, device="cuda", dtype=dtype, generator=gen) * scale
        return values.to(adapter_dtype or dtype).requires_grad_()

    lora_a = [rand(r, k, scale=k**-0.5) for _ in range(count)]
    lora_b = [rand(n, r, scale=r**-0.5) for _ in range(count)]
    dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    adapters = list(range(count))
    scaling = [2.0] * count
    ps = [p] * count
    starts = [sum(lengths[:i]) for i in range(count)]
    inputs = [x, *lora_a, *lora_b]
    if name == "frozen":
        inputs = [x]

        def fwd() -> torch.Tensor:
            return torch.nn.functional.linear(x, w)
    elif name == "eager":

        def fwd() -> torch.Tensor:
            return per_segment_lora_linear(
                x, w, lora_a, lora_b, segment_lengths=lengths, segment_adapters=adapters, scaling=scaling, dropout_p=ps
            )
    elif name == "fused_single":

        def fwd() -> torch.Tensor:
            return torch.cat(
                [
                    fused_lora_linear(x[s : s + length], w, lora_a[i], lora_b[i], scaling=scaling[i], dropout_p=p)
                    for i, (s, length) in enumerate(zip(starts, lengths, strict=True))
                ]
            )
    else:
        batch = MultiLoRABatch.from_segments(lengths, adapters, device="cuda")

        def fwd() -> torch.Tensor:
            return fused_multi_lora_linear(x, w, lora_a, lora_b, scaling=scaling, dropout_p=ps, batch=batch)

    def fwd_bwd() -> None:
        torch.autograd.grad(fwd(), inputs, dy)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "params": [w, *lora_a, *lora_b]}


def tma_overrides(m: int, n: int, k: int, r: int) -> dict[str, KernelConfig]:
    """The looked-up configs of FusedMultiLoRA's two GEMMs with ``tma=True``."""
    index = torch.cuda.current_device()
    out = {}
    for kernel in (multi_lora_fwd.LINEAR_KERNEL, multi_lora_bwd.DX_KERNEL):
        key = ShapeKey(m=m, n=n, k=k, r=r, dtype="bfloat16")
        cfg = lookup_config(kernel, key, device_name=device_name(index), capability=capability(index))
        out[kernel] = dataclasses.replace(cfg, tma=True)
    return out


@dataclasses.dataclass(frozen=True)
class Timing:
    """One row's medians in ms (NaN where not measured or failed) and the bytes autograd saves."""

    fwd_ms: float = math.nan
    fwd_bwd_ms: float = math.nan
    fwd_bwd_graph_ms: float = math.nan
    saved_bytes: int = -1


def measure(
    provider: str,
    problem: tuple[int, int, int, int, float],
    lengths: list[int],
    adapter_dtype: torch.dtype,
    rep: int,
    graphs: bool,
) -> Timing:
    """The :class:`Timing` of one row, ``problem`` being ``(m, n, k, r, p)``; NaN (reported) if the provider fails."""
    m, n, k, r, p = problem
    try:
        bench = make_provider(provider.removesuffix("_tma"), m, n, k, r, p, lengths, torch.bfloat16, adapter_dtype)
        fwd, fwd_bwd, params = bench["fwd"], bench["fwd_bwd"], bench["params"]
        assert callable(fwd)
        assert callable(fwd_bwd)
        assert isinstance(params, list)
        overrides = tma_overrides(m, n, k, r) if provider.endswith("_tma") else {}
        with override_configs(overrides):
            fwd_bwd()
            torch.cuda.synchronize()
            return Timing(
                fwd_ms=float(do_bench(fwd, warmup=25, rep=rep, return_mode="median")),
                fwd_bwd_ms=float(do_bench(fwd_bwd, warmup=25, rep=rep, return_mode="median")),
                fwd_bwd_graph_ms=graph_time(fwd_bwd, rep) if graphs else math.nan,
                saved_bytes=saved_bytes(fwd, params),
            )
    except Exception as exc:  # report and go on: the other rows still stand
        print(f"  {provider} failed: {type(exc).__name__}: {exc}", flush=True)
        return Timing()


def run(
    layers: list[tuple[str, int, int]],
    ms: list[int],
    counts: list[int],
    distributions: list[str],
    providers: list[str],
    r: int,
    p: float,
    rep: int,
    *,
    adapter_dtype: torch.dtype = torch.bfloat16,
    graphs: bool = True,
) -> list[dict[str, object]]:
    """Time every (layer, m, adapters, distribution, provider); print one line per row."""
    rows: list[dict[str, object]] = []
    for layer, n, k in layers:
        for m in ms:
            frozen: Timing | None = None
            for count in counts:
                for distribution in distributions if count > 1 else distributions[:1]:
                    lengths = segment_lengths(m, count, distribution)
                    for provider in providers:
                        base = provider.removesuffix("_tma")
                        if base == "frozen" and frozen is not None:
                            timing = frozen
                        else:
                            timing = measure(provider, (m, n, k, r, p), lengths, adapter_dtype, rep, graphs)
                            if base == "frozen":
                                frozen = timing
                        rows.append(
                            {
                                "op": "multi_lora_linear",
                                "layer": layer,
                                "m": m,
                                "n": n,
                                "k": k,
                                "r": r,
                                "p": p,
                                "dtype": "bfloat16",
                                "adapter_dtype": str(adapter_dtype).removeprefix("torch."),
                                "adapters": count,
                                "distribution": distribution,
                                "segments": lengths,
                                "provider": provider,
                                "fwd_ms": round(timing.fwd_ms, 5),
                                "fwd_bwd_ms": round(timing.fwd_bwd_ms, 5),
                                "fwd_bwd_graph_ms": round(timing.fwd_bwd_graph_ms, 5),
                                "saved_bytes": timing.saved_bytes,
                            }
                        )
                        print(f"{layer:22s} m={m:6d} a={count} {distribution:6s} {provider:15s} "
                              f"fwd {timing.fwd_ms:8.4f} ms  fwd+bwd {timing.fwd_bwd_ms:8.4f} ms  "
                              f"graph {timing.fwd_bwd_graph_ms:8.4f} ms", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict[str, object]], field: str = "fwd_bwd_ms") -> dict[str, dict[str, float]]:
    """Per adapter count, geometric means of time ratios: fused_multi/frozen, eager/fused_multi, ...

    A ratio whose two providers never ran together is left out (no NaN in the JSON).
    """
    by_key: dict[tuple[object, ...], dict[str, float]] = {}
    for row in rows:
        value = row[field]
        assert isinstance(value, float)
        key = (row["adapters"], row["distribution"], row["n"], row["k"], row["m"])
        by_key.setdefault(key, {})[str(row["provider"])] = value

    def geomean(count: int, a: str, b: str) -> float | None:
        ratios = [v[a] / v[b] for key, v in by_key.items() if key[0] == count and a in v and v.get(b, 0.0) > 0.0]
        ratios = [x for x in ratios if math.isfinite(x)]
        return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None

    pairs = {
        "fused_multi_over_frozen": ("fused_multi", "frozen"),
        "eager_over_fused_multi": ("eager", "fused_multi"),
        "fused_single_over_fused_multi": ("fused_single", "fused_multi"),
        "eager_over_frozen": ("eager", "frozen"),
        "fused_multi_tma_over_frozen": ("fused_multi_tma", "frozen"),
    }
    counts = sorted({int(str(row["adapters"])) for row in rows})
    summary: dict[str, dict[str, float]] = {}
    for count in counts:
        ratios = {name: geomean(count, a, b) for name, (a, b) in pairs.items()}
        summary[f"adapters={count}"] = {name: value for name, value in ratios.items() if value is not None}
    return summary


def breakdown(m: int, n: int, k: int, r: int, p: float, adapters: int, rep: int) -> dict[str, float]:
    """Median ms of each FusedMultiLoRA kernel alone (looked-up configs) and of the frozen GEMMs.

    The kernels run on the tuner's inputs (:mod:`lorafusion_kernels.tuning.launches`): ``adapters``
    adapters of rank ``r`` splitting the ``m`` tokens evenly.
    """
    problem = LayerProblem(m=m, n=n, k=k, r=r, dtype=torch.bfloat16, p=p, adapters=adapters, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=problem.dtype)
    w = torch.randn(n, k, device="cuda", dtype=problem.dtype)
    dy = torch.randn(m, n, device="cuda", dtype=problem.dtype)
    kernels: dict[str, Callable[[], object]] = {
        "frozen_fwd": lambda: torch.nn.functional.linear(x, w),
        "frozen_dx": lambda: dy @ w,
        **{name: launch(None) for name, launch in multi_adapter_launches(problem).items()},
    }
    out = {}
    for name, fn in kernels.items():
        fn()
        out[name] = round(float(do_bench(fn, warmup=25, rep=rep, return_mode="median")), 5)
        print(f"breakdown m={m} n={n} k={k} adapters={adapters} {name:14s} {out[name]:8.4f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the grid, write ``<out>/<gpu-key>-multi.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--m", type=int, nargs="*", default=M_VALUES)
    parser.add_argument("--layers", nargs="*", default=None, help="substrings of layer names to keep")
    parser.add_argument("--adapters", type=int, nargs="*", default=ADAPTER_COUNTS)
    parser.add_argument("--distributions", nargs="*", default=DISTRIBUTIONS, choices=DISTRIBUTIONS)
    parser.add_argument("--providers", nargs="*", default=PROVIDERS)
    parser.add_argument("--tma", action="store_true", help="also time fused_multi with the TMA GEMMs forced on")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition budget in ms")
    parser.add_argument("--breakdown", action="store_true", help="also time each kernel alone (first layer and m)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing")
    parser.add_argument("--adapter-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tag", default="", help="suffix of the results file name (<gpu-key>-multi<tag>.json)")
    args = parser.parse_args(argv)
    layers = [lay for lay in LAYERS if args.layers is None or any(s in lay[0] for s in args.layers)]
    providers = [*args.providers, *(["fused_multi_tma"] if args.tma else [])]
    kernel_times = {}
    if args.breakdown:
        _, n, k = layers[0]
        for count in [c for c in args.adapters if c > 1]:
            kernel_times[f"adapters={count}"] = breakdown(args.m[0], n, k, args.r, args.p, count, args.rep)
    rows = run(
        layers, args.m, args.adapters, args.distributions, providers, args.r, args.p, args.rep,
        adapter_dtype=getattr(torch, args.adapter_dtype), graphs=not args.no_graphs,
    )  # fmt: skip
    result = {
        **provenance("bench_multi_lora.py", argv),
        "summary": {
            "fwd_bwd": summarize(rows),
            "fwd": summarize(rows, "fwd_ms"),
            "fwd_bwd_graph": summarize(rows, "fwd_bwd_graph_ms"),
        },
        "kernel_breakdown_ms": kernel_times,
        "rows": rows,
    }
    print(json.dumps(result["summary"], indent=2))
    write_results(args.out, f"-multi{args.tag}", result)


if __name__ == "__main__":
    main()
