from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from lorafusion_megatron.base_fingerprint import PRESET_WEIGHTS, SAMPLE_BYTES, SAMPLES, base_weights_fingerprint


def _safetensors(path: Path, data: bytes) -> None:
    """A file in safetensors' layout: header length, JSON header, data."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    _safetensors(folder / "model-00001-of-00002.safetensors", bytes(range(256)) * 4096)  # 1 MiB
    _safetensors(folder / "model-00002-of-00002.safetensors", bytes(1000))
    (folder / "config.json").write_text("{}")
    return folder


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_same_weights_anywhere_hash_the_same(model: Path, tmp_path: Path) -> None:
    fingerprint = base_weights_fingerprint(str(model))
    assert fingerprint is not None
    assert len(fingerprint) == 16
    shutil.copytree(model, tmp_path / "moved")
    (tmp_path / "moved" / "config.json").write_text('{"edited": true}')  # not a weight file
    assert base_weights_fingerprint(str(tmp_path / "moved")) == fingerprint


def test_presets_say_how_their_weights_are_drawn_and_missing_folders_give_none(tmp_path: Path) -> None:
    assert base_weights_fingerprint("tiny") == PRESET_WEIGHTS
    assert base_weights_fingerprint(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("where", ["header", "sampled block", "last byte"])
def test_other_weights_hash_otherwise(model: Path, where: str) -> None:
    before = base_weights_fingerprint(str(model))
    shard = model / "model-00001-of-00002.safetensors"
    size = shard.stat().st_size
    block = (size - SAMPLE_BYTES) * (SAMPLES // 2) // (SAMPLES - 1)  # where the middle block starts
    _flip(shard, {"header": 20, "sampled block": block, "last byte": size - 1}[where])
    assert base_weights_fingerprint(str(model)) != before


def test_a_shard_renamed_or_added_hashes_otherwise(model: Path) -> None:
    before = base_weights_fingerprint(str(model))
    (model / "model-00002-of-00002.safetensors").rename(model / "model-00002-of-00003.safetensors")
    renamed = base_weights_fingerprint(str(model))
    (model / "extra.bin").write_bytes(b"x")
    assert len({before, renamed, base_weights_fingerprint(str(model))}) == 3
