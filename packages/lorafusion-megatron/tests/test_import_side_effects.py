"""Importing lorafusion_megatron must do no work: no CUDA query (CPU CI, login nodes, config validation)."""

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

    import lorafusion_megatron
    """
)


def test_import_makes_no_cuda_query() -> None:
    subprocess.run([sys.executable, "-c", POISON_CUDA_AND_IMPORT], check=True)


def test_import_loads_no_heavy_framework() -> None:
    code = (
        "import sys, lorafusion_megatron; "
        "heavy = {'torch', 'megatron', 'transformers', 'peft'} & set(sys.modules); "
        "assert not heavy, f'imported at package import: {sorted(heavy)}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_declared_dependencies_import_on_cpu() -> None:
    code = "import megatron.core, transformers, peft, lorafusion_kernels, lorafusion_sched"
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True)
