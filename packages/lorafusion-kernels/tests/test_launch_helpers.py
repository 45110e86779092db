"""Host helpers the kernel launchers share: split reductions, their buffers, built-in heuristics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lorafusion_kernels._kernels._common as common
from lorafusion_kernels._kernels._common import (
    GEMM_HEURISTIC,
    capability_heuristic,
    launch_warming_layout_variant,
    partial_stride,
    reduce_split_output,
    split_output,
    split_reduction,
)
from lorafusion_kernels.tuning import KernelConfig, ShapeKey

KEY = ShapeKey(m=64, n=64, k=64, r=16, dtype="float16")


def test_split_reduction_covers_the_length_in_whole_blocks():
    cpu = torch.empty(0)
    assert split_reduction(3, cpu, tiles=4, length=100, block=16) == (3, 48)
    assert split_reduction(8, cpu, tiles=4, length=40, block=16) == (3, 16), "never more programs than blocks"
    assert split_reduction(0, cpu, tiles=4, length=100, block=16) == (1, 112), "automatic: one program off the GPU"


def test_split_output_is_the_result_or_fp32_partials(interpreter: None):
    single = split_output(1, (3, 5), torch.float16, torch.device("cpu"))
    assert (single.shape, single.dtype, partial_stride(single)) == ((3, 5), torch.float16, 0)
    assert reduce_split_output(single, torch.float16) is single
    partials = split_output(2, (3, 5), torch.float16, torch.device("cpu"))
    assert (partials.shape, partials.dtype, partial_stride(partials)) == ((2, 3, 5), torch.float32, 15)
    partials.copy_(torch.arange(30, dtype=torch.float32).reshape(2, 3, 5))
    reduced = reduce_split_output(partials, torch.float16)
    assert reduced.dtype == torch.float16
    assert torch.equal(reduced, (partials[0] + partials[1]).half())


def test_partials_are_summed_in_order_and_rounded_once(interpreter: None):
    """More elements than one program covers; the fp32 sum in split order, one rounding to fp16.

    (fp16: the interpreter rounds fp32 to bf16 toward zero, the GPU to nearest.)
    """
    partials = split_output(3, (37, 41), torch.float16, torch.device("cpu"))
    partials.copy_(torch.randn(3, 37, 41, generator=torch.Generator().manual_seed(0)) * 1e3)
    reduced = reduce_split_output(partials, torch.float16)
    assert (reduced.shape, reduced.dtype) == ((37, 41), torch.float16)
    assert torch.equal(reduced, ((partials[0] + partials[1]) + partials[2]).half())


def test_capability_heuristic_picks_by_device():
    small = KernelConfig(block_m=16, block_n=16, block_k=16)
    gpu = KernelConfig(block_m=64, block_n=64, block_k=32)
    hopper = KernelConfig(block_m=128, block_n=128, block_k=64)
    heuristic = capability_heuristic(interpreter=small, gpu=gpu, hopper=hopper)
    assert heuristic(KEY, (0, 0)) == small
    assert heuristic(KEY, (8, 0)) == gpu
    assert heuristic(KEY, (9, 0)) == hopper
    assert capability_heuristic(interpreter=small, gpu=gpu)(KEY, (9, 0)) == gpu
    assert GEMM_HEURISTIC(KEY, (9, 0)).block_n == 256


class _RecordingKernel:
    """Stands in for a Triton kernel: records launches and warm-ups (compilations without a launch)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.calls.append(("launch", kwargs["ONE_SEGMENT"]))

    def warmup(self, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
        self.calls.append(("warmup", kwargs["ONE_SEGMENT"]))


def test_layout_variant_is_compiled_once_next_to_the_first_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A microbatch that flips ONE_SEGMENT later finds its variant compiled (on 4 H200s it stalled every stage)."""
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "_WARMED_LAYOUT_VARIANTS", set())
    kernel = _RecordingKernel()
    for one_segment, key in [(True, "layer a"), (False, "layer a"), (False, "layer b"), (True, None)]:
        launch_warming_layout_variant(kernel, (1,), (), {"ONE_SEGMENT": one_segment}, flag="ONE_SEGMENT", key=key)
    assert kernel.calls == [
        ("launch", True),
        ("warmup", False),
        ("launch", False),
        ("launch", False),
        ("warmup", True),
        ("launch", True),
    ]
