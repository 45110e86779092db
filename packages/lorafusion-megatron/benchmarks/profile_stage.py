"""One pipeline stage of a random-weight preset on one GPU: time and peak memory per count of recomputed layers.

Builds stage ``--stage`` of the ``--stages``-stage partition (the pipeline runtime's own
``build_stage_model``, four Het adapters, r = 16, dropout 0.1, all linear layers) on the local GPU,
without a process group, and measures its forward and backward with the profiler's
``measure_stage`` at each ``--tokens`` count, once per ``--recompute`` count (``all``, ``balanced``
or a number of layers). It shows, on the real layer shapes, what ``runtime.activation_checkpointing:
balanced`` saves on the stage that sets a pipeline's pace, and what each recomputed layer costs in
memory, without the GPUs of the whole pipeline. With ``--back-to-back K`` it also times ``K``
forward + backward passes run with no synchronisation between them, as a pipeline's steady state
runs them (the host queues a pass's kernels while the GPU still runs the one before), beside the
host's own time to queue a pass: where ``measure_stage``'s synchronised passes take longer, its
times overstate what a microbatch costs in a pipeline.

    python packages/lorafusion-megatron/benchmarks/profile_stage.py --preset llama-3.1-70b --stages 4 \\
        --stage 2 3 --recompute all balanced 0 --tokens 4096 --out stage.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_pipeline import CHECKPOINTING, HET, LORA
from provenance import provenance

from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.config import parse_config
from lorafusion_megatron.pipeline.partition import partition_model, recomputed_layers
from lorafusion_megatron.presets import PRESETS


def stage_config(preset: str, output_dir: str, device: str, adapters: int = len(HET)) -> Any:
    """The first ``adapters`` Het jobs on ``preset`` (bf16 on a GPU), as the pipeline benchmark trains them."""
    jobs = [{"name": name, "dataset": {"synthetic": name, "num_samples": 16}, **LORA} for name in HET[:adapters]]
    dtype = "bfloat16" if device == "cuda" else "float32"
    base = {"model_name_or_path": preset, "dtype": dtype}
    return parse_config({"output_dir": output_dir, "base_model": base, "jobs": jobs, "runtime": {"device": device}})


def counts_for(setting: str, preset: str, stages: int, stage: int) -> int:
    """Layers stage ``stage`` recomputes under ``setting`` (``all``, ``balanced`` or a count)."""
    if setting.isdigit():
        return int(setting)
    return recomputed_layers(PRESETS[preset].config, stages, CHECKPOINTING[setting])[stage]


def back_to_back(stage: Any, tokens: int, *, sample_length: int, passes: int) -> dict[str, float]:
    """Milliseconds per forward + backward over ``passes`` unsynchronised passes, and the host's per pass.

    One untimed pass first. ``host_ms`` ends when the host has queued the last pass's kernels;
    ``pass_ms`` when the GPU has run them.
    """
    import time

    import torch

    from lorafusion_megatron.profiler.measure import synthetic_batch

    device, vocab_size = stage.device, int(stage.config.vocab_size)
    batch = synthetic_batch(tokens, stage.adapters, sample_length=sample_length, vocab_size=vocab_size, device=device)
    shape = (1, tokens, stage.hidden_size)
    hidden = [
        None if stage.spec.is_first else torch.randn(shape, dtype=stage.dtype, device=stage.device, requires_grad=True)
        for _ in range(passes + 1)
    ]

    def synchronize() -> None:
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)

    begin = 0.0
    for index, inputs in enumerate(hidden):
        if index == 1:
            synchronize()
            begin = time.perf_counter()
        output = stage.forward(batch, inputs)
        if stage.spec.is_last:
            output.sum().backward()
        else:
            output.backward(torch.ones_like(output))
        for adapter in stage.adapters:
            for parameter in stage.lora_parameters(adapter).values():
                parameter.grad = None
    queued = time.perf_counter()
    synchronize()
    end = time.perf_counter()
    return {"pass_ms": (end - begin) * 1e3 / passes, "host_ms": (queued - begin) * 1e3 / passes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.1-70b")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages S of the partition")
    parser.add_argument("--stage", type=int, nargs="+", default=[2], help="which stages to build, one at a time")
    parser.add_argument("--recompute", nargs="+", default=["all", "balanced", "0"], help="all, balanced or counts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--sample-length", type=int, default=1024)
    parser.add_argument("--adapters", type=int, default=len(HET), choices=range(1, len(HET) + 1))
    parser.add_argument("--back-to-back", type=int, default=0, metavar="K", help="also time K unsynchronised passes")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test on the tiny preset")
    parser.add_argument("--out", type=Path, default=Path("profile_stage.json"))
    args = parser.parse_args(argv)

    import torch

    from lorafusion_megatron.pipeline.stage_model import build_stage_model
    from lorafusion_megatron.profiler.measure import measure_stage

    device = torch.device(args.device)
    config = stage_config(args.preset, tempfile.mkdtemp(), args.device, args.adapters)
    specs = partition_model(PRESETS[args.preset].config, args.stages)
    rows = []
    for index in args.stage:
        stage = build_stage_model(config, specs[index], device)
        for setting in args.recompute:
            stage.recomputed_layers = counts_for(setting, args.preset, args.stages, index)
            measured = measure_stage(stage, args.tokens, sample_length=args.sample_length)
            for m in measured.measurements:
                rows.append(
                    {
                        "stage": index,
                        "layers": len(specs[index].layers),
                        "setting": setting,
                        "recomputed_layers": stage.recomputed_layers,
                        "tokens": m.tokens,
                        "forward_ms": round(m.forward_s * 1e3, 2),
                        "backward_ms": round(m.backward_s * 1e3, 2),
                        "peak_gib": round((m.peak_bytes or 0) / 2**30, 2),
                    }
                )
                if args.back_to_back:
                    unsynced = back_to_back(stage, m.tokens, sample_length=args.sample_length, passes=args.back_to_back)
                    rows[-1] |= {f"back_to_back_{k}": round(v, 2) for k, v in unsynced.items()}
                print(json.dumps(rows[-1]), flush=True)
            if measured.out_of_memory_at is not None:
                rows.append({"stage": index, "setting": setting, "out_of_memory_at": measured.out_of_memory_at})
                print(json.dumps(rows[-1]), flush=True)
        del stage
        gc.collect()
        torch.cuda.empty_cache()
    document = {
        "benchmark": "profile_stage",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "provenance": provenance(),
        "settings": {
            "preset": args.preset,
            "pipeline_stages": args.stages,
            "lora": LORA,
            "adapters": args.adapters,
            "sample_length": args.sample_length,
            "back_to_back_passes": args.back_to_back,
        },
        "rows": rows,
    }
    write_json_atomically(args.out, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
