"""Every shipped ``configs/<gpu-key>.json`` validates and covers every single-adapter kernel."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest

from lorafusion_kernels.tuning import ConfigFile, gpu_key
from lorafusion_kernels.tuning.config import dumps

CONFIG_DIR = Path(str(importlib.resources.files("lorafusion_kernels") / "configs"))
FILES = sorted(CONFIG_DIR.glob("*.json"))
SINGLE_ADAPTER_KERNELS = {"xa", "xw_sb", "dys_dyb", "dsx", "dyw_dsa"}


def test_h100_and_h200_are_shipped():
    names = {f.stem for f in FILES}
    assert {"nvidia_h100_80gb_hbm3", "nvidia_h200"} <= names


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_file_is_valid_and_canonical(path):
    text = path.read_text()
    parsed = ConfigFile.from_json(json.loads(text), where=str(path))
    assert parsed.device_key == path.stem == gpu_key(parsed.device_name)
    assert set(parsed.kernels) >= SINGLE_ADAPTER_KERNELS
    assert text == dumps(parsed), "written by the tuner's deterministic writer (sorted, stable format)"
    for name, table in parsed.kernels.items():
        for entry in table.entries:
            assert entry.ms > 0, (name, entry)
