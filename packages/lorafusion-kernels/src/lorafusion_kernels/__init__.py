"""Triton FusedLoRA and FusedMultiLoRA ops for LoRA fine-tuning (forward and backward).

Importing this package does no work: no CUDA query, no allocation, no autotuning.
"""

from __future__ import annotations

from lorafusion_kernels.__about__ import __version__

__all__ = ["__version__"]
