"""Tokens/s of the trainer's microbatch loop on a random-weight preset, 4 jobs on the Het workload.

Forward + backward (no optimizer) over packed microbatches of at most ``--capacity`` tokens (4,096
by default; the PEFT modes at ``--baseline-capacity``, since plain PEFT keeps more activations per
token and may not fit where the fused modes do), five ways through the same samples:

* ``frozen``: the joint plan's microbatches through the base model alone, one pass each, gradients
  through the activations only (the floor);
* ``peft-sequential``: each job alone, as a plain HF + PEFT loop would train the four one after
  another: the job's own plan (single-adapter microbatches), PEFT's own LoRA layers;
* ``peft-mixed``: the joint plan's mixed microbatches with PEFT's own LoRA layers, one pass per
  adapter segment (PEFT refuses mixed batches in training);
* ``lorafusion``: the joint plan, one pass per mixed microbatch through lorafusion-kernels (the
  model is patched for the fused modes only: the PEFT modes never run a fused kernel).
* ``lorafusion-siblings``: the same with q/k/v and gate/up as one call per group
  (``fuse_sibling_layers``, the trainer's default ``runtime.fuse_sibling_layers``).

Every mode times every microbatch of its plan, so every mode times every sample of the run, the
same real tokens (checked, and reported per mode); ``--samples`` sets the size of the run. Each
mode first runs each distinct microbatch shape once untimed (kernels compile and tune per shape),
then ``--repeats`` timed passes with the modes interleaved (frozen, peft-sequential, peft-mixed,
lorafusion, lorafusion-siblings, frozen, ...), the device synchronised around each pass. The report
gives the median tokens/s per mode, the min and max over the repeats and the peak memory of the timed passes,
under a provenance header (device, package versions, UTC date; ``provenance.py``). With
``--trainer [RUNS]``, the full trainer (optimizer steps included) then runs the same config end to
end, ``RUNS`` times in the same process (``--trainer-siblings``: with ``runtime.fuse_sibling_layers``):
the first with the allocator's cache emptied (it maps its memory as a fresh process does), the
others reusing what the run before freed. The report gives every run's tokens/s and how many
distinct microbatch token counts the trainer ran. ``--trainer-profile`` adds one more run whose
plan execution runs under ``torch.profiler``: the GPU's busy and idle time per microbatch, and the
idle gaps by the kernel that ended them (``gpu_time.py``, as ``profile_trainer.py`` reports them).

    python packages/lorafusion-megatron/benchmarks/bench_trainer.py --preset llama-3.1-8b --out bench.json
    python packages/lorafusion-megatron/benchmarks/bench_trainer.py --preset tiny --device cpu --dtype float32 \\
        --capacity 512 --length-scale 0.05 --samples 16 --global-batch-size 4   # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from gpu_time import gpu_time
from provenance import provenance
from torch.profiler import ProfilerActivity, profile

import lorafusion_kernels
from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.data.job_data import JobData
from lorafusion_megatron.model import attach_adapters, build_base_model, resolve_attn_implementation
from lorafusion_megatron.packing import PackedBatch, pack_microbatch
from lorafusion_megatron.pipeline.partition import recomputed_layers
from lorafusion_megatron.planning import make_plan, plan_from_json
from lorafusion_megatron.presets import PRESETS
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.trainer import Trainer, prepare_data
from lorafusion_sched.models import Plan

if TYPE_CHECKING:
    from collections.abc import Iterator

    from peft import PeftModel

HET = ("xsum", "cnndm", "wikisum", "mixed")
MODES = ("frozen", "peft-sequential", "peft-mixed", "lorafusion", "lorafusion-siblings")
FUSED_MODES = ("lorafusion", "lorafusion-siblings")


def het_config(
    args: argparse.Namespace, output: Path, *, capacity: int | None = None, fuse_sibling_layers: bool = False
) -> dict[str, Any]:
    """The benchmark's run: the four Het jobs on ``args.preset``, at ``capacity`` (default ``args.capacity``)."""
    return {
        "output_dir": str(output),
        "base_model": {"model_name_or_path": args.preset, "dtype": args.dtype, "attn_implementation": args.attn},
        "jobs": [
            {
                "name": name,
                "dataset": {"synthetic": name, "num_samples": args.samples, "length_scale": args.length_scale},
                "r": 16,
                "lora_alpha": 32,
                "lora_dropout": 0.1,
                "target_modules": "all-linear",
                "global_batch_size": args.global_batch_size,
            }
            for name in HET
        ],
        "scheduler": {"capacity": capacity or args.capacity, "padding_multiple": 64},
        "runtime": {
            "device": args.device,
            "seed": 0,
            "activation_checkpointing": args.checkpointing,
            "fuse_sibling_layers": fuse_sibling_layers,
        },
        "logging": {"progress_bar": False, "logging_steps": 1000},
    }


@dataclass
class Workload:
    """The packed microbatches a mode runs, their loss denominators and the samples they hold."""

    batches: list[PackedBatch] = field(default_factory=list)
    denominators: dict[tuple[str, int], int] = field(default_factory=dict)
    samples: set[tuple[str, int]] = field(default_factory=set)

    @property
    def tokens(self) -> int:
        return sum(batch.num_tokens for batch in self.batches)

    def extend(self, other: Workload) -> None:
        self.batches += other.batches
        self.denominators |= other.denominators
        self.samples |= other.samples


def planned(config: TrainerConfig, data: dict[str, JobData], device: torch.device) -> tuple[Plan, Workload]:
    """``config``'s plan and every non-no-op microbatch of it, packed."""
    plan = make_plan(config, data)
    chosen = [mb for mb in plan.microbatches if not mb.noop]
    segments = [seg for mb in chosen for seg in mb.segments]
    work = Workload(
        batches=[pack_microbatch(mb, data).to(device) for mb in chosen],
        denominators={
            (seg.adapter, seg.global_batch): data[seg.adapter].global_batch_targets(seg.global_batch)
            for seg in segments
        },
        samples={(seg.adapter, sample) for seg in segments for sample in seg.samples},
    )
    return plan, work


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def shape(batch: PackedBatch) -> tuple[int, ...]:
    """What the kernels of every mode see of a microbatch: its segments' token counts."""
    return tuple(span.length for span in batch.segments)


class ModeRun:
    """One mode's microbatches through the shared model, untimed (warm-up) or timed."""

    def __init__(
        self,
        mode: str,
        model: PeftModel,
        runner_args: dict[str, Any],
        work: Workload,
        device: torch.device,
        *,
        read_back: str = "next",
    ) -> None:
        self.mode = mode
        self.read_back = read_back
        self.model = model
        self.runner_args = runner_args
        self.work = work
        self.device = device
        self.warmup = list({shape(batch): batch for batch in work.batches}.values())
        self.seconds: list[float] = []
        self.peaks: list[float] = []

    def run(self, batches: list[PackedBatch]) -> float:
        """Forward + backward of ``batches`` in this mode; the seconds they took (device synchronised).

        ``frozen`` and the fused modes run each microbatch in one pass over its whole sequence; the
        model is patched for the fused modes only, and under PEFT's ``disable_adapter()`` every LoRA
        layer of the unpatched model is its base layer, so ``frozen`` runs the base model alone.
        Entering that context and setting the runner's adapters happen before the clock starts. Each
        microbatch's loss sums are read back once the next microbatch is queued, as the trainer does
        (``read_back="next"``), or right after it (``"each"``: the host waits for every microbatch).
        """
        if self.mode in FUSED_MODES:
            lorafusion_kernels.patch_peft_model(self.model)
            if self.mode == "lorafusion-siblings":
                lorafusion_kernels.fuse_sibling_layers(self.model)
            else:
                lorafusion_kernels.unfuse_sibling_layers(self.model)
        else:
            lorafusion_kernels.unpatch_peft_model(self.model)
        one_pass = self.mode in ("frozen", *FUSED_MODES)
        # A fresh runner: the one of the mode run before may have left other adapters active.
        runner = MicrobatchRunner(self.model, fused=one_pass, **self.runner_args)
        adapters = self.model.disable_adapter() if self.mode == "frozen" else contextlib.nullcontext()
        with adapters:
            runner.activate(batches[0])
            synchronize(self.device)
            start = time.perf_counter()
            previous = None
            for batch in batches:
                pending = runner.forward_backward(batch, self.work.denominators)
                if self.read_back == "each":
                    pending.get()
                elif previous is not None:
                    previous.get()  # read back as the trainer does: once the next microbatch is queued
                previous = pending
            if previous is not None:
                previous.get()
            synchronize(self.device)
            seconds = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)
        return seconds

    def warm_up(self) -> None:
        self.run(self.warmup)

    def timed(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.seconds.append(self.run(self.work.batches))
        if self.device.type == "cuda":
            self.peaks.append(torch.cuda.max_memory_allocated() / 2**30)

    def result(self) -> dict[str, Any]:
        tokens = self.work.tokens
        rates = [tokens / seconds for seconds in self.seconds]
        median = statistics.median(rates)
        return {
            "tokens": tokens,
            "samples": len(self.work.samples),
            "microbatches": len(self.work.batches),
            "warmup_microbatches": len(self.warmup),
            "seconds": statistics.median(self.seconds),
            "seconds_per_repeat": self.seconds,
            "tokens_per_s": median,
            "tokens_per_s_median": median,
            "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates),
            "peak_gib": max(self.peaks) if self.peaks else None,
        }


def time_modes(
    args: argparse.Namespace,
    config: TrainerConfig,
    joint: Workload,
    baseline_joint: Workload,
    sequential: Workload,
    device: torch.device,
) -> dict[str, dict[str, Any]]:
    """Warm every mode up, then time ``args.repeats`` passes of each, the modes interleaved.

    ``joint`` is the joint plan at ``--capacity`` (``frozen`` and the fused modes), ``baseline_joint``
    the joint plan at ``--baseline-capacity`` (``peft-mixed``) and ``sequential`` the jobs' own plans
    at ``--baseline-capacity`` (``peft-sequential``).
    """
    recomputed = recomputed_layers(PRESETS[args.preset].config, 1, args.checkpointing)[0]
    base = build_base_model(config.base_model, device=device, seed=0, recomputed_layers=recomputed)
    # The frozen floor needs a gradient path through the activations.
    base.enable_input_require_grads()  # type: ignore[no-untyped-call]
    model = attach_adapters(base, config.jobs, seed=0, name_or_path=args.preset)
    runner_args = {
        "adapters": [job.name for job in config.jobs],
        "attn_implementation": resolve_attn_implementation(config.base_model.attn_implementation, device),
        "dtype": getattr(torch, args.dtype),
    }
    workloads = {"peft-sequential": sequential, "peft-mixed": baseline_joint}
    runs = [ModeRun(mode, model, runner_args, workloads.get(mode, joint), device) for mode in args.modes]
    for run in runs:
        run.warm_up()
    for _ in range(args.repeats):
        for run in runs:
            run.timed()
    return {run.mode: run.result() for run in runs}


def run_trainer(
    args: argparse.Namespace,
    device: torch.device,
    warmed_token_counts: set[int],
    *,
    cold: bool,
    profile_gpu: bool = False,
) -> dict[str, Any]:
    """The whole trainer, end to end, on the same config; and the microbatch token counts it ran.

    ``cold``: the caching allocator first gives its memory back to the driver, so the run maps its
    memory as a fresh process does; otherwise it reuses what the previous run freed.
    ``profile_gpu``: the plan's execution (after the model is built) runs under ``torch.profiler``,
    and the result gains ``gpu`` (:func:`gpu_time.gpu_time`; the profiler slows the host a little).
    """
    profiles: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as output, _gpu_profiled(profiles, enabled=profile_gpu):
        config = parse_config(het_config(args, Path(output), fuse_sibling_layers=args.trainer_siblings))
        gc.collect()  # the previous model: the kernels' PEFT hooks hold it in a reference cycle
        if device.type == "cuda":
            if cold:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        result = Trainer(config).train()
        plan = plan_from_json((Path(output) / "plan.json").read_text(encoding="utf-8"))
    token_counts = {mb.tokens for mb in plan.microbatches if not mb.noop}
    tokens = sum(job.tokens for job in result.state.jobs.values())
    if profiles:
        microbatches = len(plan.microbatches)
        gpu = gpu_time(profiles[0], microbatches, result.state.seconds * 1e3 / microbatches, top=15)
        return {"microbatches": microbatches, "tokens_per_s": tokens / result.state.seconds, "gpu": gpu}
    return {
        "tokens": tokens,
        "seconds": result.state.seconds,
        "tokens_per_s": tokens / result.state.seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "microbatches": result.state.position,
        "distinct_token_counts": len(token_counts),
        "distinct_token_counts_not_warmed": len(token_counts - warmed_token_counts),
    }


@contextlib.contextmanager
def _gpu_profiled(profiles: list[Any], *, enabled: bool) -> Iterator[None]:
    """While inside, the trainer executes its plan under ``torch.profiler``, appended to ``profiles``.

    GPU activity on a GPU; without one the profile holds no GPU events (busy 0: a smoke test).
    """
    if not enabled:
        yield
        return
    import lorafusion_megatron.trainer as trainer_module

    execute = trainer_module.execute_plan
    cuda = torch.cuda.is_available()

    def profiled_execute(*args: Any, **kwargs: Any) -> int:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            position = execute(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        profiles.append(prof)
        return position

    trainer_module.execute_plan = profiled_execute
    try:
        yield
    finally:
        trainer_module.execute_plan = execute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--capacity", type=int, default=4096, help="tokens per microbatch of frozen and the fused modes"
    )
    parser.add_argument(
        "--baseline-capacity",
        type=int,
        help="tokens per microbatch of the PEFT modes (default --capacity; plain PEFT needs more memory per token)",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to time, in this order")
    parser.add_argument("--samples", type=int, default=64, help="samples per job: every one is timed in every mode")
    parser.add_argument("--length-scale", type=float, default=1.0, help="scales the synthetic lengths")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per mode, the modes interleaved")
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument(
        "--trainer",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="RUNS",
        help="also time the full trainer end to end, RUNS times in this process (default 1): the first run starts "
        "with the allocator's cache emptied, as a fresh process, the others reuse the memory the previous run freed",
    )
    parser.add_argument(
        "--trainer-siblings", action="store_true", help="the trainer with runtime.fuse_sibling_layers: true"
    )
    parser.add_argument(
        "--trainer-profile",
        action="store_true",
        help="after the --trainer runs, one more under torch.profiler: the GPU's busy and idle time per microbatch",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_trainer.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.trainer_profile and not args.trainer:
        parser.error("--trainer-profile profiles one more trainer run: add --trainer")

    if args.baseline_capacity is None:
        args.baseline_capacity = args.capacity

    device = torch.device(args.device)
    scratch = Path(tempfile.gettempdir()) / "bench-trainer"
    config = parse_config(het_config(args, scratch))
    baseline_config = parse_config(het_config(args, scratch, capacity=args.baseline_capacity))
    data = prepare_data(config).jobs
    plan, joint = planned(config, data, device)
    baseline_plan, baseline_joint = (
        (plan, joint) if args.baseline_capacity == args.capacity else planned(baseline_config, data, device)
    )
    sequential = Workload()
    sequential_microbatches = 0
    for job in config.jobs:
        job_config = baseline_config.model_copy(update={"jobs": [job]})
        job_plan, work = planned(job_config, {job.name: data[job.name]}, device)
        sequential_microbatches += len(job_plan.microbatches)
        sequential.extend(work)
    if not sequential.samples == baseline_joint.samples == joint.samples:
        raise SystemExit("the plans hold different samples: no comparison possible")

    results = time_modes(args, config, joint, baseline_joint, sequential, device)
    for mode, r in results.items():
        peak = "" if r["peak_gib"] is None else f"  peak {r['peak_gib']:.1f} GiB"
        print(
            f"{mode:>16}: {r['tokens_per_s']:>9,.0f} tokens/s median of {args.repeats} "
            f"({r['tokens_per_s_min']:,.0f} to {r['tokens_per_s_max']:,.0f}), {r['tokens']:,} tokens{peak}"
        )
    if args.trainer:
        warmed = {batch.num_tokens for batch in joint.batches}
        runs = [run_trainer(args, device, warmed, cold=run == 0) for run in range(args.trainer)]
        # The last run's figures (the warmest process), and every run's tokens/s.
        r = results["trainer"] = {**runs[-1], "tokens_per_s_per_run": [run["tokens_per_s"] for run in runs]}
        if args.trainer_profile:
            r["profiled"] = run_trainer(args, device, warmed, cold=False, profile_gpu=True)
            gpu = r["profiled"]["gpu"]
            print(
                f"{'trainer profiled':>16}: {gpu['wall_ms']:.1f} ms per microbatch, GPU busy {gpu['busy_ms']:.1f}, "
                f"idle {gpu['idle_ms']:.1f}; idle before: {gpu['gaps']['by_next_kernel_ms']}"
            )
        rates = ", ".join(f"{rate:,.0f}" for rate in r["tokens_per_s_per_run"])
        print(
            f"{'trainer':>16}: {rates} tokens/s (runs in order), {r['microbatches']} microbatches, "
            f"{r['distinct_token_counts']} distinct token counts, "
            f"{r['distinct_token_counts_not_warmed']} of them not warmed up by the modes above"
        )
    report = {
        "provenance": provenance(),
        "attn_implementation": resolve_attn_implementation(config.base_model.attn_implementation, device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "method": {"repeats": args.repeats, "order": args.modes, "timed": "every microbatch of each mode's plan"},
        "plan": {
            "capacity": args.capacity,
            "microbatches": plan.stats.num_microbatches,
            "fill_ratio": plan.stats.fill_ratio,
            "baseline_capacity": args.baseline_capacity,
            "baseline_microbatches": baseline_plan.stats.num_microbatches,
            "sequential_microbatches": sequential_microbatches,
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(args.out, report)


if __name__ == "__main__":
    main()
