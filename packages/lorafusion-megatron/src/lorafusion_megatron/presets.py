"""Named base-model architectures built from their configs with random weights (no download).

Throughput does not depend on weight values, so benchmarks build real architectures' shapes with
random weights; ``tiny`` is small enough for CPU tests and the demo. Each preset is the keyword
arguments of a transformers config class, kept as plain data so this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LORA_TARGETS", "PRESETS", "Preset"]

LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
"""Linear module names per ``model_type``; lets ``validate`` check ``target_modules`` without torch."""

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


@dataclass(frozen=True)
class Preset:
    """A named architecture: the transformers ``model_type`` and its config keyword arguments."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "llama",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    "llama-3.1-8b": Preset(
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": _LLAMA3_ROPE,
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
    ),
    "llama-3.1-70b": Preset(
        "llama",
        {
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": _LLAMA3_ROPE,
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
    ),
    "qwen2.5-32b": Preset(
        "qwen2",
        {
            "hidden_size": 5120,
            "intermediate_size": 27648,
            "num_hidden_layers": 64,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
        },
    ),
}
"""Architecture presets by the name used in ``base_model.model_name_or_path``."""
