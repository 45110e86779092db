"""lorafusion-sched must never need torch: other trainers use it without one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def test_import_leaves_torch_out_of_sys_modules() -> None:
    code = "import sys, lorafusion_sched; assert 'torch' not in sys.modules, 'lorafusion_sched imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(
    os.environ.get("LORAFUSION_EXPECT_NO_TORCH") != "1",
    reason="only meaningful in the alone venv (nox -s 'tests(lorafusion-sched)') where the env var is set",
)
def test_torch_is_not_installed() -> None:
    assert importlib.util.find_spec("torch") is None, "torch is installed in lorafusion-sched's own venv"
