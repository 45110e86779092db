"""Where the trainer's forward + backward spends its time on a GPU: GPU time by kind of kernel, and idle time.

Run on a GPU (from the repository root, the packages' ``src`` folders on ``PYTHONPATH``)::

    python packages/lorafusion-megatron/benchmarks/profile_trainer.py --out $OUT/profile_trainer.json

The first ``--microbatches`` microbatches of ``bench_trainer.py``'s joint plan (same preset, Het jobs,
LoRA and capacity), run the way ``bench_trainer.py`` runs them, for each of ``--modes``:

* ``frozen``, ``peft-mixed``, ``lorafusion``: as in ``bench_trainer.py``;
* ``causal``: one causal sequence of ``--capacity`` random tokens per microbatch through HF's own
  forward with sdpa and ``labels`` (the full logits, HF's loss), the base model alone, gradients
  through the activations: how the trainer issue measured its frozen floor.

Each mode runs its microbatches once untimed, once timed (wall time between two synchronisations,
set-up such as patching the model and switching adapters outside the clock, as in
``bench_trainer.py``) and once under ``torch.profiler``. ``--read-back next each`` runs each mode
both ways, ``--rounds`` repeats it all (A/B/A/B in one process, on one machine: host-bound
figures differ between machines).

Reported per mode: wall milliseconds per microbatch, the GPU's busy time (the kernels' summed
device time) and idle time (wall less busy: the GPU waiting for the host), the busy time by kind
of kernel (GEMM, attention, LoRAFusion's Triton kernels, the rest), the ``--top`` kernels by
time, and the gaps between kernels by length and by the kernel that ended them. With ``--host``,
also where the host's time goes in one more run:
the ``--top`` functions of ``cProfile`` by own time, the ``--top`` torch ops by self CPU time, and
the calls that wait for the GPU (synchronisations and device-to-host copies).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_trainer import ModeRun, Workload, het_config, planned
from gpu_time import gpu_time
from provenance import provenance
from torch.profiler import ProfilerActivity, profile

from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.config import parse_config
from lorafusion_megatron.model import attach_adapters, build_base_model, resolve_attn_implementation
from lorafusion_megatron.trainer import prepare_data

MODES = ("causal", "frozen", "peft-mixed", "lorafusion", "lorafusion-siblings")


def causal_steps(model: Any, batches: int, tokens: int, device: torch.device) -> Callable[[], float]:
    """``batches`` forward + backward passes of one causal ``tokens``-long sequence through HF's forward.

    The returned function runs them and returns their seconds (device synchronised), as
    ``ModeRun.run`` does for the other modes.
    """
    causal_lm = model.base_model.model
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = [
        torch.randint(0, causal_lm.config.vocab_size, (1, tokens), generator=generator).to(device)
        for _ in range(batches)
    ]

    def run() -> float:
        previous = causal_lm.config._attn_implementation
        causal_lm.set_attn_implementation("sdpa")
        try:
            with model.disable_adapter():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for input_ids in ids:
                    causal_lm(input_ids=input_ids, labels=input_ids).loss.backward()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
        finally:
            causal_lm.set_attn_implementation(previous)
        model.zero_grad(set_to_none=True)
        return seconds

    return run


def profiled(run: Callable[[], float], microbatches: int, top: int) -> dict[str, Any]:
    """Wall and GPU time per microbatch of ``run`` (which runs ``microbatches`` and returns their seconds).

    The wall time is what ``run`` measured (set-up outside its clock excluded); the GPU time covers
    the whole call, set-up included (it launches next to nothing).
    """
    run()  # untimed: compilation, tuning, allocator warm-up
    wall_ms = run() * 1e3 / microbatches
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return gpu_time(prof, microbatches, wall_ms, top)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def host_profile(run: Callable[[], float], top: int) -> dict[str, Any]:
    """Where one ``run`` spends host time: ``cProfile`` by own and by cumulative time, torch ops by self CPU
    time, GPU waits."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    waits = {event.key: event.count for event in averages if event.key.startswith(SYNC_EVENTS)}
    table = averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    return {"cprofile": text.getvalue(), "torch_ops": table, "gpu_waits": waits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=16, help="samples per job (the plan the microbatches come from)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=1, help="times every combination runs (for A/B/A/B)")
    parser.add_argument(
        "--read-back",
        nargs="+",
        default=["next"],
        choices=("next", "each"),
        help="when loss sums are read (see bench_trainer.py); several: each mode runs with each",
    )
    parser.add_argument("--host", nargs="*", default=[], choices=MODES, help="modes to profile on the host too")
    parser.add_argument("--out", type=Path, default=Path("profile_trainer.json"))
    args = parser.parse_args()
    # The settings bench_trainer.py uses, so the microbatches are the ones it times.
    bench_args = argparse.Namespace(
        preset=args.preset, dtype="bfloat16", attn="auto", samples=args.samples, length_scale=1.0,
        global_batch_size=16, capacity=args.capacity, device="cuda", checkpointing=False,
    )  # fmt: skip
    device = torch.device("cuda")
    config = parse_config(het_config(bench_args, Path(tempfile.gettempdir()) / "profile-trainer"))
    data = prepare_data(config).jobs
    _, joint = planned(config, data, device)
    work = Workload(batches=joint.batches[: args.microbatches], denominators=joint.denominators)

    base = build_base_model(config.base_model, device=device, seed=0)
    base.enable_input_require_grads()  # type: ignore[no-untyped-call]
    model = attach_adapters(base, config.jobs, seed=0, name_or_path=args.preset)
    runner_args = {
        "adapters": [job.name for job in config.jobs],
        "attn_implementation": resolve_attn_implementation(config.base_model.attn_implementation, device),
        "dtype": torch.bfloat16,
    }
    results = {}
    for round_, mode, read_back in itertools.product(range(args.rounds), args.modes, args.read_back):
        name = "/".join(
            [mode]
            + ([f"read-back-{read_back}"] if len(args.read_back) > 1 else [])
            + ([f"round-{round_}"] if args.rounds > 1 else [])
        )
        if mode == "causal":
            run = causal_steps(model, len(work.batches), args.capacity, device)
        else:
            mode_run = ModeRun(mode, model, runner_args, work, device, read_back=read_back)
            run = functools.partial(mode_run.run, work.batches)
        r = results[name] = profiled(run, len(work.batches), args.top)
        print(f"{name}: {r['wall_ms']:.1f} ms per microbatch, GPU busy {r['busy_ms']:.1f}, idle {r['idle_ms']:.1f}")
        print("    by kind (ms): " + ", ".join(f"{kind} {ms:.1f}" for kind, ms in r["kinds_ms"].items()))
        for kernel, ms in r["top_kernels_ms"].items():
            print(f"    {ms:8.3f}  {kernel}")
        print("    idle by gap length (ms): " + ", ".join(f"{k} {v}" for k, v in r["gaps"]["by_length_ms"].items()))
        for kernel, ms in r["gaps"]["by_next_kernel_ms"].items():
            print(f"    idle {ms:8.3f}  before {kernel}")
        if mode in args.host:
            r["host"] = host_profile(run, 3 * args.top)
            print(r["host"]["cprofile"], r["host"]["torch_ops"], "GPU waits:", r["host"]["gpu_waits"], sep="\n")
    report = {
        "provenance": provenance(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "tokens_per_microbatch": [batch.num_tokens for batch in work.batches],
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(args.out, report)


if __name__ == "__main__":
    main()
