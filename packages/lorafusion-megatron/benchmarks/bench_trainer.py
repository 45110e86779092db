"""Tokens/s of the trainer's microbatch loop on a random-weight preset, 4 jobs on the Het workload.

Forward + backward (no optimizer) over packed microbatches of 4,096 tokens (the capacity):

* ``frozen``: the joint plan's microbatches through the base model alone, gradients through the
  activations only (the floor);
* ``peft-sequential``: each job alone, as a plain HF + PEFT loop would train the four one after
  another: the job's own plan (single-adapter microbatches), plain PEFT LoRA layers;
* ``peft-mixed``: the joint plan's mixed microbatches with plain PEFT, one pass per adapter segment
  (PEFT refuses mixed batches in training);
* ``lorafusion``: the joint plan, one pass per mixed microbatch through lorafusion-kernels.

Every microbatch runs once untimed first (kernels compile and tune per token count). Then, with
``--trainer``, the full trainer (optimizer steps included) on the same config, end to end.

    python packages/lorafusion-megatron/benchmarks/bench_trainer.py --preset llama-3.1-8b --out bench.json
    python packages/lorafusion-megatron/benchmarks/bench_trainer.py --preset tiny --device cpu --capacity 512 \\
        --length-scale 0.05 --microbatches 4   # a smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.data.job_data import JobData
from lorafusion_megatron.model import attach_adapters, build_base_model, resolve_attn_implementation
from lorafusion_megatron.packing import PackedBatch, pack_microbatch
from lorafusion_megatron.planning import make_plan
from lorafusion_megatron.runner import MicrobatchRunner
from lorafusion_megatron.trainer import Trainer, prepare_data

HET = ("xsum", "cnndm", "wikisum", "mixed")


def het_config(args: argparse.Namespace, output: Path) -> dict:
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
        "scheduler": {"capacity": args.capacity, "padding_multiple": 64},
        "runtime": {"device": args.device, "seed": 0, "activation_checkpointing": args.checkpointing},
        "logging": {"progress_bar": False, "logging_steps": 1000},
    }


def packed(config: TrainerConfig, data: dict[str, JobData], count: int, device: torch.device):
    """The first ``count`` non-no-op microbatches of ``config``'s plan, packed, and their denominators."""
    plan = make_plan(config, data)
    chosen = [mb for mb in plan.microbatches if not mb.noop][:count]
    batches = [pack_microbatch(mb, data).to(device) for mb in chosen]
    denominators = {
        (seg.adapter, seg.global_batch): data[seg.adapter].global_batch_targets(seg.global_batch)
        for mb in chosen
        for seg in mb.segments
    }
    return plan, batches, denominators


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_mode(mode: str, model, runner_args: dict, batches: list[PackedBatch], denominators, device) -> dict:
    """Run every batch once untimed, then time them all."""
    runner = MicrobatchRunner(model, fused=mode == "lorafusion", **runner_args)

    def one_pass() -> None:
        for batch in batches:
            if mode == "frozen":
                with model.disable_adapter():
                    runner.forward_backward(batch, denominators)
            else:
                runner.forward_backward(batch, denominators)
        model.zero_grad(set_to_none=True)

    one_pass()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    one_pass()
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(batch.num_tokens for batch in batches)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=64, help="samples per job")
    parser.add_argument("--length-scale", type=float, default=1.0, help="scales the synthetic lengths")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=16, help="microbatches timed per mode")
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--trainer", action="store_true", help="also time the full trainer end to end")
    parser.add_argument("--out", type=Path, default=Path("bench_trainer.json"))
    args = parser.parse_args()

    import peft
    import transformers

    import lorafusion_kernels

    device = torch.device(args.device)
    config = parse_config(het_config(args, Path("/tmp/bench-trainer")))
    data = prepare_data(config).jobs
    plan, batches, denominators = packed(config, data, args.microbatches, device)
    alone = [config.model_copy(update={"jobs": [job]}) for job in config.jobs]
    per_job = math.ceil(args.microbatches / len(alone))
    sequential: list[PackedBatch] = []
    sequential_denominators: dict[tuple[str, int], int] = {}
    for single in alone:
        _, job_batches, job_denominators = packed(
            single, {single.jobs[0].name: data[single.jobs[0].name]}, per_job, device
        )
        sequential += job_batches
        sequential_denominators |= job_denominators

    base = build_base_model(config.base_model, device=device, seed=0, activation_checkpointing=args.checkpointing)
    base.enable_input_require_grads()  # the frozen floor needs a gradient path through the activations
    model = attach_adapters(base, config.jobs, seed=0, name_or_path=args.preset)
    lorafusion_kernels.patch_peft_model(model)
    runner_args = {
        "adapters": [job.name for job in config.jobs],
        "attn_implementation": resolve_attn_implementation(config.base_model.attn_implementation, device),
        "dtype": getattr(torch, args.dtype),
    }
    results = {
        "frozen": time_mode("frozen", model, runner_args, batches, denominators, device),
        "peft-sequential": time_mode("peft", model, runner_args, sequential, sequential_denominators, device),
        "peft-mixed": time_mode("peft", model, runner_args, batches, denominators, device),
        "lorafusion": time_mode("lorafusion", model, runner_args, batches, denominators, device),
    }
    for mode, r in results.items():
        peak = "" if r["peak_gib"] is None else f"  peak {r['peak_gib']:.1f} GiB"
        print(f"{mode:>16}: {r['tokens_per_s']:>9,.0f} tokens/s{peak}")
    if args.trainer:
        del model, base
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result = Trainer(config).train()
        tokens = sum(j.tokens for j in result.state.jobs.values())
        results["trainer"] = {
            "tokens": tokens,
            "seconds": result.state.seconds,
            "tokens_per_s": tokens / result.state.seconds,
        }
        print(f"{'trainer':>16}: {tokens / result.state.seconds:>9,.0f} tokens/s, {result.state.position} microbatches")
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "lorafusion_kernels": lorafusion_kernels.__version__,
        },
        "attn_implementation": runner_args["attn_implementation"],
        "args": {k: str(v) for k, v in vars(args).items()},
        "plan": {"microbatches": plan.stats.num_microbatches, "fill_ratio": plan.stats.fill_ratio},
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
