"""A hash of the base model's weight files, so that a resume onto other base weights is refused.

Hashing every byte would read the whole model at each start (140 GB for a 70B model), so the hash
covers each weight file's name and size, its whole safetensors header (every tensor's name, dtype,
shape and offsets) and :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES` at evenly spaced places
(the first and the last included): about 256 KiB read per file. Another model under the same path
(an instruct model for its base, another fine-tune, another revision) differs in every sampled
block; an edit of a few tensors between the samples is not seen.

Torch-free, like the fingerprints of the config and the data.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from lorafusion_megatron.presets import PRESETS

__all__ = ["PRESET_WEIGHTS", "SAMPLES", "SAMPLE_BYTES", "WEIGHT_SUFFIXES", "base_weights_fingerprint"]

PRESET_WEIGHTS = "preset-drawn-per-tensor-name"
"""What a preset's weights record: drawn per tensor name from the run's seed (in both runtimes).

Until this was recorded, the single-process trainer drew a preset's weights otherwise (in one
sequence from the global seed), so its checkpoints of a preset run cannot be resumed now.
"""
SAMPLES = 64
"""Blocks read from each weight file."""
SAMPLE_BYTES = 4096
"""Bytes in one block."""
WEIGHT_SUFFIXES = (".safetensors", ".bin")
"""The files of a model folder that hold weights (transformers' safetensors shards or torch pickles)."""
_MAX_HEADER = 100 * 2**20
"""A safetensors header larger than this (100 MiB) is not one: the file is hashed by its samples only."""


def base_weights_fingerprint(model_name_or_path: str) -> str | None:
    """16 hex digits of the weight files in the folder ``model_name_or_path``.

    A preset's weights are drawn from the run's seed, which the config fingerprint already holds:
    :data:`PRESET_WEIGHTS` says how. A missing folder gives ``None``: loading the model says what
    is wrong with the path.
    """
    if model_name_or_path in PRESETS:
        return PRESET_WEIGHTS
    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        digest.update(_file_digest(path))
    return digest.hexdigest()[:16]


def _file_digest(path: Path) -> bytes:
    """SHA-256 of one weight file's name, size, safetensors header and sampled blocks."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as handle:
        if path.suffix == ".safetensors" and size >= 8:
            (header_length,) = struct.unpack("<Q", handle.read(8))
            if header_length <= min(size - 8, _MAX_HEADER):
                digest.update(handle.read(header_length))
        last = max(size - SAMPLE_BYTES, 0)
        for index in range(SAMPLES):
            handle.seek(last * index // (SAMPLES - 1))
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.digest()
