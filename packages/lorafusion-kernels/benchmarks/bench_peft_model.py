"""Whole-model LoRA training steps of a PEFT model, with and without ``patch_peft_model``.

The view of a user who adds the kernels to an existing PEFT training script: one adapter on every
linear layer of a real architecture (random weights), bf16 base weights and fp32 adapters (PEFT's
default), each step under bf16 autocast as the HF Trainer runs it with ``bf16=True``. Modes, on the
same model and batches, in interleaved rounds:

- ``frozen``: the base model alone (PEFT's ``disable_adapter()``), gradients through the activations
  only (the input embeddings require grad): the floor a LoRA step cannot beat.
- ``peft``: PEFT's own LoRA layers.
- ``lorafusion``: the same model after ``patch_peft_model`` (undone between its steps and the others').

A step is forward (HF's causal-LM loss over every token), backward and ``zero_grad``; no optimizer
(the same for every mode, about a millisecond for the adapters). Times are CUDA events per step;
the summary takes the median over all timed steps, and the peak memory of each mode's last round.

Run on a GPU from the repository root::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/bench_peft_model.py \\
        --out packages/lorafusion-kernels/benchmarks/results

``--preset tiny --device cpu`` runs a smoke test of the script itself (times mean nothing there).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig

import lorafusion_kernels

PRESETS: dict[str, tuple[type[PretrainedConfig], dict[str, float | int]]] = {
    "llama-3.1-8b": (
        LlamaConfig,
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 16384,
            "rope_theta": 500000.0,
        },
    ),
    # GPT-2's attention and MLP are transformers' Conv1D layers (W [K, N]): PEFT's fan_in_fan_out.
    "gpt2-xl": (GPT2Config, {"vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25, "n_positions": 1024}),
    "tiny": (
        LlamaConfig,
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
        },
    ),
    "tiny-gpt2": (GPT2Config, {"vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}),
}
MODES = ("frozen", "peft", "lorafusion")


def build_model(args: argparse.Namespace, device: torch.device) -> PeftModel:
    """The preset's model in bf16 with random weights, one LoRA adapter on every linear (or Conv1D) layer."""
    config_class, fields = PRESETS[args.preset]
    config = config_class(**fields, attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if args.checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=args.dropout, target_modules="all-linear")
    model = get_peft_model(base, lora)
    model.train()
    return model


def training_step(model: PeftModel, mode: str, ids: torch.Tensor) -> None:
    """Forward, causal-LM loss, backward and ``zero_grad`` of one batch in ``mode``."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        if mode == "frozen":
            with model.disable_adapter():
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
                model(inputs_embeds=embeds, labels=ids, use_cache=False).loss.backward()
        else:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """``time(fn)``: milliseconds of one call (CUDA events on a GPU, wall time on a CPU)."""
    if device.type != "cuda":

        def wall(fn: Callable[[], None]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return wall

    def events(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return events


def run_mode(
    model: PeftModel, mode: str, batches: list[torch.Tensor], time_fn: Callable[..., float], fallbacks: set[str]
) -> list[float]:
    """Each batch's step time in ``mode``; the model is patched for ``lorafusion`` only, and unpatched after.

    ``fallbacks`` collects the kernels' warnings (a layer that took PEFT's own path says why).
    """
    if mode == "lorafusion":
        lorafusion_kernels.patch_peft_model(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", lorafusion_kernels.LoRAFusionKernelsWarning)
        try:
            return [time_fn(lambda ids=ids: training_step(model, mode, ids)) for ids in batches]
        finally:
            fallbacks.update(
                str(w.message) for w in caught if w.category is lorafusion_kernels.LoRAFusionKernelsWarning
            )
            if mode == "lorafusion":
                lorafusion_kernels.unpatch_peft_model(model)


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Warm every mode up, then ``args.rounds`` interleaved rounds of ``args.steps`` steps per mode."""
    device = torch.device(args.device)
    model = build_model(args, device)
    gen = torch.Generator().manual_seed(1)
    vocab = int(model.config.vocab_size)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(args.steps)]
    time_fn = timer(device)
    fallbacks: set[str] = set()
    for mode in args.modes:
        run_mode(model, mode, batches[:2], time_fn, fallbacks)  # compile the kernels, settle the allocator
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    peaks: dict[str, float] = {}
    for round_index in range(args.rounds):
        for mode in args.modes:
            last = round_index == args.rounds - 1
            if last and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times[mode] += run_mode(model, mode, batches, time_fn, fallbacks)
            if last and device.type == "cuda":
                peaks[mode] = torch.cuda.max_memory_allocated() / 2**30
    tokens = args.batch * args.seq
    modes = {
        mode: {
            "step_ms": values,
            "median_ms": statistics.median(values),
            "tokens_per_s": tokens / statistics.median(values) * 1e3,
            "peak_gib": peaks.get(mode, float("nan")),
        }
        for mode, values in times.items()
    }
    ratios = {}
    if {"peft", "lorafusion"} <= modes.keys():
        ratios["peft_over_lorafusion"] = modes["peft"]["median_ms"] / modes["lorafusion"]["median_ms"]
    for mode in ("peft", "lorafusion"):
        if {"frozen", mode} <= modes.keys():
            ratios[f"{mode}_over_frozen"] = modes[mode]["median_ms"] / modes["frozen"]["median_ms"]
    return {"modes": modes, "ratios": ratios, "tokens_per_step": tokens, "kernel_warnings": sorted(fallbacks)}


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (lora_alpha = 2 r)")
    parser.add_argument("--dropout", type=float, default=0.1, help="lora_dropout")
    parser.add_argument("--checkpointing", action="store_true", help="HF activation checkpointing (non-reentrant)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=None, help="folder for <gpu-key>-peft-model-<...>.json")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, print the summary, write the results file on a GPU."""
    args = build_parser().parse_args(argv)
    result = measure(args)
    for mode, row in result["modes"].items():  # type: ignore[attr-defined]
        print(
            f"{mode:>10}: {row['median_ms']:8.1f} ms/step  {row['tokens_per_s']:9,.0f} tokens/s  "
            f"peak {row['peak_gib']:.1f} GiB"
        )
    for name, value in result["ratios"].items():  # type: ignore[attr-defined]
        print(f"{name}: {value:.3f}")
    for message in result["kernel_warnings"]:  # type: ignore[attr-defined]
        print(f"kernel warning: {message}")
    if args.out is not None and args.device == "cuda":
        from bench_lora import provenance, write_results

        header = provenance("bench_peft_model.py", argv)
        header["command"] = header["command"].replace(str(args.out), "<results folder>")  # no machine paths
        header["versions"] |= {"transformers": transformers.__version__, "peft": peft.__version__}  # type: ignore[operator]
        settings = {key: value for key, value in vars(args).items() if key != "out"}
        ckpt = "-ckpt" if args.checkpointing else ""
        suffix = f"-peft-model-{args.preset}-{args.batch}x{args.seq}{ckpt}-{header['date']}"
        write_results(args.out, suffix, {**header, "args": settings, **result})


if __name__ == "__main__":
    main()
