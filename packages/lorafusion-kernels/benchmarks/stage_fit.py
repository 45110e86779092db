"""Which launches run with fewer pipeline stages than their config asks, at which ranks (this GPU's file).

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/stage_fit.py --r 32 64

A config tuned at one rank tile may not fit in shared memory at a wider one; the launch then runs
with fewer stages (``launch_fitting``) and warns once. This runs FusedLoRA and FusedMultiLoRA
(4 adapters) forward + backward on every layer of the tuner's models at each rank and prints every
such warning: the shapes whose rank the file should be tuned at (``lorafusion-tune --r``).
"""

from __future__ import annotations

import argparse
import warnings

import torch

from lorafusion_kernels import fused_lora_linear, fused_multi_lora_linear
from lorafusion_kernels.errors import LoRAFusionKernelsWarning
from lorafusion_kernels.tuning.launches import even_segments
from lorafusion_kernels.tuning.search_space import MODEL_LAYERS


def lowered_launches(m: int, n: int, k: int, r: int, adapters: int) -> list[str]:
    """The stage-lowering warnings of one forward + backward of each op on ``x [m, k]``, ``W [n, k]``, rank ``r``."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    a = [(torch.randn(r, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_() for _ in range(adapters)]
    b = [(torch.randn(n, r, device="cuda", dtype=torch.bfloat16) / r**0.5).requires_grad_() for _ in range(adapters)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LoRAFusionKernelsWarning)
        fused_lora_linear(x, w, a[0], b[0], scaling=2.0, dropout_p=0.1).sum().backward()
        fused_multi_lora_linear(
            x,
            w,
            a,
            b,
            segment_lengths=even_segments(m, adapters),
            segment_adapters=list(range(adapters)),
            scaling=2.0,
            dropout_p=0.1,
        ).sum().backward()
        torch.cuda.synchronize()
    return [str(w.message) for w in caught if issubclass(w.category, LoRAFusionKernelsWarning)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--m", type=int, default=4096, help="tokens (the stages that fit do not depend on it)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_LAYERS), choices=sorted(MODEL_LAYERS))
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    shapes = {(n, k): f"{model}.{layer}" for model in args.models for layer, n, k in MODEL_LAYERS[model]}
    for r in args.r:
        for (n, k), name in shapes.items():
            for message in lowered_launches(args.m, n, k, r, args.adapters):
                print(f"r={r} {name} ({n} x {k}): {message}")
        print(f"r={r}: done")


if __name__ == "__main__":
    main()
