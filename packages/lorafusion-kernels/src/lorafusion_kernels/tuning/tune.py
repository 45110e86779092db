"""The sweep behind ``lorafusion-tune``: time every candidate config of every kernel on the real layer shapes.

The FusedLoRA kernels (``xa``, ``xw_sb``, ``dys_dyb``, ``dsx``, ``dyw_dsa``) are timed with one
adapter, the FusedMultiLoRA kernels (``multi_xa``, ...) on a microbatch of ``adapters`` adapters
splitting the ``m`` tokens evenly; both are keyed by ``(m, n, k, r, dtype)``, ``r`` being the
(largest) rank. The config file built from a sweep is deterministic given the measurements: entries
sorted by shape, keys sorted, each kernel's default the config that won most often (ties: earliest
candidate).

Each kernel's candidates, and the config the file gives it today, are timed in ``rounds``
interleaved rounds, forward then backward order, and ranked by their mean over the rounds, so
timings that drift steadily during a shape's sweep shift every candidate alike. (Timed one after
the other, on one H100 on 2026-11-25 with ``--rep 20``, the config in the file, timed once after
the sweep, came out between 11% faster and 23% slower than the same config inside the sweep.)

The command line (options, ``--compare``, ``--coverage``, writing the file) is
:mod:`lorafusion_kernels.tuning.cli`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from lorafusion_kernels.__about__ import __version__
from lorafusion_kernels._kernels._common import exact_stages
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning.agreement import (
    ShapeTimings,
)
from lorafusion_kernels.tuning.config import (
    ConfigFile,
    KernelConfig,
    KernelTable,
    ShapeKey,
    TunedEntry,
    dtype_name,
)
from lorafusion_kernels.tuning.device import capability, gpu_key
from lorafusion_kernels.tuning.launches import (
    MULTI_ADAPTER_KERNELS,
    SINGLE_ADAPTER_KERNELS,
    LayerProblem,
    can_be_looked_up,
    config_key,
    kernel_launches,
)
from lorafusion_kernels.tuning.parallel import (
    JobsOutcome,
    layer_jobs,
    points_done,
    read_job_results,
    run_jobs,
    subprocess_runner,
)
from lorafusion_kernels.tuning.search_space import (
    CANDIDATES,
    MULTI_ADAPTERS,
    SEARCH_SPACE_ID,
)

KERNELS = [*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS]

Timer = Callable[[Callable[[], object]], float]
"""Median milliseconds of a zero-argument launch (``math.inf`` if it fails)."""


def say(message: str) -> None:
    """Progress line on stdout (this is a CLI), flushed so logs of a killed run keep it."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


TIMERS = ("graph", "events")
"""``graph``: GPU time of launches replayed from a CUDA graph; ``events``: ``do_bench``'s eager launches."""


def gpu_timer(rep: int, kind: str = "graph") -> Timer:
    """Median milliseconds over a ``rep`` ms budget; a candidate that fails to compile or launch loses.

    ``graph`` (``triton.testing.do_bench_cudagraph``) times GPU work alone, as the benchmarks' CUDA-graph
    columns do. ``events`` (``triton.testing.do_bench``: eager launches, L2 flushed before each) also
    counts the time the GPU waits for the host between the flush and the launch, a large part of a
    pass of tens of microseconds (H100, 2026-11-25: the multi-adapter shrink's candidates at 8,192 x
    4,096 took 47-135 us with ``events``, 35-66 us with ``graph``).

    Raises:
        LoRAFusionKernelsError: for an unknown ``kind``.
    """
    from triton.testing import do_bench, do_bench_cudagraph

    if kind not in TIMERS:
        raise LoRAFusionKernelsError(f"unknown timer {kind!r}; choose from {TIMERS}")

    def bench(fn: Callable[[], object]) -> float:
        if kind == "graph":
            return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))

    def timer(fn: Callable[[], object]) -> float:
        try:
            return bench(fn)
        except Exception as exc:  # a candidate that fails to compile or launch (e.g. out of shared memory) loses
            _say_failed(exc)
            return math.inf

    return timer


def _say_failed(exc: Exception) -> None:
    say(f"    candidate failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}")


def _with_exact_stages(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` launching its config's stages as given: one that does not fit in shared memory fails."""

    def run() -> object:
        with exact_stages():
            return fn()

    return run


def _frozen_gemm(problem: LayerProblem) -> Callable[[], object]:
    """``x W^T`` through torch (cuBLAS): the frozen layer's time, logged next to each shape's winners."""
    x = torch.randn(problem.m, problem.k, device=problem.device, dtype=problem.dtype)
    w = torch.randn(problem.n, problem.k, device=problem.device, dtype=problem.dtype)
    return lambda: x @ w.T


def interleaved_times(launches: Sequence[Callable[[], object]], timer: Timer, rounds: int) -> list[float]:
    """Mean time of each launch over ``rounds`` rounds, the order reversed every other round.

    Every launch is first called once, untimed, so that no compilation happens inside a round.
    Compiled inside round 0 (a cold compile cache, as for the first shape of a run), the candidates
    left the GPU idle between timings, and round 0 came out about 3% faster than the later rounds
    (H100, 2026-11-26, four rounds of large GEMMs; its first timings up to 6%). With a warm cache,
    with or without the first calls, round 0 was 0-1.2% faster: a smaller effect these calls do
    not remove, which the reversed rounds below spread over all candidates.
    Round 0 then times launches ``0, 1, ..., n-1``, round 1 ``n-1, ..., 0``, and so on, so with an
    even ``rounds`` every launch's mean position in the sequence is the same: a linear drift of the
    timings over the sweep adds the same amount to every mean. A launch that raises on its first
    call, or whose timing fails (``inf``), is not timed again.

    Raises:
        LoRAFusionKernelsError: if ``rounds < 1``.
    """
    if rounds < 1:
        raise LoRAFusionKernelsError(f"rounds must be at least 1, got {rounds}")
    samples: list[list[float]] = [[] for _ in launches]
    for launch, launch_samples in zip(launches, samples, strict=True):
        try:
            launch()
        except Exception as exc:  # as in the timer: a candidate that cannot compile or launch loses
            _say_failed(exc)
            launch_samples.append(math.inf)
    for round_index in range(rounds):
        order = range(len(launches)) if round_index % 2 == 0 else reversed(range(len(launches)))
        for i in order:
            if math.inf in samples[i]:
                continue
            samples[i].append(timer(launches[i]))
    return [math.inf if math.inf in times else sum(times) / len(times) for times in samples]


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """What a sweep measured: the winners, every candidate's time, and how much of the grid it covered."""

    entries: Mapping[str, Sequence[TunedEntry]]
    timings: Sequence[ShapeTimings]
    points_done: int
    points_total: int


def sweep(
    *,
    shapes: Sequence[tuple[int, int]],
    ms: Sequence[int],
    ranks: Sequence[int],
    kernels: Sequence[str],
    timer: Timer,
    candidates: Mapping[str, Sequence[KernelConfig]] = CANDIDATES,
    dtype: torch.dtype = torch.bfloat16,
    p: float = 0.1,
    adapters: int = MULTI_ADAPTERS,
    device: str = "cuda",
    time_limit_s: float | None = None,
    rounds: int = 2,
) -> SweepResult:
    """Time every candidate of every kernel at every ``(n, k)`` of ``shapes``, ``m`` and ``r``; keep the winners.

    Entries are keyed by :func:`~lorafusion_kernels.tuning.launches.config_key` (the shape the op looks
    up, e.g. ``(m, r, k)`` for the shrink), and a key another layer already gave is not timed again.

    Args:
        shapes: ``(n, k)`` layer shapes.
        ms: Token counts.
        ranks: LoRA ranks.
        kernels: Kernel names (see :data:`KERNELS`).
        timer: Times one launch (:func:`gpu_timer` on a GPU).
        candidates: Configs tried per kernel.
        dtype: Activation dtype.
        p: Dropout probability the kernels run with.
        adapters: Adapters in the FusedMultiLoRA kernels' microbatch.
        device: Where the inputs live (``"cpu"`` only under ``TRITON_INTERPRET=1``).
        time_limit_s: Start no new shape after this many seconds (the result says how far it got).
        rounds: Interleaved rounds per kernel and shape (:func:`interleaved_times`).

    Raises:
        LoRAFusionKernelsError: for a kernel without candidates.
    """
    for kernel in kernels:
        if kernel not in candidates:
            raise LoRAFusionKernelsError(f"unknown kernel {kernel!r}; choose from {sorted(candidates)}")
    points = [(n, k, m, r) for n, k in shapes for m in ms for r in ranks]
    entries: dict[str, list[TunedEntry]] = collections.defaultdict(list)
    timings: list[ShapeTimings] = []
    timed: set[tuple[str, ShapeKey]] = set()
    started = time.monotonic()
    done = 0
    for n, k, m, r in points:
        elapsed = time.monotonic() - started
        if time_limit_s is not None and elapsed >= time_limit_s:
            say(f"time limit of {time_limit_s:.0f} s reached after {done} of {len(points)} shapes")
            break
        problem = LayerProblem(m=m, n=n, k=k, r=r, dtype=dtype, p=p, adapters=adapters, device=device)
        say(f"m={m} n={n} k={k} r={r} (at {elapsed:.0f} s): torch x W^T {timer(_frozen_gemm(problem)):.4f} ms")
        # A kernel whose key another layer shape already gave (e.g. the shrink of every layer with
        # this k) is not timed again.
        keys = {kernel: config_key(kernel, problem) for kernel in kernels}
        todo = [kernel for kernel in kernels if (kernel, keys[kernel]) not in timed]
        for kernel, launch in kernel_launches(problem, todo).items():
            key = keys[kernel]
            timed.add((kernel, key))
            # The config the kernel launches with today (a multi kernel without entries: FusedLoRA's),
            # timed in the same rounds, last in the list, as it runs (with fewer stages where it does
            # not fit); a candidate that does not fit loses.
            exact = [_with_exact_stages(launch(config)) for config in candidates[kernel]]
            *times, current_ms = interleaved_times([*exact, launch(None)], timer, rounds)
            timings.append(ShapeTimings(kernel, key, dict(zip(candidates[kernel], times, strict=True)), current_ms))
            best_ms, second_ms = sorted(times)[:2] if len(times) > 1 else (times[0], math.inf)
            if math.isinf(best_ms):
                say(f"  {kernel:14s} every candidate failed: no entry")
                continue
            best = timings[-1].winner
            entries[kernel].append(TunedEntry(key=key, config=best, ms=best_ms))
            say(
                f"  {kernel:14s} {best_ms:.4f} ms (runner-up +{second_ms / best_ms - 1:.1%}, "
                f"looked-up config {current_ms:.4f} ms; key n={key.n} k={key.k})  {best.to_dict()}"
            )
        done += 1
        if device == "cuda":
            torch.cuda.empty_cache()
    say(f"swept {done} of {len(points)} shapes in {time.monotonic() - started:.0f} s")
    return SweepResult(entries=dict(entries), timings=timings, points_done=done, points_total=len(points))


def kernel_tables(
    entries: Mapping[str, Sequence[TunedEntry]], candidates: Mapping[str, Sequence[KernelConfig]] = CANDIDATES
) -> dict[str, KernelTable]:
    """One table per kernel: its entries, and as default the candidate that won most often (ties: earliest)."""
    out = {}
    for kernel, found in entries.items():
        wins = collections.Counter(list(candidates[kernel]).index(e.config) for e in found)
        default_index = min(wins, key=lambda i: (-wins[i], i))
        out[kernel] = KernelTable(default=candidates[kernel][default_index], entries=tuple(found))
    return out


def layer_shapes(models: Sequence[str], layers: Sequence[str] | None = None) -> list[tuple[int, int]]:
    """The distinct ``(N, K)`` of the models' layers named in ``layers`` (all of them for ``None``), sorted.

    Raises:
        LoRAFusionKernelsError: for an unknown model, or a layer name no listed model has.
    """
    return sorted((job.n, job.k) for job in layer_jobs(models, layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """What one ``lorafusion-tune`` run sweeps, and how it times it (the CLI's options)."""

    models: list[str]
    ms: list[int]
    ranks: list[int]
    kernels: list[str]
    layers: list[str] | None = None
    dtype: torch.dtype = torch.bfloat16
    p: float = 0.1
    adapters: int = MULTI_ADAPTERS
    rep: int = 30
    rounds: int = 2
    timer: str = "graph"

    def argv(self) -> list[str]:
        """The ``lorafusion-tune`` options of everything but the models and layers (bf16 only: the CLI's dtype)."""
        return [
            *("--m", *map(str, self.ms)),
            *("--r", *map(str, self.ranks)),
            *("--kernels", *self.kernels),
            *("--adapters", str(self.adapters), "--p", str(self.p), "--rep", str(self.rep)),
            *("--rounds", str(self.rounds), "--timer", self.timer),
        ]


def tune(plan: SweepPlan, time_limit_s: float | None = None) -> tuple[ConfigFile, Sequence[ShapeTimings]]:
    """Sweep on the current GPU; return its config file and every candidate's timings.

    ``plan.layers`` keeps only those layers of the models (e.g. ``["gate_up"]``); ``None`` keeps all.

    Raises:
        LoRAFusionKernelsError: for an unknown model, layer or kernel name.
    """
    result = sweep(
        shapes=layer_shapes(plan.models, plan.layers),
        ms=plan.ms,
        ranks=plan.ranks,
        kernels=plan.kernels,
        timer=gpu_timer(plan.rep, plan.timer),
        dtype=plan.dtype,
        p=plan.p,
        adapters=plan.adapters,
        time_limit_s=time_limit_s,
        rounds=plan.rounds,
    )
    name = torch.cuda.get_device_name()
    config_file = ConfigFile(
        device_name=name,
        device_key=gpu_key(name),
        capability=capability(torch.cuda.current_device()),
        provenance=_provenance(plan.kernels, sweep_text(plan, done=result.points_done, total=result.points_total)),
        kernels=kernel_tables(result.entries),
    )
    return config_file, result.timings


def sweep_text(plan: SweepPlan, *, done: int, total: int, gpus: int = 1) -> str:
    """The provenance's ``sweep``: what was swept, how, and how much of it (``done`` of ``total`` points)."""
    text = (
        f"models={','.join(plan.models)} m={','.join(map(str, plan.ms))} r={','.join(map(str, plan.ranks))} "
        f"dtype={dtype_name(plan.dtype)} p={plan.p} rep={plan.rep} rounds={plan.rounds} timer={plan.timer}"
    )
    if set(plan.kernels) & set(MULTI_ADAPTER_KERNELS):
        text += f" adapters={plan.adapters}"
    if plan.layers is not None:
        text += f" layers={','.join(plan.layers)}"
    if gpus > 1:
        text += f" gpus={gpus}"
    if done < total:
        text += f" (time limit: {done} of {total} shapes)"
    return text


def _provenance(kernels: Sequence[str], sweep: str) -> dict[str, str]:
    import triton

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "lorafusion_kernels": __version__,
        "search_space": SEARCH_SPACE_ID,
        "kernels": ",".join(kernels),
        "sweep": sweep,
    }


def tune_on_gpus(
    plan: SweepPlan, gpus: Sequence[str], workdir: Path, time_limit_s: float | None = None
) -> tuple[ConfigFile, Sequence[ShapeTimings], JobsOutcome]:
    """:func:`tune` spread over ``gpus`` (``CUDA_VISIBLE_DEVICES`` values), one layer shape per process.

    Each job's files and log stay in ``workdir/<model>-<layer>/``. The file's defaults are recomputed
    over every job's winners, as one process sweeping all the shapes would.

    Raises:
        LoRAFusionKernelsError: for an unknown model or layer name, or if no job wrote a file.
    """
    jobs = layer_jobs(plan.models, plan.layers)
    outcome = run_jobs(jobs, gpus, subprocess_runner(plan.argv(), workdir, say), time_limit_s)
    results = read_job_results(workdir, outcome.succeeded)
    per_job = len(plan.ms) * len(plan.ranks)
    done = sum(points_done(config_file, per_job) for config_file in results.files)
    text = sweep_text(plan, done=done, total=per_job * len(jobs), gpus=len(gpus))
    config_file = dataclasses.replace(
        results.files[0], provenance=_provenance(plan.kernels, text), kernels=kernel_tables(results.entries)
    )
    return config_file, results.timings, outcome


def merge(old: ConfigFile, new: ConfigFile, *, keep_defaults: bool = False) -> ConfigFile:
    """``new`` on top of ``old``: kernels not re-tuned keep their tables; re-tuned ones gain or replace entries.

    A re-tuned kernel takes the new run's default (its most frequent winner), or with
    ``keep_defaults`` keeps the old one: for a run over a few shapes or other ranks, whose winners
    say little about the shapes the default serves (on H100 the shrink's best tile at rank 48 is up
    to 12% slower than the rank-16 one at rank 16, and the rank-16 one 25-40% slower at rank 48).

    The provenance is the new run's; ``merged_from`` records the old run (date, sweep, kernels) followed
    by the old file's own ``merged_from``, so every entry's sweep stays on record. Old entries under a
    key the op never looks up (:func:`~lorafusion_kernels.tuning.launches.can_be_looked_up`) are dropped.

    Raises:
        LoRAFusionKernelsError: if the two files are for different GPUs.
    """
    if old.device_key != new.device_key:
        raise LoRAFusionKernelsError(
            f"cannot merge configs measured on {new.device_name!r} into a file for {old.device_name!r}: "
            f"give --merge the file of this GPU ({new.device_key}.json) or none"
        )
    kernels = {}
    dropped = 0
    for name, table in old.kernels.items():
        reachable = tuple(e for e in table.entries if can_be_looked_up(name, e.key))
        dropped += len(table.entries) - len(reachable)
        kernels[name] = dataclasses.replace(table, entries=reachable)
    if dropped:
        say(f"--merge: dropped {dropped} entries of the old file that no launch looks up (keyed by the layer)")
    for name, table in new.kernels.items():
        keys = {e.key for e in table.entries}
        kept = tuple(e for e in kernels[name].entries if e.key not in keys) if name in kernels else ()
        default = kernels[name].default if keep_defaults and name in kernels else table.default
        kernels[name] = KernelTable(default=default, entries=kept + table.entries)
    provenance = dict(new.provenance)
    get = old.provenance.get
    merged = f"{get('date', '?')}: {get('sweep', '?')} kernels={get('kernels', '?')}"
    if "merged_from" in old.provenance:
        merged += f"; {old.provenance['merged_from']}"
    provenance["merged_from"] = merged
    return dataclasses.replace(new, kernels=kernels, provenance=provenance)
