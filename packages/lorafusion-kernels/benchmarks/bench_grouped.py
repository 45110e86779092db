"""Sibling projections (q/k/v, gate/up) as one call: what it saves, what it costs.

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/bench_grouped.py \
        --out $OUT/bench

LLaMa-3.1-8B's q/k/v (``N = 4096, 1024, 1024``) and gate/up (``N = 14336, 14336``) read one input
``x [M, 4096]``. Per group of sibling layers and number of adapters (even segments), two ways of
computing every member's ``y_j = x W_j^T + scaling * dropout(x) A_j^T B_j^T``:

- ``separate``: one ``fused_multi_lora_linear`` per member (what the trainer runs today);
- ``block_diagonal``: one call on the concatenated weight ``W = [W_1; W_2; ...]`` with each adapter's
  ``A = [A_1; A_2; ...]`` (rank ``G r``) and block-diagonal ``B = diag(B_1, B_2, ...)``, then split.
  No kernel knows about the members (the rank-``G r`` LoRA work of every member is done);
- ``siblings``: ``fused_multi_lora_siblings`` on the same stacked ``W``: the kernels know the members
  and do each member's rank-``r`` work only.

The one-call ways share one dropout mask between members (the kernels draw one per call).
Reported per group: host microseconds per forward + backward at ``--m-host`` tokens (the GPU waits
for the host there), GPU microseconds by kernel at ``--m-gpu`` tokens (``torch.profiler``), and the
largest difference between each one-call way and ``separate`` at ``p = 0``. Writes
``<out>/<gpu-key>-grouped.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from bench_lora import provenance, write_results
from bench_multi_lora import segment_lengths
from host_cost import per_call_us
from profile_lora import kernel_times

from lorafusion_kernels import MultiLoRABatch, fused_multi_lora_linear, fused_multi_lora_siblings

GROUPS: dict[str, list[int]] = {"llama8b.qkv": [4096, 1024, 1024], "llama8b.gate_up": [14336, 14336]}
"""Output features of each member, per group of sibling layers sharing one input."""
ONE_CALL = ("block_diagonal", "siblings")
"""The ways that compute a group in one call (compared with ``separate``, one call per member)."""


def _param(rows: int, cols: int, *, scale: float) -> torch.Tensor:
    """A random fp32 LoRA weight ``[rows, cols]`` that requires grad."""
    return (torch.randn(rows, cols, device="cuda") * scale).requires_grad_()


class Siblings:
    """One group's frozen weights and per-member, per-adapter LoRA weights (fp32, as PEFT keeps them)."""

    def __init__(self, members: list[int], m: int, k: int, r: int, adapters: int) -> None:
        device = "cuda"
        self.members = members
        self.x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        self.weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for n in members]
        self.weight_cat = torch.cat(self.weights)
        self.lora_a = [[_param(r, k, scale=k**-0.5) for _ in range(adapters)] for _ in members]
        self.lora_b = [[_param(n, r, scale=r**-0.5) for _ in range(adapters)] for n in members]
        lengths = segment_lengths(m, adapters, "even")
        self.batch = MultiLoRABatch.from_segments(lengths, list(range(adapters)), num_adapters=adapters, device=device)
        self.dys = [torch.randn(m, n, device=device, dtype=torch.bfloat16) for n in members]

    def separate(self, p: float) -> list[torch.Tensor]:
        return [
            fused_multi_lora_linear(self.x, w, a, b, scaling=2.0, dropout_p=p, batch=self.batch)
            for w, a, b in zip(self.weights, self.lora_a, self.lora_b, strict=True)
        ]

    def block_diagonal(self, p: float) -> list[torch.Tensor]:
        per_adapter = range(len(self.lora_a[0]))
        lora_a = [torch.cat([member[i] for member in self.lora_a]) for i in per_adapter]
        lora_b = [torch.block_diag(*[member[i] for member in self.lora_b]) for i in per_adapter]
        y = fused_multi_lora_linear(self.x, self.weight_cat, lora_a, lora_b, scaling=2.0, dropout_p=p, batch=self.batch)
        return list(y.split(self.members, dim=1))

    def siblings(self, p: float) -> list[torch.Tensor]:
        per_adapter = range(len(self.lora_a[0]))
        return list(
            fused_multi_lora_siblings(
                self.x, self.weight_cat, [[member[i] for member in self.lora_a] for i in per_adapter],
                [[member[i] for member in self.lora_b] for i in per_adapter], out_features=self.members,
                scaling=2.0, dropout_p=p, batch=self.batch,
            )
        )  # fmt: skip

    def fwd_bwd(self, way: Callable[[float], list[torch.Tensor]], p: float) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.backward(way(p), self.dys)

        return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m-host", type=int, default=64)
    parser.add_argument("--m-gpu", type=int, default=4096)
    parser.add_argument("--adapters", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    rows = []
    for group, members in GROUPS.items():
        for adapters in args.adapters:
            small = Siblings(members, args.m_host, 4096, args.r, adapters)
            large = Siblings(members, args.m_gpu, 4096, args.r, adapters)
            exact = Siblings(members, 256, 4096, args.r, adapters)
            row: dict[str, object] = {"group": group, "members": members, "adapters": adapters}
            for way in ONE_CALL:
                row[f"{way}_max_diff_p0"] = max(
                    (s.float() - g.float()).abs().max().item()
                    for s, g in zip(exact.separate(0.0), getattr(exact, way)(0.0), strict=True)
                )
            for way in ("separate", *ONE_CALL):
                row[f"{way}_host_us"] = per_call_us(small.fwd_bwd(getattr(small, way), args.p), calls=20, blocks=9)
                kernels = kernel_times(large.fwd_bwd(getattr(large, way), args.p), args.iters)
                row[f"{way}_gpu_us"] = round(sum(kernels.values()), 1)
                row[f"{way}_kernels_us"] = kernels
            rows.append(row)
            host = " / ".join(str(row[f"{way}_host_us"]) for way in ("separate", *ONE_CALL))
            gpu = " / ".join(str(row[f"{way}_gpu_us"]) for way in ("separate", *ONE_CALL))
            diffs = " / ".join(f"{row[f'{way}_max_diff_p0']:.3g}" for way in ONE_CALL)
            print(f"{group:16s} adapters={adapters} host {host} us, GPU {gpu} us, max diff at p=0 {diffs}", flush=True)
    write_results(
        args.out,
        "-grouped",
        {
            **provenance("bench_grouped.py", argv),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
