"""Host helpers the kernel launchers share: split reductions, their buffers, built-in heuristics."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton.runtime.errors import OutOfResources

import lorafusion_kernels._kernels._common as common
from lorafusion_kernels._kernels._common import (
    GEMM_HEURISTIC,
    capability_heuristic,
    launch_fitting,
    launch_warming_layout_variant,
    partial_stride,
    reduce_split_output,
    split_output,
    split_reduction,
)
from lorafusion_kernels.errors import LoRAFusionKernelsWarning
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


class _SharedMemoryKernel:
    """Stands in for a Triton kernel whose config fits in shared memory only from ``fits`` stages down."""

    __name__ = "_stand_in_kernel"

    def __init__(self, fits: int, error: Exception | None = None) -> None:
        self.fits = fits
        self.error = error
        self.tried: list[int] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.tried.append(kwargs["num_stages"])
            if kwargs["num_stages"] > self.fits:
                raise self.error or OutOfResources(263168, 232448, "shared memory")

        return launch


@pytest.mark.usefixtures("fresh_fitting_memo")
def test_a_config_that_overflows_shared_memory_runs_with_fewer_stages() -> None:
    """The sibling dx GEMM at rank tile 128 needed 263,168 of 232,448 bytes on H100 and raised; now it runs."""
    kernel = _SharedMemoryKernel(fits=2)
    with pytest.warns(LoRAFusionKernelsWarning, match="4 pipeline stages need more shared memory.*launched with 2"):
        ran = launch_fitting(kernel, (1,), "x", BLOCK_R=128, num_stages=4)
    assert ran == {"BLOCK_R": 128, "num_stages": 2}
    assert kernel.tried == [4, 3, 2]
    launch_fitting(kernel, (1,), "x", BLOCK_R=128, num_stages=4)
    assert kernel.tried[3:] == [2], "the stages that fit are remembered for the same launch"
    launch_fitting(kernel, (1,), "x", BLOCK_R=16, num_stages=2)
    assert kernel.tried[4:] == [2], "other launches of the kernel keep their own stages"


@pytest.mark.parametrize(
    ("fits", "error"),
    [(0, None), (1, OutOfResources(300, 255, "registers")), (1, RuntimeError("not a resource"))],
    ids=["no-stage-count-fits", "registers", "other-error"],
)
def test_launch_failures_other_than_too_few_stages_are_raised(fits: int, error: Exception | None) -> None:
    kernel = _SharedMemoryKernel(fits=fits, error=error)
    with pytest.raises(type(error) if error is not None else OutOfResources):
        launch_fitting(kernel, (1,), num_stages=3)


@pytest.mark.usefixtures("fresh_fitting_memo")
def test_inside_exact_stages_a_config_that_does_not_fit_raises() -> None:
    """The tuner times candidates as given: one that does not fit loses instead of running as another config."""
    kernel = _SharedMemoryKernel(fits=2)
    with pytest.warns(LoRAFusionKernelsWarning):
        launch_fitting(kernel, (1,), BLOCK_R=128, num_stages=4)
    with common.exact_stages(), pytest.raises(OutOfResources):
        launch_fitting(kernel, (1,), BLOCK_R=128, num_stages=4)
    assert kernel.tried[3:] == [4], "neither retried nor taken from what an earlier launch remembered"
    assert launch_fitting(kernel, (1,), BLOCK_R=128, num_stages=4) == {"BLOCK_R": 128, "num_stages": 2}


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("false", False), ("", False)],
)
def test_the_interpreter_flag_reads_as_triton_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str, *, on: bool
) -> None:
    # TRITON_INTERPRET=false was taken as on: CPU tensors went to kernels Triton had no driver to launch.
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert common.interpreting() is on
