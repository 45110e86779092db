"""Helpers shared by the kernels and launchers: tile order, configs, interpreter detection, rank padding."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning.config import KernelConfig, ShapeKey, dtype_name, lookup_config
from lorafusion_kernels.tuning.device import capability, device_name, num_sms

MAX_RANK = 128
"""Largest LoRA rank the kernels accept (the rank tile is padded to a power of two, at most 128)."""


def interpreting() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_triton(t: torch.Tensor) -> bool:
    """Whether ``t`` is served by the Triton kernels: CUDA fp16/bf16 tensors, or CPU tensors under the interpreter.

    float32 CUDA tensors take the plain torch path: the shipped launch configs size their tiles for
    2-byte operands, and an fp32 GEMM at those tiles needs more shared memory than a Hopper SM has
    (327,696 bytes of 232,448 for the multi-adapter forward, seen on an H100).
    """
    if t.is_cuda:
        return t.dtype in (torch.float16, torch.bfloat16)
    return t.device.type == "cpu" and interpreting()


def rank_block(r: int) -> int:
    """The rank tile: the next power of two >= ``r``, at least 16 (the smallest ``tl.dot`` extent).

    Raises:
        LoRAFusionKernelsError: if ``r`` is not in ``[1, 128]``.
    """
    if not 1 <= r <= MAX_RANK:
        raise LoRAFusionKernelsError(f"LoRA rank must be in [1, {MAX_RANK}], got {r}")
    return max(16, 1 << (r - 1).bit_length())


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


def launch_config(kernel: str, t: torch.Tensor, *, m: int, n: int, k: int, r: int) -> KernelConfig:
    """The config of ``kernel`` for this problem on ``t``'s device (heuristic, silently, off the GPU)."""
    key = ShapeKey(m=m, n=n, k=k, r=r, dtype=dtype_name(t.dtype))
    if not t.is_cuda:
        return lookup_config(kernel, key, device_name=None)
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return lookup_config(kernel, key, device_name=device_name(index), capability=capability(index))


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
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        split = -(-2 * num_sms(index) // max(tiles, 1))
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
