"""``lorafusion-tune``: time every candidate config of every kernel on the real layer shapes, write the winners.

Usage (on the GPU to tune; the file goes to ``--out``, named after the GPU)::

    lorafusion-tune --out packages/lorafusion-kernels/src/lorafusion_kernels/configs
    lorafusion-tune --models llama-3.1-8b --m 4096 8192 --r 16   # a quick subset

The written file is deterministic given the measurements: entries sorted by shape, keys sorted,
each kernel's default the config that won most often (ties: earliest candidate).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lorafusion_kernels.__about__ import __version__
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning.config import (
    ConfigFile,
    KernelConfig,
    KernelTable,
    ShapeKey,
    TunedEntry,
    dtype_name,
    dumps,
)
from lorafusion_kernels.tuning.device import capability, gpu_key
from lorafusion_kernels.tuning.search_space import CANDIDATES, M_VALUES, MODEL_LAYERS, RANKS, SEARCH_SPACE_ID

KERNELS = ["xa", "xw_sb", "dys_dyb", "dsx", "dyw_dsa"]


def _kernel_call(
    kernel: str, m: int, n: int, k: int, r: int, dtype: torch.dtype, p: float
) -> Callable[[KernelConfig], Callable[[], object]]:
    """Inputs for one shape, and a factory ``config -> zero-argument launch`` for ``kernel``."""
    from lorafusion_kernels._kernels.lora_dsx import lora_dsx
    from lorafusion_kernels._kernels.lora_dys_dyb import lora_dys_dyb
    from lorafusion_kernels._kernels.lora_dyw_dsa import lora_dyw_dsa
    from lorafusion_kernels._kernels.lora_xa import lora_xa
    from lorafusion_kernels._kernels.lora_xw_sb import lora_xw_sb
    from lorafusion_kernels.dropout import keep_threshold, seed_tensor

    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype) / math.sqrt(k)
    a = torch.randn(r, k, device=dev, dtype=dtype) / math.sqrt(k)
    b = torch.randn(n, r, device=dev, dtype=dtype) / math.sqrt(r)
    s = torch.randn(m, r, device=dev, dtype=dtype)
    dy = torch.randn(m, n, device=dev, dtype=dtype)
    seed = seed_tensor(1234, dev)
    inv_keep, threshold, has_dropout = 1.0 / (1.0 - p), keep_threshold(p), p > 0
    calls: dict[str, Callable[[KernelConfig], Callable[[], object]]] = {
        "xa": lambda c: (
            lambda: lora_xa(x, a, scale=2.0, keep_threshold=threshold, seed=seed, has_dropout=has_dropout, config=c)
        ),
        "xw_sb": lambda c: lambda: lora_xw_sb(x, w, s, b, None, config=c),
        "dys_dyb": lambda c: lambda: lora_dys_dyb(dy, b, s, scaling=2.0, config=c),
        "dsx": lambda c: (
            lambda: lora_dsx(
                s,
                x,
                out_dtype=dtype,
                inv_keep=inv_keep,
                keep_threshold=threshold,
                seed=seed,
                has_dropout=has_dropout,
                config=c,
            )
        ),
        "dyw_dsa": lambda c: (
            lambda: lora_dyw_dsa(
                dy, w, s, a, inv_keep=inv_keep, keep_threshold=threshold, seed=seed, has_dropout=has_dropout, config=c
            )
        ),
    }
    return calls[kernel]


def _say(message: str) -> None:
    """Progress line on stdout (this is a CLI), flushed so logs of a killed run keep it."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def _time(fn: Callable[[], object], rep: int) -> float:
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))
    except Exception as exc:  # a candidate that fails to compile or launch (e.g. out of shared memory) loses
        _say(f"    candidate failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return math.inf


def _cublas_gemm(m: int, n: int, k: int, dtype: torch.dtype) -> Callable[[], object]:
    """``x W^T`` through torch (cuBLAS): the frozen layer's time, logged next to each shape's winners."""
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    return lambda: x @ w.T


def tune(
    *,
    models: list[str],
    ms: list[int],
    ranks: list[int],
    kernels: list[str],
    dtype: torch.dtype = torch.bfloat16,
    p: float = 0.1,
    rep: int = 30,
) -> ConfigFile:
    """Sweep and return the config file for the current GPU.

    Raises:
        LoRAFusionKernelsError: for an unknown model or kernel name.
    """
    for model in models:
        if model not in MODEL_LAYERS:
            raise LoRAFusionKernelsError(f"unknown model {model!r}; choose from {sorted(MODEL_LAYERS)}")
    for kernel in kernels:
        if kernel not in CANDIDATES:
            raise LoRAFusionKernelsError(f"unknown kernel {kernel!r}; choose from {sorted(CANDIDATES)}")
    shapes = sorted({(n, k) for model in models for _, n, k in MODEL_LAYERS[model]})
    entries: dict[str, list[TunedEntry]] = collections.defaultdict(list)
    for n, k in shapes:
        for m in ms:
            for r in ranks:
                cublas = _time(_cublas_gemm(m, n, k, dtype), rep)
                _say(f"m={m} n={n} k={k} r={r}: cuBLAS x W^T {cublas:.4f} ms")
                for kernel in kernels:
                    factory = _kernel_call(kernel, m, n, k, r, dtype, p)
                    timed = [(_time(factory(c), rep), i) for i, c in enumerate(CANDIDATES[kernel])]
                    best_ms, best_index = min(timed)
                    best = CANDIDATES[kernel][best_index]
                    key = ShapeKey(m=m, n=n, k=k, r=r, dtype=dtype_name(dtype))
                    entries[kernel].append(TunedEntry(key=key, config=best, ms=best_ms))
                    _say(f"  {kernel:8s} {best_ms:.4f} ms  {best.to_dict()}")
                torch.cuda.empty_cache()
    tables = {}
    for kernel, found in entries.items():
        wins = collections.Counter(CANDIDATES[kernel].index(e.config) for e in found)
        default_index = min(wins, key=lambda i: (-wins[i], i))
        tables[kernel] = KernelTable(default=CANDIDATES[kernel][default_index], entries=tuple(found))
    import triton

    name = torch.cuda.get_device_name()
    return ConfigFile(
        device_name=name,
        device_key=gpu_key(name),
        capability=capability(torch.cuda.current_device()),
        provenance={
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "lorafusion_kernels": __version__,
            "search_space": SEARCH_SPACE_ID,
            "kernels": ",".join(kernels),
            "sweep": f"models={','.join(models)} m={','.join(map(str, ms))} r={','.join(map(str, ranks))} "
            f"dtype={dtype_name(dtype)} p={p}",
        },
        kernels=tables,
    )


def merge(old: ConfigFile, new: ConfigFile) -> ConfigFile:
    """``new`` on top of ``old``: kernels not re-tuned keep their tables; re-tuned ones gain or replace entries.

    The provenance is the new run's, with the old sweep recorded under ``merged_from``.
    """
    kernels = dict(old.kernels)
    for name, table in new.kernels.items():
        keys = {e.key for e in table.entries}
        kept = tuple(e for e in kernels[name].entries if e.key not in keys) if name in kernels else ()
        kernels[name] = KernelTable(default=table.default, entries=kept + table.entries)
    provenance = dict(new.provenance)
    provenance["merged_from"] = f"{old.provenance.get('date', '?')}: {old.provenance.get('sweep', '?')}"
    return dataclasses.replace(new, kernels=kernels, provenance=provenance)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lorafusion-tune``."""
    parser = argparse.ArgumentParser(prog="lorafusion-tune", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_LAYERS), choices=sorted(MODEL_LAYERS))
    parser.add_argument("--m", nargs="+", type=int, default=M_VALUES)
    parser.add_argument("--r", nargs="+", type=int, default=RANKS)
    parser.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability the kernels are timed with")
    parser.add_argument("--rep", type=int, default=30, help="do_bench repetition budget per candidate, ms")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for <gpu-key>.json")
    parser.add_argument("--merge", type=Path, default=None, help="an existing file to update instead of replace")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        _say("lorafusion-tune needs a CUDA GPU")
        return 2
    result = tune(models=args.models, ms=args.m, ranks=args.r, kernels=args.kernels, p=args.p, rep=args.rep)
    if args.merge is not None and args.merge.is_file():
        result = merge(ConfigFile.from_json(json.loads(args.merge.read_text()), where=str(args.merge)), result)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result.device_key}.json"
    path.write_text(dumps(result))
    _say(json.dumps({k: v.default.to_dict() for k, v in result.kernels.items()}, indent=1))
    _say(f"wrote {path}")
    return 0
