"""Benchmark one LoRA linear layer: providers frozen / eager / compile / fused, forward and forward+backward.

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/bench_lora.py \
        --out packages/lorafusion-kernels/benchmarks/results/

Providers: ``frozen`` is ``x W^T`` alone (the floor: its backward computes dx only), ``eager`` is
PEFT's computation in eager torch, ``compile`` is ``torch.compile`` of the same function, ``fused``
is :func:`lorafusion_kernels.fused_lora_linear`. Times are the median of ``triton.testing.do_bench``
(eager launches, CPU overhead included, as a training loop sees it) and, for forward+backward, also of
``do_bench_cudagraph`` (``fwd_bwd_graph_ms``: GPU time alone, as the paper measured);
``saved_bytes`` counts the activations autograd keeps for backward (parameters excluded).
The baselines come from :mod:`lorafusion_kernels.reference` so tests and benchmark never drift.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import lorafusion_kernels
from lorafusion_kernels import fused_lora_linear
from lorafusion_kernels.reference import peft_style_lora_linear
from lorafusion_kernels.tuning.device import gpu_key

# (name, n = out_features, k = in_features): the LoRA-targeted linears of the three models (fused qkv
# as LoRAFusion does) and the paper's square micro-benchmark sizes.
LAYERS: list[tuple[str, int, int]] = [
    ("llama8b.qkv", 6144, 4096),
    ("llama8b.o=square4096", 4096, 4096),
    ("llama8b.gate_up", 14336, 4096),
    ("llama8b.down", 4096, 14336),
    ("qwen32b.qkv", 7168, 5120),
    ("qwen32b.o=square5120", 5120, 5120),
    ("qwen32b.gate_up", 27648, 5120),
    ("qwen32b.down", 5120, 27648),
    ("llama70b.qkv", 10240, 8192),
    ("llama70b.o=square8192", 8192, 8192),
    ("llama70b.gate_up", 28672, 8192),
    ("llama70b.down", 8192, 28672),
]
M_VALUES = [2048, 4096, 8192, 16384]
PROVIDERS = ["frozen", "eager", "compile", "fused"]


def saved_bytes(fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for backward during ``fn()``."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def make_provider(name: str, m: int, n: int, k: int, r: int, p: float, dtype: torch.dtype) -> dict[str, object]:
    """Tensors and closures ``fwd()`` / ``fwd_bwd()`` for one provider and shape."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / math.sqrt(k)).requires_grad_(False)
    a = (torch.randn(r, k, device="cuda", dtype=dtype, generator=gen) / math.sqrt(k)).requires_grad_()
    b = (torch.randn(n, r, device="cuda", dtype=dtype, generator=gen) / math.sqrt(r)).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    scaling = 2.0
    if name == "frozen":
        inputs = [x]

        def fwd() -> torch.Tensor:
            return torch.nn.functional.linear(x, w)
    elif name == "eager":
        inputs = [x, a, b]

        def fwd() -> torch.Tensor:
            return peft_style_lora_linear(x, w, a, b, scaling=scaling, dropout_p=p)
    elif name == "compile":
        inputs = [x, a, b]
        compiled = COMPILED.setdefault("fn", torch.compile(peft_style_lora_linear, dynamic=True))

        def fwd() -> torch.Tensor:
            return compiled(x, w, a, b, scaling=scaling, dropout_p=p)
    else:
        inputs = [x, a, b]

        def fwd() -> torch.Tensor:
            return fused_lora_linear(x, w, a, b, scaling=scaling, dropout_p=p)

    def fwd_bwd() -> None:
        torch.autograd.grad(fwd(), inputs, dy)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd, "params": [w, a, b]}


COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def graph_time(fn: Callable[[], object], rep: int, attempts: int = 2) -> float:
    """Median time of ``fn`` replayed from a CUDA graph; NaN if it cannot be captured in ``attempts`` tries.

    A capture can fail once and succeed on the next try in the same process (H100, 2026-11-26: one of
    48 captures of ``ab_configs.py`` ended with ``cudaErrorStreamCaptureInvalidated``, the row's
    other rounds captured), so a failure is retried before the row is given up.
    """
    for attempt in range(1, attempts + 1):
        try:
            return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        except Exception as exc:  # report and go on: the eager timing of the row still stands
            print(f"  CUDA graph capture failed ({attempt} of {attempts}): {type(exc).__name__}: {exc}", flush=True)
    return math.nan


def run(
    layers: list[tuple[str, int, int]],
    ms: list[int],
    providers: list[str],
    r: int,
    p: float,
    rep: int,
    graphs: bool,
) -> list[dict[str, object]]:
    """Time every (layer, m, provider); print one line per row."""
    rows: list[dict[str, object]] = []
    dtype = torch.bfloat16
    for layer, n, k in layers:
        for m in ms:
            for provider in providers:
                bench = make_provider(provider, m, n, k, r, p, dtype)
                fwd, fwd_bwd = bench["fwd"], bench["fwd_bwd"]
                assert callable(fwd)
                assert callable(fwd_bwd)
                fwd_bwd()
                torch.cuda.synchronize()
                fwd_ms = do_bench(fwd, warmup=25, rep=rep, return_mode="median")
                fwd_bwd_ms = do_bench(fwd_bwd, warmup=25, rep=rep, return_mode="median")
                graph_ms = graph_time(fwd_bwd, rep) if graphs else math.nan
                params = bench["params"]
                assert isinstance(params, list)
                row = {
                    "op": "lora_linear",
                    "layer": layer,
                    "m": m,
                    "n": n,
                    "k": k,
                    "r": r,
                    "p": p,
                    "dtype": "bfloat16",
                    "provider": provider,
                    "fwd_ms": round(fwd_ms, 5),
                    "fwd_bwd_ms": round(fwd_bwd_ms, 5),
                    "fwd_bwd_graph_ms": round(graph_ms, 5),
                    "saved_bytes": saved_bytes(fwd, params),
                }
                rows.append(row)
                print(f"{layer:24s} m={m:6d} {provider:8s} fwd {fwd_ms:8.4f} ms  fwd+bwd {fwd_bwd_ms:8.4f} ms  "
                      f"graph {graph_ms:8.4f} ms  saved {row['saved_bytes'] / 2**20:8.1f} MiB", flush=True)  # fmt: skip
                del bench
            torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict[str, object]], field: str = "fwd_bwd_ms") -> dict[str, float]:
    """Geometric means over the grid of time ratios of ``field``: fused/frozen, eager/fused, eager/frozen, ..."""
    by_key: dict[tuple[object, ...], dict[str, float]] = {}
    for row in rows:
        value = row[field]
        assert isinstance(value, float)
        by_key.setdefault((row["n"], row["k"], row["m"]), {})[str(row["provider"])] = value

    def geomean(a: str, b: str) -> float:
        ratios = [v[a] / v[b] for v in by_key.values() if a in v and b in v and math.isfinite(v[a] / v[b])]
        return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.nan

    return {
        "fused_over_frozen": geomean("fused", "frozen"),
        "eager_over_fused": geomean("eager", "fused"),
        "eager_over_frozen": geomean("eager", "frozen"),
        "compile_over_fused": geomean("compile", "fused"),
    }


def provenance(script: str, argv: list[str] | None) -> dict[str, object]:
    """Device, GPU key, versions, date and command line: the header of every results file."""
    name = torch.cuda.get_device_name()
    return {
        "device": name,
        "gpu_key": gpu_key(name),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "lorafusion_kernels": lorafusion_kernels.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "command": without_machine_paths(" ".join([script, *(argv if argv is not None else sys.argv[1:])])),
    }


REPO_ROOT = Path(__file__).resolve().parents[3]


def without_machine_paths(text: str) -> str:
    """``text`` (a command line, a profile) with no machine's folders in it.

    The device tool's ``$OUT`` is written as ``$OUT``, the Python installation's packages as
    ``<site-packages>/`` and the repository root is dropped (paths become repository-relative).
    """
    out = os.environ.get("OUT", "")
    if len(out) > 1:
        text = text.replace(out.rstrip("/"), "$OUT")
    for folder in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        text = text.replace(f"{folder}/", "<site-packages>/")
    return text.replace(f"{REPO_ROOT}/", "")


def write_results(out: Path, suffix: str, result: dict[str, object]) -> None:
    """Write ``result`` as ``<out>/<gpu-key><suffix>.json`` (sorted keys, reviewable diffs)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu_key(torch.cuda.get_device_name())}{suffix}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the grid, write ``<out>/<gpu-key>.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--m", type=int, nargs="*", default=M_VALUES)
    parser.add_argument("--layers", nargs="*", default=None, help="substrings of layer names to keep")
    parser.add_argument("--providers", nargs="*", default=PROVIDERS)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition budget in ms")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing")
    args = parser.parse_args(argv)
    layers = [lay for lay in LAYERS if args.layers is None or any(s in lay[0] for s in args.layers)]
    rows = run(layers, args.m, args.providers, args.r, args.p, args.rep, not args.no_graphs)
    result = {
        **provenance("bench_lora.py", argv),
        "summary": {
            "fwd_bwd": summarize(rows),
            "fwd_bwd_graph": summarize(rows, "fwd_bwd_graph_ms"),
            "fwd": summarize(rows, "fwd_ms"),
        },
        "rows": rows,
    }
    print(json.dumps(result["summary"], indent=2))
    write_results(args.out, "", result)


if __name__ == "__main__":
    main()
