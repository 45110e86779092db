"""Repository-wide pytest hooks.

Torch-free on purpose: ``lorafusion-sched`` runs its tests in a venv with no torch, so torch is only
imported (lazily) when a test marked ``gpu`` or ``multigpu`` is about to run.

``gpu`` / ``multigpu(gpus=N)`` tests skip when CUDA (or enough GPUs) is missing, unless
``LORAFUSION_REQUIRE_GPU=1`` is set: then a missing GPU fails the test instead, so a device run can
never pass by skipping everything.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

REQUIRE_GPU_ENV = "LORAFUSION_REQUIRE_GPU"


@functools.cache
def _cuda_device_count() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpus_needed(item: pytest.Item) -> int:
    multi = item.get_closest_marker("multigpu")
    if multi is not None:
        return int(multi.kwargs.get("gpus", 2))
    return 1 if item.get_closest_marker("gpu") is not None else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    needed = _gpus_needed(item)
    if needed == 0:
        return
    available = _cuda_device_count()
    if available >= needed:
        return
    reason = f"needs {needed} CUDA GPU(s), found {available}"
    if os.environ.get(REQUIRE_GPU_ENV) == "1":
        pytest.fail(f"{REQUIRE_GPU_ENV}=1 but this test {reason}", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_GPU_ENV}=1 to fail instead)")
