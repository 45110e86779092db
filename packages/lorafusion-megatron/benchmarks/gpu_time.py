"""The GPU's time over a profiled stretch of training: busy time by kernel and kind, idle time, gaps.

Shared by ``profile_trainer.py`` (the microbatch loop, mode by mode) and ``bench_trainer.py``
(``--trainer-profile``: the whole trainer's plan, optimizer steps included).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import torch

# Kernel kinds, by substrings of the kernel's name (lower case), checked in this order.
KINDS = (
    ("lorafusion", ("lora",)),
    ("attention", ("flash", "fmha", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
)


def kind_of(kernel: str) -> str:
    """``kernel``'s kind: the first of :data:`KINDS` whose substrings it contains, else ``other``."""
    name = kernel.lower()
    return next((kind for kind, parts in KINDS if any(part in name for part in parts)), "other")


def gpu_time(prof: Any, microbatches: int, wall_ms: float, top: int) -> dict[str, Any]:
    """Per microbatch: wall, busy (kernels' summed time) and idle (wall less busy) milliseconds, and more.

    Also the busy time by kind and by the ``top`` kernels, and the idle gaps (:func:`idle_gaps`).

    Args:
        prof: A finished ``torch.profiler.profile`` with CUDA activity over the stretch.
        microbatches: Microbatches the stretch ran.
        wall_ms: Its wall time per microbatch.
        top: How many kernels (and gap-ending kernels) to list.
    """
    kernels: dict[str, float] = defaultdict(float)
    gpu_events = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    for event in gpu_events:
        kernels[event.name[:100]] += event.device_time / 1e3 / microbatches
    kinds: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        kinds[kind_of(name)] += ms
    busy_ms = sum(kernels.values())
    ranked = sorted(kernels.items(), key=lambda item: -item[1])
    return {
        "wall_ms": round(wall_ms, 2),
        "busy_ms": round(busy_ms, 2),
        "idle_ms": round(wall_ms - busy_ms, 2),
        "kinds_ms": {kind: round(ms, 2) for kind, ms in sorted(kinds.items(), key=lambda item: -item[1])},
        "top_kernels_ms": {name: round(ms, 3) for name, ms in ranked[:top]},
        "gaps": idle_gaps(gpu_events, microbatches, top),
    }


GAP_BINS_US = (10, 100, 1000)
"""Bounds of the gap-length bins of :func:`idle_gaps` (microseconds)."""


def idle_gaps(events: list[Any], microbatches: int, top: int) -> dict[str, Any]:
    """Where the GPU sat idle between kernels, per microbatch (milliseconds).

    Gaps between consecutive kernels (by start time), binned by length, and summed by the name of
    the kernel that ended each gap (the work the GPU was waiting for): evenly spread short gaps mean
    a host that is slower than the GPU all along; a few long ones, a stall at some point of the loop.
    """
    spans = sorted((event.time_range.start, event.time_range.end, event.name[:100]) for event in events)
    by_bin: dict[str, float] = defaultdict(float)
    by_next: dict[str, float] = defaultdict(float)
    for (_, previous_end, _), (start, _, name) in itertools.pairwise(spans):
        gap = start - previous_end
        if gap <= 0:
            continue
        bound = next((b for b in GAP_BINS_US if gap < b), None)
        by_bin[f"<{bound} us" if bound else f">={GAP_BINS_US[-1]} us"] += gap / 1e3 / microbatches
        by_next[name] += gap / 1e3 / microbatches
    ranked = sorted(by_next.items(), key=lambda item: -item[1])[:top]
    return {
        "by_length_ms": {key: round(ms, 2) for key, ms in sorted(by_bin.items())},
        "by_next_kernel_ms": {name: round(ms, 2) for name, ms in ranked},
    }
