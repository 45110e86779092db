"""The three packages installed side by side in one environment."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DISTRIBUTIONS = ("lorafusion-kernels", "lorafusion-sched", "lorafusion-megatron")


def test_all_three_are_installed_together() -> None:
    versions = {name: importlib.metadata.version(name) for name in DISTRIBUTIONS}
    assert all(versions.values())


def test_sched_stays_torch_free_beside_torch_using_siblings() -> None:
    code = "import sys, lorafusion_sched; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
