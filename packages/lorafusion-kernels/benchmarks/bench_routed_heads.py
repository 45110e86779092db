"""What routing per-adapter ``modules_to_save`` heads per segment costs inside ``multi_lora_batch``.

A PEFT model whose adapters each train their own ``lm_head`` (PEFT's ``modules_to_save``, as added
tokens bring) holds one copy of the head per adapter. Inside ``multi_lora_batch`` each segment's
tokens go through its adapter's copy: one call per run of segments, the outputs concatenated.
This times forward + backward of the head alone (bf16, LLaMa-3.1-8B's 4,096 x 128,256) on ``T``
packed tokens, in interleaved rounds:

- ``one_copy``: every token through one copy (what a batch of one adapter costs): the floor.
- ``routed``: ``adapters`` copies, each owning ``T / adapters`` tokens in ``runs`` runs of segments.

Run on a GPU from the repository root::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/bench_routed_heads.py \\
        --out packages/lorafusion-kernels/benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import lorafusion_kernels
from lorafusion_kernels import MultiLoRABatch, multi_lora_batch


def build_head(args: argparse.Namespace) -> torch.nn.Module:
    """The ``lm_head`` wrapper of a one-layer LLaMa-3.1-8B-wide PEFT model with ``adapters`` copies of it."""
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=8,
    )  # fmt: skip
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    names = [f"adapter{i}" for i in range(args.adapters)]
    lora = {"r": 16, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}
    model = get_peft_model(base, LoraConfig(**lora), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(**lora))
    for name, param in model.named_parameters():
        param.requires_grad_(".modules_to_save." in name)
    lorafusion_kernels.patch_peft_model(model)
    return model.base_model.model.lm_head


def segments(args: argparse.Namespace) -> MultiLoRABatch:
    """``runs`` runs of equal length, the adapters in turn: every adapter owns ``T / adapters`` tokens."""
    length = args.tokens // args.runs
    return MultiLoRABatch.from_segments(
        [length] * args.runs, [i % args.adapters for i in range(args.runs)], num_adapters=args.adapters, device="cuda"
    )


def measure(args: argparse.Namespace) -> dict[str, object]:
    head = build_head(args)
    names = [f"adapter{i}" for i in range(args.adapters)]
    batch = segments(args)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens, args.vocab, device="cuda", dtype=torch.bfloat16)

    def one_copy() -> None:
        head(hidden).backward(grad)

    def routed() -> None:
        with multi_lora_batch(batch, names):
            logits = head(hidden)
        logits.backward(grad)

    modes = {"one_copy": one_copy, "routed": routed}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _round in range(args.rounds):
        for mode, step in modes.items():
            step()  # warm-up
            for _ in range(args.steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                times[mode].append(start.elapsed_time(end))
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    return {
        "modes": {mode: {"median_ms": medians[mode], "times_ms": times[mode]} for mode in modes},
        "routed_over_one_copy": medians["routed"] / medians["one_copy"],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="packed tokens T")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--runs", type=int, default=4, help="runs of segments (a multiple of --adapters)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=None, help="folder for <gpu-key>-routed-heads-<...>.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, print the summary, write the results file."""
    args = build_parser().parse_args(argv)
    result = measure(args)
    for mode, row in result["modes"].items():  # type: ignore[attr-defined]
        print(f"{mode:>9}: {row['median_ms']:7.2f} ms (forward + backward, median)")
    print(f"routed / one_copy: {result['routed_over_one_copy']:.3f}")
    if args.out is not None:
        from bench_lora import provenance, write_results

        header = provenance("bench_routed_heads.py", argv)
        header["command"] = header["command"].replace(str(args.out), "<results folder>")  # no machine paths
        header["versions"] |= {"transformers": transformers.__version__, "peft": peft.__version__}  # type: ignore[operator]
        settings = {key: value for key, value in vars(args).items() if key != "out"}
        suffix = f"-routed-heads-{args.adapters}x{args.runs}-{header['date']}"
        write_results(args.out, suffix, {**header, "args": settings, **result})


if __name__ == "__main__":
    main()
