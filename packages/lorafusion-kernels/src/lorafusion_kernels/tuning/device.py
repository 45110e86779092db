"""Which GPU we run on, as a file-name key: ``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``.

Every query is lazy (nothing happens at import) and ``LORAFUSION_GPU_NAME`` overrides the name,
so configs can be checked or forced on a machine without that GPU.
"""

from __future__ import annotations

import functools
import os
import re

GPU_NAME_ENV = "LORAFUSION_GPU_NAME"


def gpu_key(name: str) -> str:
    """Sanitize a device name into a config file key: lower case, runs of other characters -> ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def device_name(device_index: int | None = None) -> str | None:
    """The device name used to pick a config file, or None when no GPU is visible.

    ``LORAFUSION_GPU_NAME`` wins; then ``torch.cuda.get_device_name``.
    """
    override = os.environ.get(GPU_NAME_ENV)
    if override:
        return override
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device_index is None else device_index
    return _cuda_device_name(index)


@functools.cache
def _cuda_device_name(device_index: int) -> str:
    import torch

    return str(torch.cuda.get_device_name(device_index))


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs a driver call)."""
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """Compute capability of a CUDA device, e.g. ``(9, 0)`` for Hopper."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return int(major), int(minor)
