"""Importing lorafusion_kernels must do no work: no CUDA query (CPU CI, login nodes, config validation)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

POISON_CUDA_AND_IMPORT = textwrap.dedent(
    """
    import torch

    def _forbidden(*args, **kwargs):
        raise AssertionError("CUDA was queried at import time")

    for name in ("is_available", "device_count", "current_device", "get_device_name",
                 "get_device_properties", "get_device_capability", "init", "synchronize"):
        setattr(torch.cuda, name, _forbidden)

    import lorafusion_kernels
    """
)


def test_import_makes_no_cuda_query() -> None:
    subprocess.run([sys.executable, "-c", POISON_CUDA_AND_IMPORT], check=True)
