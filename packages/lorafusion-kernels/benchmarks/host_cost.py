"""Host cost of one LoRA layer call, taken apart: what each layer of the call stack adds.

Run on a GPU (from the repository root)::

    PYTHONPATH=packages/lorafusion-kernels/src python packages/lorafusion-kernels/benchmarks/host_cost.py \
        --out $OUT/host

At ``M = --m`` tokens (so few that the GPU always waits for the CPU) every entry below is the
wall time per call in microseconds, the median over ``--blocks`` blocks of ``--calls`` calls each,
issued back to back and synchronised once per block. Read from the bottom up, each entry adds one
layer of the stack to the one before:

- ``torch_op``: one small torch op (``x.mul(2)``), the unit everything else is counted in;
- ``triton_launch``: one launch of an empty Triton kernel with 6 tensor and 8 integer arguments
  through ``kernel[grid](...)``: Triton's Python launcher (binding, specialisation, cache lookup);
- ``autograd_function``: a ``torch.autograd.Function`` with 9 inputs whose forward and backward
  do one torch op each, forward + backward;
- ``frozen`` / ``fused`` / ``fused_multi``: ``F.linear`` alone, ``fused_lora_linear`` (one adapter)
  and ``fused_multi_lora_linear`` (``--adapters`` even segments, metadata built once), forward and
  forward + backward (``*_fwd``, ``*_fwd_bwd``); ``fused_multi_kernels_fwd`` calls the two forward
  kernels' wrappers directly (no autograd, no checks, no stacking);
- ``peft_*``: one PEFT ``lora.Linear`` with ``--adapters`` adapters (fp32, PEFT's default for a bf16
  model), patched with ``patch_peft_model``, under ``multi_lora_batch`` (``peft_multi_*``) or with
  one adapter active (``peft_single_*``), forward + backward with gradients accumulated into
  ``.grad`` as a trainer does; ``peft_unpatched_single_fwd_bwd`` is PEFT's own forward;
- ``*_stack_per_layer`` (when ``--n`` equals ``--k``): 8 such layers in a row and one backward,
  per layer: the autograd engine is entered once per pass, as in a trainer;
- ``*_no_launch``: the same call with every Triton launch replaced by a no-op (the kernels'
  outputs are then garbage): what is left is the host cost of our wrappers and torch's ops, and
  the difference to the real call is Triton's launcher.

``--profile`` also prints ``cProfile``'s view (cumulative time) of ``fused_fwd_bwd`` and
``fused_multi_fwd_bwd``.

Writes ``<out>/<gpu-key>-host.json`` and prints the table. Host times differ between machines of
one kind by up to 2-3x: compare entries of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_lora import provenance, write_results
from profile_lora import host_profile
from torch import nn
from torch.nn import functional

from lorafusion_kernels import (
    MultiLoRABatch,
    fused_lora_linear,
    fused_multi_lora_linear,
    multi_lora_batch,
    patch_peft_model,
)


@triton.jit
def _empty_kernel(a, b, c, d, e, f, i0, i1, i2, i3, i4, i5, i6, i7, BLOCK: tl.constexpr):
    pass


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *others):  # type: ignore[no-untyped-def, override]
        ctx.count = len(others)
        return x.mul(2)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        return (dy.mul(2),) + (None,) * ctx.count


def per_call_us(fn: Callable[[], object], calls: int, blocks: int) -> float:
    """Median over ``blocks`` of the wall time per call of ``calls`` back-to-back calls (microseconds)."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 1)


@contextlib.contextmanager
def no_launches() -> Iterator[None]:
    """Every ``kernel[grid](...)`` inside the block returns at once without launching anything."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: None  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        JITFunction.__getitem__ = original  # type: ignore[method-assign]


def peft_layer(n: int, k: int, r: int, p: float, adapters: int) -> tuple[nn.Module, list[str]]:
    """One PEFT LoRA ``nn.Linear`` (bf16 base, fp32 adapters), every adapter trainable, patched."""
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential(OrderedDict(proj=nn.Linear(k, n, bias=False))).to("cuda", torch.bfloat16)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=p, target_modules=["proj"])
    names = [f"a{i}" for i in range(adapters)]
    model = get_peft_model(base, config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    for param_name, param in model.named_parameters():
        param.requires_grad_("lora_" in param_name)
    return model, names


def measure(
    m: int, n: int, k: int, r: int, p: float, adapters: int, calls: int, blocks: int, profiles: dict[str, str] | None
) -> dict[str, float]:
    """Every entry of the module docstring, in microseconds per call; ``profiles`` (if given) gets the cProfiles."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    lora_a = [(torch.randn(r, k, device="cuda", generator=gen) / k**0.5).requires_grad_() for _ in range(adapters)]
    lora_b = [(torch.randn(n, r, device="cuda", generator=gen) / r**0.5).requires_grad_() for _ in range(adapters)]
    dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    lengths = [m // adapters] * adapters
    lengths[0] += m - sum(lengths)
    batch = MultiLoRABatch.from_segments(lengths, list(range(adapters)), device="cuda")
    scaling, ps = [2.0] * adapters, [p] * adapters
    small = torch.randn(64, device="cuda")
    tensors = [x, w, dy, small, small, small]
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        out[name] = per_call_us(fn, calls, blocks)
        print(f"{name:36s} {out[name]:9.1f} us", flush=True)

    timed("torch_op", lambda: small.mul(2))
    timed("triton_launch", lambda: _empty_kernel[(1,)](*tensors, m, n, k, r, 3, 5, 7, 9, BLOCK=16))
    inputs = [x, w, *lora_a[:2], *lora_b[:2], small, small, small]
    timed("autograd_function", lambda: _Identity.apply(*inputs).backward(torch.ones_like(x)))  # type: ignore[no-untyped-call]

    def frozen() -> torch.Tensor:
        return functional.linear(x, w)

    def fused() -> torch.Tensor:
        return fused_lora_linear(x, w, lora_a[0], lora_b[0], scaling=2.0, dropout_p=p)

    def fused_multi() -> torch.Tensor:
        return fused_multi_lora_linear(x, w, lora_a, lora_b, scaling=scaling, dropout_p=ps, batch=batch)

    def fused_layer(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fused_lora_linear(h, weight, lora_a[0], lora_b[0], scaling=2.0, dropout_p=p)

    def multi_layer(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fused_multi_lora_linear(h, weight, lora_a, lora_b, scaling=scaling, dropout_p=ps, batch=batch)

    for name, fn, params in (("frozen", frozen, [x]), ("fused", fused, [x, lora_a[0], lora_b[0]]),
                             ("fused_multi", fused_multi, [x, *lora_a, *lora_b])):  # fmt: skip
        timed(f"{name}_fwd", fn)
        fwd_bwd = functools.partial(_fwd_bwd, fn, params, dy)
        timed(f"{name}_fwd_bwd", fwd_bwd)
        if name != "frozen":
            with no_launches():
                timed(f"{name}_fwd_bwd_no_launch", fwd_bwd)
            if profiles is not None:
                profiles[name] = host_profile(fwd_bwd, calls, 45, sort="cumulative")
                print(profiles[name], flush=True)
    timed("fused_multi_kernels_fwd", _kernels_forward(x, w, lora_a, lora_b, batch, scaling, ps))
    if n == k:
        for name, layer in (("frozen", functional.linear), ("fused", fused_layer), ("fused_multi", multi_layer)):
            stack = functools.partial(_stack_fwd_bwd, layer, x, w, STACK)
            out[f"{name}_stack_per_layer"] = round(per_call_us(stack, calls // 5, blocks) / STACK, 1)
            print(f"{name + '_stack_per_layer':36s} {out[name + '_stack_per_layer']:9.1f} us", flush=True)

    model, names = peft_layer(n, k, r, p, adapters)
    xs = x.detach().unsqueeze(0).requires_grad_()
    dys = dy.unsqueeze(0)
    model.train()
    model.set_adapter(names[0])
    for param_name, param in model.named_parameters():
        param.requires_grad_("lora_" in param_name)

    def peft_fwd_bwd() -> None:
        model(xs).backward(dys)

    def peft_multi_fwd_bwd() -> None:
        with multi_lora_batch(batch, names):
            y = model(xs)
        y.backward(dys)

    timed("peft_unpatched_single_fwd_bwd", peft_fwd_bwd)
    patch_peft_model(model)
    timed("peft_single_fwd_bwd", peft_fwd_bwd)
    timed("peft_multi_fwd_bwd", peft_multi_fwd_bwd)
    with no_launches():
        timed("peft_multi_fwd_bwd_no_launch", peft_multi_fwd_bwd)
    return out


STACK = 8
"""Layers of the ``*_stack_per_layer`` entries."""


def _stack_fwd_bwd(
    layer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor, depth: int
) -> None:
    """``depth`` layers in a row, then one backward (a trainer's shape of work: one engine call per pass)."""
    h = x
    for _ in range(depth):
        h = layer(h, w)
    h.sum().backward()


def _fwd_bwd(fn: Callable[[], torch.Tensor], params: list[torch.Tensor], dy: torch.Tensor) -> None:
    torch.autograd.grad(fn(), params, dy)


def _kernels_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    batch: MultiLoRABatch,
    scaling: list[float],
    ps: list[float],
) -> Callable[[], torch.Tensor]:
    """The op's forward core (its two kernels through their wrappers), inputs stacked once outside."""
    from lorafusion_kernels.dropout import seed_tensor
    from lorafusion_kernels.multi_lora_core import forward_core
    from lorafusion_kernels.multi_lora_params import AdapterParams, stack_adapters

    params = AdapterParams(tuple(a.shape[0] for a in lora_a), tuple(scaling), tuple(ps))
    a_cat, b_cat = (
        stack_adapters([a.detach() for a in lora_a], dim=0),
        stack_adapters([b.detach() for b in lora_b], dim=1),
    )
    seed = seed_tensor(1, x.device)
    return lambda: forward_core(x.detach(), w, None, a_cat, b_cat, seed, batch, params)[0]


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, write ``<out>/<gpu-key>-host.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--tag", default="", help="suffix of the results file name (give it as --tag=-name)")
    parser.add_argument("--profile", action="store_true", help="also print and keep cProfile views")
    args = parser.parse_args(argv)
    profiles: dict[str, str] | None = {} if args.profile else None
    us = measure(args.m, args.n, args.k, args.r, args.p, args.adapters, args.calls, args.blocks, profiles)
    result = {**provenance("host_cost.py", argv), "args": {k: v for k, v in vars(args).items() if k != "out"}, "us": us}
    if profiles:
        result["profiles"] = profiles
    write_results(args.out, f"-host{args.tag}", result)


if __name__ == "__main__":
    main()
