"""Multi-job LoRA trainer: several LoRA jobs sharing one base model, on 1..N GPUs.

Importing this package does no work: no CUDA query and no import of torch, megatron-core or
transformers (configs validate without a GPU).
"""

from __future__ import annotations

from lorafusion_megatron.__about__ import __version__

__all__ = ["__version__"]
