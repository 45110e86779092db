"""Every shipped ``configs/<gpu-key>.json`` validates, covers every FusedLoRA kernel and serves the multi kernels."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest
import torch

from lorafusion_kernels.tuning import ConfigFile, clear_caches, gpu_key, lookup_config
from lorafusion_kernels.tuning.config import dumps, fallback_kernel
from lorafusion_kernels.tuning.launches import MULTI_ADAPTER_KERNELS, SINGLE_ADAPTER_KERNELS, LayerProblem, config_key
from lorafusion_kernels.tuning.search_space import MODEL_LAYERS

CONFIG_DIR = Path(str(importlib.resources.files("lorafusion_kernels") / "configs"))
FILES = sorted(CONFIG_DIR.glob("*.json"))


def test_h100_and_h200_are_shipped():
    names = {f.stem for f in FILES}
    assert {"nvidia_h100_80gb_hbm3", "nvidia_h200"} <= names


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_file_is_valid_and_canonical(path):
    text = path.read_text()
    parsed = ConfigFile.from_json(json.loads(text), where=str(path))
    assert parsed.device_key == path.stem == gpu_key(parsed.device_name)
    assert set(parsed.kernels) >= set(SINGLE_ADAPTER_KERNELS)
    assert set(parsed.kernels) <= {*SINGLE_ADAPTER_KERNELS, *MULTI_ADAPTER_KERNELS}
    assert text == dumps(parsed), "written by the tuner's deterministic writer (sorted, stable format)"
    for name, table in parsed.kernels.items():
        for entry in table.entries:
            assert entry.ms > 0, (name, entry)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_every_multi_adapter_kernel_resolves(path, monkeypatch):
    """Each FusedMultiLoRA kernel gets a config at every tuned FusedLoRA shape: its own, or FusedLoRA's."""
    import lorafusion_kernels.multi_lora  # noqa: F401  (imports the multi kernels, which register their fallbacks)

    monkeypatch.delenv("LORAFUSION_KERNELS_CONFIG_DIR", raising=False)
    clear_caches()
    parsed = ConfigFile.from_json(json.loads(path.read_text()), where=str(path))
    for multi in MULTI_ADAPTER_KERNELS:
        single = fallback_kernel(multi)
        for entry in parsed.kernels[single].entries:
            found = lookup_config(multi, entry.key, device_name=parsed.device_name)
            if multi in parsed.kernels:
                assert found in {e.config for e in parsed.kernels[multi].entries} | {entry.config}
            else:
                assert found == entry.config, "no table of its own: FusedLoRA's config for the shape"
    clear_caches()


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_every_entry_is_a_key_the_op_looks_up(path):
    """An entry keyed otherwise than :func:`config_key` is never found (the skinny passes' entries were
    keyed by the layer until 2026-11-25, so the op ran them with the table's default)."""
    parsed = ConfigFile.from_json(json.loads(path.read_text()), where=str(path))
    layers = {(n, k) for shapes in MODEL_LAYERS.values() for _, n, k in shapes}
    for name, table in parsed.kernels.items():
        for entry in table.entries:
            key = entry.key
            problems = [
                LayerProblem(m=key.m, n=n, k=k, r=key.r, dtype=torch.bfloat16, p=0.1, adapters=4, device="cpu")
                for n, k in layers
            ]
            assert any(config_key(name, problem) == key for problem in problems), (name, key)
