"""What a benchmark's numbers were measured on: device, software versions and date.

Imported by the benchmark scripts of this folder (run as ``python benchmarks/<script>.py``, so this
folder is on ``sys.path``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from typing import Any

__all__ = ["provenance"]

DISTRIBUTIONS = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "megatron-core",
    "pydantic",
    "highspy",
    "lorafusion-kernels",
    "lorafusion-sched",
    "lorafusion-megatron",
)
"""Distributions whose versions a result records (``null`` for one that is not installed)."""


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return _source_version(distribution)


def _source_version(distribution: str) -> str | None:
    """The ``__version__`` of a project package imported from source (on ``PYTHONPATH``, not installed)."""
    if not distribution.startswith("lorafusion-"):
        return None
    import importlib

    try:
        module = importlib.import_module(distribution.replace("-", "_"))
    except ImportError:
        return None
    version = getattr(module, "__version__", None)
    return None if version is None else f"{version} (source)"


def _device() -> dict[str, Any]:
    """The GPUs torch sees (name and count), or the CPU."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        return {"kind": "cuda", "name": ", ".join(names), "count": count, "cuda": torch.version.cuda}
    return {"kind": "cpu", "name": f"{platform.machine()} CPU ({os.cpu_count()} cores)", "count": 1}


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict[str, Any]:
    """The header of a results file: device, CPU model and cores, Python and package versions, UTC date.

    The CPU model matters wherever the host, not the GPU, bounds a figure (many small launches).
    """
    return {
        "device": _device(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in DISTRIBUTIONS},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
