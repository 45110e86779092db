"""Helpers shared by the kernels and launchers: tile order, GEMM loop, configs, splits, interpreter detection."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Hashable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from lorafusion_kernels.errors import LoRAFusionKernelsError, LoRAFusionKernelsWarning, user_stacklevel
from lorafusion_kernels.tuning.config import Heuristic, KernelConfig, ShapeKey, launch_lookup, rank_tile
from lorafusion_kernels.tuning.device import capability, num_sms

MAX_RANK = 128
"""Largest LoRA rank the kernels accept (the rank tile is padded to a power of two, at most 128)."""

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Activation dtypes the fused paths compute in (float32 runs the plain torch path on CUDA: :func:`runs_triton`)."""

ACTIVATION_DTYPES = (*SUPPORTED_DTYPES, torch.float64)
"""Activation dtypes the ops accept: float64 too, which runs the plain torch path in float64 on every device."""


_TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y"})
"""The values of ``TRITON_INTERPRET`` that Triton takes as on (any case); anything else is off."""


def interpreting() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``), read at call time.

    Read as Triton reads it (``TRITON_INTERPRET=false`` is off: taken as on, it sent CPU tensors
    to kernels that Triton, not interpreting, had no driver to launch). Not through
    ``triton.knobs``: its C++ reader stops ``torch.compile`` from tracing the ops' host code.
    """
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE_WORDS


def runs_triton(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``t``, computed in ``dtype`` (default: its own), is served by the Triton kernels.

    They serve CUDA fp16/bf16 tensors, and CPU fp16/fp32 tensors under the interpreter. float32 CUDA
    tensors take the plain torch path: the shipped launch configs size their tiles for 2-byte
    operands, and an fp32 GEMM at those tiles needs more shared memory than a Hopper SM has (327,696
    bytes of 232,448 for the multi-adapter forward, seen on an H100). bfloat16 CPU tensors take it
    too: the interpreter's ``tl.dot`` gives wrong results on bfloat16 operands. Other dtypes (float64)
    take it on every device.
    """
    if t.is_cuda:
        return (dtype or t.dtype) in (torch.float16, torch.bfloat16)
    return t.device.type == "cpu" and (dtype or t.dtype) in (torch.float16, torch.float32) and interpreting()


_FITTING_STAGES: dict[Hashable, int] = {}
"""``(kernel, launch arguments)`` -> the pipeline stages that fit in shared memory, for launches that needed fewer."""

_KERNELS_WITH_FEWER_STAGES: set[Any] = set()
"""The kernels with an entry in ``_FITTING_STAGES`` (a launch of any other kernel skips the lookup)."""

_EXACT_STAGES = [False]
"""Whether :func:`launch_fitting` launches the stages asked for or raises (set by :func:`exact_stages`)."""


@contextlib.contextmanager
def exact_stages() -> Iterator[None]:
    """Inside, a config that does not fit in shared memory raises ``OutOfResources``, not run with fewer stages.

    The tuner times candidates inside it, so a config that does not fit loses rather than being timed
    as another config and recorded under its own stage count.
    """
    before = _EXACT_STAGES[0]
    _EXACT_STAGES[0] = True
    try:
        yield
    finally:
        _EXACT_STAGES[0] = before


def launch_fitting(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``kernel[grid](*args, **kwargs)``; where its config does not fit in shared memory, with fewer pipeline stages.

    A config is tuned at one rank tile, and a launch may use it at a wider one (``BLOCK_R`` up to 128:
    rank 128, or a sibling call's stacked rank). Its LoRA operands then take more shared memory
    than the GPU has: on H100 (2026-11-26) the sibling dx GEMM of LLaMa-3.1-8B's q/k/v at rank 32
    (``BLOCK_R = 128``, 8,192 tokens) needed 263,168 of 232,448 bytes. The launch is retried with one
    stage fewer at a time (down to one stage); the stages that fit are remembered for the same
    launch arguments, and a warning names the config once. Any other failure is raised as it is, and
    so is this one inside :func:`exact_stages`.

    Returns:
        The keyword arguments of the launch that ran (``num_stages`` possibly lowered).
    """
    asked = kwargs.get("num_stages", 3)  # Triton's default
    exact = _EXACT_STAGES[0]
    ident = (kernel, tuple(sorted(kwargs.items()))) if kernel in _KERNELS_WITH_FEWER_STAGES and not exact else None
    stages = _FITTING_STAGES.get(ident, asked) if ident else asked
    while True:
        launched = kwargs if stages == asked else {**kwargs, "num_stages": stages}
        try:
            kernel[grid](*args, **launched)
            break
        except OutOfResources as exc:
            if exc.name != "shared memory" or stages <= 1 or exact:
                raise
            stages -= 1
    if stages != asked:
        ident = ident or (kernel, tuple(sorted(kwargs.items())))
        if ident not in _FITTING_STAGES:
            _FITTING_STAGES[ident] = stages
            _KERNELS_WITH_FEWER_STAGES.add(kernel)
            warnings.warn(
                f"{kernel.__name__}: {asked} pipeline stages need more shared memory than this GPU has at "
                f"BLOCK_R={kwargs.get('BLOCK_R')}; launched with {stages} (tune this rank to avoid it)",
                LoRAFusionKernelsWarning,
                stacklevel=user_stacklevel(),
            )
    return launched


_WARMED_LAYOUT_VARIANTS: set[Hashable] = set()
"""``(kernel, key)`` of the launches whose other layout variant :func:`launch_warming_layout_variant` compiled."""


def launch_warming_layout_variant(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    flag: str,
    key: Hashable | None,
) -> None:
    """``kernel[grid](*args, **kwargs)``; then, once per ``key``, compile the variant with constexpr ``flag`` flipped.

    ``flag`` is chosen from the microbatch's layout (``ONE_SEGMENT``: no row tile straddles a segment
    boundary), so a later microbatch may need the other variant. Compiling it then stalls the run:
    on 4 H200s (LLaMa-3.1-70B, 2026-11-26) two kernels compiled it in the timed run, 0.8 to 2.1 s
    per pipeline stage, while the other stages waited. Compiling it here, next to the first
    launch, moves that time to the warm-up. ``key`` names what else the compiled variant depends on
    (the config, dtypes and sizes); None where ``flag`` does not follow the layout (nothing to warm).
    The interpreter compiles nothing.
    """
    kwargs = launch_fitting(kernel, grid, *args, **kwargs)
    if key is None or (kernel, key) in _WARMED_LAYOUT_VARIANTS or interpreting():
        return
    _WARMED_LAYOUT_VARIANTS.add((kernel, key))
    kernel.warmup(*args, grid=grid, **{**kwargs, flag: not kwargs[flag]})


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (launch grids, splits).

    ``triton.cdiv`` gives the same, but on the host it is a constexpr-function wrapper that costs about
    2 us per call (measured on the 2-core CI host), and a launch computes several.
    """
    return -(-a // b)


def rank_block(r: int) -> int:
    """The rank tile: the next power of two >= ``r``, at least 16 (the smallest ``tl.dot`` extent).

    Raises:
        LoRAFusionKernelsError: if ``r`` is not in ``[1, 128]``.
    """
    if not 1 <= r <= MAX_RANK:
        raise LoRAFusionKernelsError(f"LoRA rank must be in [1, {MAX_RANK}], got {r}")
    return rank_tile(r)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact IEEE fp32 for float32 operands (tf32 would lose bits), else the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id to an output tile ``(pid_m, pid_n)``, ``GROUP_M`` row blocks at a time.

    Consecutive programs share row blocks of the left operand and column blocks of the right one,
    so both stay in L2 while a group of tiles is computed.
    """
    group_size = GROUP_M * num_pid_n
    group_id = pid // group_size
    first_m = group_id * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def wrapped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's ``[BLOCK_M, BLOCK_N]`` tile of an ``[M, N]`` output, in :func:`grouped_tile` order.

    Returns:
        ``(pid_m, pid_n, offs_m, offs_n, rows, cols)``: the tile's indices, its row and column
        indices, and the same wrapped into ``[0, M)`` and ``[0, N)``. Loads through ``rows``/``cols``
        need no masks (what a wrapped index loads is never stored), which keeps the inner loop free
        of predicates; stores go through ``offs_m``/``offs_n`` with masks.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    cols = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    return pid_m, pid_n, offs_m, offs_n, rows, cols


@triton.jit
def dot_k_loop(acc, a_ptrs, b_ptrs, K, step_a, step_b, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + A B`` over a reduction of length ``K``, ``BLOCK_K`` at a time (pointer loads).

    Args:
        acc: fp32 ``[BLOCK_M, BLOCK_N]`` accumulator.
        a_ptrs: ``[BLOCK_M, BLOCK_K]`` pointers to the first step's A tile.
        b_ptrs: ``[BLOCK_K, BLOCK_N]`` pointers to the first step's B tile.
        K: Reduction length; the last step's elements beyond it load as 0.
        step_a: Stride of A along the reduction (the pointers advance ``BLOCK_K * step_a``).
        step_b: Stride of B along the reduction.
        BLOCK_K: Reduction step.
        DOT_PRECISION: ``tl.dot`` input precision.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * step_a
        b_ptrs += BLOCK_K * step_b
    return acc


def gemm_meta(cfg: KernelConfig, *, block_r: int, dtype: torch.dtype) -> dict[str, Any]:
    """The compile-time arguments of every GEMM kernel (pointer and TMA variants alike).

    ``BLOCK_M x BLOCK_N`` is the output tile, ``BLOCK_K`` the reduction step, ``BLOCK_R`` the rank tile.
    """
    return {
        "DOT_PRECISION": dot_precision(dtype),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_R": block_r,
        "GROUP_M": cfg.group_m,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def launch_config(kernel: str, t: torch.Tensor, *, m: int, n: int, k: int, r: int) -> KernelConfig:
    """The config of ``kernel`` for this problem on ``t``'s device (see :func:`launch_lookup`: cached per problem)."""
    return launch_lookup(kernel, m, n, k, r, t.dtype, t.device)


def split_reduction(split: int, t: torch.Tensor, *, tiles: int, length: int, block: int) -> tuple[int, int]:
    """``(programs, per_program)`` sharing a reduction of ``length``; ``per_program`` is a multiple of ``block``.

    Args:
        split: The config's value (0: automatic, see :func:`resolve_split`).
        t: A tensor on the launch device.
        tiles: Independent output tiles the grid already has.
        length: Extent of the reduced dimension.
        block: Step of the kernel's loop over it.
    """
    split = resolve_split(split, t, tiles=tiles, steps=cdiv(length, block))
    per_program = cdiv(cdiv(length, split), block) * block
    return cdiv(length, per_program), per_program


def split_output(split: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where a reduction split ``split`` ways writes: ``shape`` in ``dtype``, or fp32 partials ``[split, *shape]``.

    :func:`reduce_split_output` turns either into the result; partials are summed in a fixed order.
    """
    if split == 1:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty((split, *shape), dtype=torch.float32, device=device)


def partial_stride(out: torch.Tensor) -> int:
    """Elements between the partials of :func:`split_output` (0 when there is one)."""
    return out.stride(0) if out.dim() == 3 else 0


def zeroed_fp32(*shapes: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zeroed fp32 buffer and views of it of ``shapes``, consecutive: one fill kernel for them all.

    Atomic accumulators of one backward share it, and consecutive results of one dtype can be
    converted by a single ``.to`` of the span of the buffer that holds them.

    Returns:
        ``(buffer, views)``: the flat buffer and one view per shape, in order.
    """
    buffer = torch.zeros(sum(rows * cols for rows, cols in shapes), dtype=torch.float32, device=device)
    views, start = [], 0
    for rows, cols in shapes:
        views.append(buffer[start : start + rows * cols].view(rows, cols))
        start += rows * cols
    return buffer, views


def parameter_grads(
    buffer: torch.Tensor, db32: torch.Tensor, da32: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dA, dB)`` in the parameters' dtypes from fp32 accumulators at the start of ``buffer`` (dB, then dA).

    ``buffer`` is :func:`zeroed_fp32`'s, with ``db32`` and ``da32`` its first two views. fp32
    parameters take the accumulators as they are; parameters of one lower dtype take one conversion
    kernel for both (the two results are views of its output).
    """
    if a_dtype == b_dtype == torch.float32:
        return da32, db32
    if a_dtype != b_dtype:
        return da32.to(a_dtype), db32.to(b_dtype)
    converted = buffer[: db32.numel() + da32.numel()].to(a_dtype)
    return converted[db32.numel() :].view(da32.shape), converted[: db32.numel()].view(db32.shape)


def unaliased(grad: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``grad``, or a copy of it where it shares storage with ``other``.

    A custom op's outputs may not alias each other; :func:`parameter_grads` returns views of one
    buffer, so the ops' registered backwards copy dA out (one tiny kernel under compile only).
    """
    return grad.clone() if grad.untyped_storage().data_ptr() == other.untyped_storage().data_ptr() else grad


SUM_PARTIALS_BLOCK = 1024
"""Elements per program of :func:`_sum_partials_kernel`."""


@triton.jit(do_not_specialize=["numel", "num_parts"])
def _sum_partials_kernel(parts_ptr, out_ptr, numel, num_parts, BLOCK: tl.constexpr):
    """``out[i] = sum_p parts[p, i]`` for contiguous fp32 ``parts [num_parts, numel]``, summed in order, cast once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = parts_ptr + offs
    for _ in range(num_parts):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += numel  # a 64-bit address: no int32 product to overflow
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_split_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The result in ``dtype`` from :func:`split_output`'s buffer.

    fp32 partials ``[split, rows, cols]`` are summed in split order and rounded to ``dtype`` once, in
    one kernel (a torch sum and a cast took two launches per call).
    """
    if out.dim() == 2:
        return out
    result = torch.empty(out.shape[1:], dtype=dtype, device=out.device)
    numel = result.numel()
    if numel > 0:
        grid = (cdiv(numel, SUM_PARTIALS_BLOCK),)
        _sum_partials_kernel[grid](out, result, numel, out.shape[0], BLOCK=SUM_PARTIALS_BLOCK, num_warps=4)
    return result


def capability_heuristic(
    *, interpreter: KernelConfig, gpu: KernelConfig, hopper: KernelConfig | None = None
) -> Heuristic:
    """A heuristic that ignores the shape and looks at the compute capability only.

    Args:
        interpreter: The config with no GPU (capability ``(0, 0)``: the interpreter's small tiles).
        gpu: The config on a GPU.
        hopper: The config on sm_90+, if it differs from ``gpu``.
    """

    def heuristic(key: ShapeKey, capability: tuple[int, int]) -> KernelConfig:
        if capability == (0, 0):
            return interpreter
        if hopper is not None and capability >= (9, 0):
            return hopper
        return gpu

    return heuristic


GEMM_HEURISTIC = capability_heuristic(
    interpreter=KernelConfig(block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
    gpu=KernelConfig(block_m=128, block_n=128, block_k=32, group_m=8, num_warps=4, num_stages=4),
    hopper=KernelConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
)
"""The built-in configs of the two GEMM kernels (``xw_sb``, ``dyw_dsa``)."""

SKINNY_HEURISTIC = capability_heuristic(
    interpreter=KernelConfig(block_m=32, block_n=32, block_k=16, split=1, num_warps=4, num_stages=1),
    gpu=KernelConfig(block_m=64, block_n=128, block_k=16, split=0, num_warps=4, num_stages=3),
)
"""The built-in configs of the ``dA`` pass (``dsx``), which reads ``x [M, K]``."""


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of the CUDA device ``t`` lives on."""
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return num_sms(index)


def resolve_split(split: int, t: torch.Tensor, *, tiles: int, steps: int) -> int:
    """Programs per reduction: ``split`` itself, or (``split == 0``) enough to give ~2 programs per SM.

    Args:
        split: The config's value (0: automatic).
        t: A tensor on the launch device.
        tiles: Independent output tiles the grid already has.
        steps: Reduction steps available to divide (the split never exceeds it).
    """
    if split == 0:
        if not t.is_cuda:
            return 1
        split = -(-2 * sm_count(t) // max(tiles, 1))
    return max(1, min(split, steps))


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether 2-D ``tensors`` can be TMA tensor descriptors.

    Needs sm_90+ (or the interpreter), a unit inner stride, and a 16-byte aligned base and row stride.
    """
    first = tensors[0]
    if first.is_cuda:
        index = first.device.index if first.device.index is not None else torch.cuda.current_device()
        if capability(index) < (9, 0):
            return False
    elif not interpreting():
        return False
    return all(
        t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in tensors
    )
