"""Host-to-GPU copies that never make the host wait for the GPU.

The trainer keeps the GPU busy only while the host queues work ahead of it. A plain
``tensor.to("cuda")`` of a host tensor (``torch.tensor(..., device="cuda")`` too) synchronises the
stream after the copy, so the host waits for everything queued before it; with ``non_blocking=True``
from pageable memory CUDA still lets the driver wait for the stream while it stages the data. From
pinned memory the copy is queued like a kernel and the host goes on at once. ``test_gpu.py`` checks
that queueing a whole microbatch and an optimizer step never waits for the GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["to_device"]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, queued behind the stream's work without waiting for it.

    On a GPU the tensor goes through pinned memory from torch's caching host allocator, which keeps
    the pinned block until the copy has run, so ``host`` may be dropped or changed at once. A tensor
    that is not on the CPU, or a device that is not a GPU, takes a plain ``Tensor.to``.
    """
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
