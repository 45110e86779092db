"""Where a LoRA layer's forward+backward spends its time: GPU time per kernel, and host time per call.

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/profile_lora.py \
        --out $OUT/profile

Two measurements, for the providers of ``bench_lora.py`` (``frozen``, ``eager``, ``fused``) and of
``bench_multi_lora.py`` (``fused_multi`` with ``--adapters`` even segments):

- **Kernels**: ``torch.profiler`` over ``--iters`` forward+backward calls at each layer shape and M,
  for every ``p`` in ``--p``; each GPU kernel's mean time per call, summed by kernel name (the
  Triton kernels by their function name, the cuBLAS GEMMs and small torch ops by theirs). Their sum
  is the GPU time of one call with no gaps; ``bench_lora.py``'s CUDA-graph timing is the same up to
  the gaps between kernels.
- **Host**: wall time per forward+backward at ``M = --host-m`` tokens (so small that the GPU waits
  for the CPU: the time is the Python, dispatch and launch cost of one call), median of ``--iters``
  calls timed in blocks (and the time to issue them: close to the wall time when the GPU waits), and
  for ``fused`` and ``fused_multi`` the top functions of ``cProfile`` and the top ops of
  ``torch.profiler`` by self CPU time.

Writes ``<out>/<gpu-key>-profile.json`` and prints tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import bench_lora
import bench_multi_lora
import torch
from bench_lora import LAYERS, provenance, without_machine_paths, write_results
from torch.profiler import ProfilerActivity, profile

SINGLE_PROVIDERS = ["frozen", "eager", "fused"]


def make(provider: str, m: int, n: int, k: int, r: int, p: float, adapters: int) -> Callable[[], None]:
    """The forward+backward closure of ``provider`` at one shape (bf16)."""
    if provider == "fused_multi":
        lengths = bench_multi_lora.segment_lengths(m, adapters, "even")
        bench = bench_multi_lora.make_provider(provider, m, n, k, r, p, lengths, torch.bfloat16)
    else:
        bench = bench_lora.make_provider(provider, m, n, k, r, p, torch.bfloat16)
    fn = bench["fwd_bwd"]
    assert callable(fn)
    return fn


def kernel_times(fn: Callable[[], None], iters: int) -> dict[str, float]:
    """Mean GPU microseconds per call of ``fn``, by kernel name (sorted, largest first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / iters
    return dict(sorted(((name, round(us, 2)) for name, us in totals.items()), key=lambda kv: -kv[1]))


def host_time(fn: Callable[[], None], iters: int) -> dict[str, float]:
    """Microseconds per call of ``fn`` over blocks of 10 calls, medians: ``wall`` and ``issue``.

    ``issue`` stops the clock before the closing synchronisation: when it is close to ``wall``, the
    GPU waited for the CPU (the call is host-bound).
    """
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    walls, issues = [], []
    for _ in range(max(1, iters // 10)):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) / 10 * 1e6)
        issues.append((issued - start) / 10 * 1e6)
    return {"wall": round(statistics.median(walls), 1), "issue": round(statistics.median(issues), 1)}


def host_ops(fn: Callable[[], None], iters: int, top: int) -> str:
    """``torch.profiler`` CPU view of ``iters`` calls: the ``top`` ops by self CPU time, as a table."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70)


def host_profile(fn: Callable[[], object], iters: int, top: int, sort: str = "tottime") -> str:
    """``cProfile`` of ``iters`` calls: the ``top`` functions by ``sort`` (own time by default), as text."""
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    return without_machine_paths(text.getvalue())


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, profile, write ``<out>/<gpu-key>-profile.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--layers", nargs="*", default=["llama8b"], help="substrings of layer names to keep")
    parser.add_argument("--m", type=int, nargs="*", default=[8192])
    parser.add_argument("--p", type=float, nargs="*", default=[0.1, 0.0])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--host-m", type=int, default=64)
    parser.add_argument("--top", type=int, default=25, help="cProfile functions to keep")
    args = parser.parse_args(argv)
    layers = [lay for lay in LAYERS if any(s in lay[0] for s in args.layers)]
    providers = [*SINGLE_PROVIDERS, "fused_multi"]
    kernels = []
    for layer, n, k in layers:
        for m in args.m:
            for p in args.p:
                for provider in providers:
                    times = kernel_times(make(provider, m, n, k, args.r, p, args.adapters), args.iters)
                    kernels.append({"layer": layer, "m": m, "n": n, "k": k, "p": p, "provider": provider,
                                    "total_us": round(sum(times.values()), 1), "kernels_us": times})  # fmt: skip
                    print(f"{layer} m={m} p={p} {provider}: {sum(times.values()):.1f} us", flush=True)
                    for name, us in times.items():
                        print(f"    {us:9.2f}  {name}", flush=True)
    _, n, k = layers[0]
    host = {}
    profiles = {}
    for provider in providers:
        fn = make(provider, args.host_m, n, k, args.r, args.p[0], args.adapters)
        host[provider] = host_time(fn, args.iters * 10)
        print(f"host m={args.host_m} {provider}: {host[provider]} us per forward+backward", flush=True)
        if provider in ("fused", "fused_multi"):
            profiles[provider] = host_profile(fn, args.iters, args.top) + host_ops(fn, args.iters, args.top)
            print(profiles[provider], flush=True)
    result = {
        **provenance("profile_lora.py", argv),
        "kernels": kernels,
        "host_us": {"m": args.host_m, "n": n, "k": k, "p": args.p[0], "per_provider": host},
        "host_profiles": profiles,
    }
    write_results(args.out, "-profile", result)


if __name__ == "__main__":
    main()
