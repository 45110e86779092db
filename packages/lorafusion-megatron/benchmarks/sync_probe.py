"""Which step of the trainer's microbatch makes the host wait for the GPU (run on a CUDA device).

The trainer keeps the GPU busy only while the host queues work ahead of it; any call that waits for
the device (a read-back, a blocking copy, an allocation that frees cached memory) drains the queue.
This probe runs the trainer's steps for one microbatch of the tiny preset on CUDA, each step behind
a two-second sleep kernel, and reports the steps that returned only after the sleep had ended. It
also runs them under ``torch.cuda.set_sync_debug_mode("warn")`` and prints where torch itself
synchronised (the innermost four frames of the project's code on the way there). It reaches into
the runner's private steps so that forward and backward are probed apart.

    python3 packages/lorafusion-megatron/benchmarks/sync_probe.py [--siblings] [--p 0.1] [--attn varlen]
"""

from __future__ import annotations

import argparse
import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import lorafusion_kernels
from lorafusion_megatron.config import DatasetConfig, JobConfig
from lorafusion_megatron.dropout_seeds import drawing_for
from lorafusion_megatron.model import lora_parameters, resolve_attn_implementation
from lorafusion_megatron.optim import AdapterOptimizer
from lorafusion_megatron.packing import pack_microbatch
from lorafusion_megatron.runner import MicrobatchRunner, PendingResults
from lorafusion_megatron.testing import plan_microbatch, random_job, tiny_peft_model

ADAPTERS = ("first", "second")


def behind_a_sleep(step: Callable[[], Any]) -> tuple[bool, Any]:
    """Queue a 2 s sleep kernel, run ``step``; whether ``step`` returned only after the sleep had ended."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2 * torch.cuda.get_device_properties(0).clock_rate * 1000))
    slept = torch.cuda.Event()
    slept.record()
    result = step()
    waited = slept.query()
    torch.cuda.synchronize()
    return waited, result


@contextlib.contextmanager
def sync_sites(log: list[str]) -> Iterator[None]:
    """Record where torch synchronises while inside (the stack of each sync warning)."""

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in frames if "lorafusion" in f.filename]
        log.append(f"{message} <- " + " <- ".join(reversed(ours[-4:])))

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--siblings", action="store_true", help="fuse q/k/v and gate/up (fuse_sibling_layers)")
    parser.add_argument("--p", type=float, default=0.1, help="LoRA dropout")
    parser.add_argument("--attn", default="varlen", help="base_model.attn_implementation (the trainer's on a GPU)")
    args = parser.parse_args()

    device = torch.device("cuda")
    data = {
        "first": random_job("first", [90, 50, 120], 3, seed=0),
        "second": random_job("second", [70, 110], 2, seed=1),
    }
    denominators = {(name, 0): job.global_batch_targets(0) for name, job in data.items()}
    microbatch = plan_microbatch(("first", 0, (0, 1, 2)), ("second", 0, (0, 1)))
    model, _ = tiny_peft_model(ADAPTERS, attn_implementation=args.attn, dropout=args.p)
    model.to(device=device, dtype=torch.bfloat16)
    lorafusion_kernels.patch_peft_model(model)
    if args.siblings:
        lorafusion_kernels.fuse_sibling_layers(model)
    attn = resolve_attn_implementation(args.attn, device)
    runner = MicrobatchRunner(model, ADAPTERS, attn_implementation=attn, dtype=torch.bfloat16, fused=True)
    job = JobConfig(name="first", dataset=DatasetConfig(synthetic="xsum"), max_grad_norm=1.0)
    optimizer = AdapterOptimizer(job, lora_parameters(model, "first"), total_steps=100)

    def steps() -> list[tuple[str, Callable[[], Any]]]:
        state: dict[str, Any] = {}

        def copy() -> None:
            state["batch"] = pack_microbatch(microbatch, data).to(device)

        def forward() -> None:
            runner._set_active(ADAPTERS)
            state["routing"] = runner._routing(state["batch"])
            state["routing"].__enter__()
            state["sums"] = runner._segment_losses(state["batch"])

        def backward() -> None:
            objective = sum(
                s / denominators[(span.adapter, 0)]
                for span, s in zip(state["batch"].segments, state["sums"], strict=True)
            )
            objective.backward()
            state["routing"].__exit__(None, None, None)

        return [
            ("pack + copy to the GPU", copy),
            ("forward", forward),
            ("backward", backward),
            ("loss sums kept", lambda: PendingResults(state["batch"], state["sums"])),
            ("optimizer step", optimizer.step),
        ]

    with drawing_for(microbatch):
        for _, step in steps():  # warm-up: compiles the kernels, fills the allocator's cache
            step()
        log: list[str] = []
        with sync_sites(log):
            results = [(name, behind_a_sleep(step)[0]) for name, step in steps()]
    for name, waited in results:
        print(f"{name:28s} {'WAITED for the GPU' if waited else 'queued only'}")
    print(f"{len(log)} synchronising torch calls:")
    for site in dict.fromkeys(log):
        print("  ", site)


if __name__ == "__main__":
    main()
