"""Triton FusedLoRA and FusedMultiLoRA ops for LoRA fine-tuning (forward and backward).

Importing this package does no work: no CUDA query, no allocation, no autotuning.
"""

from __future__ import annotations

from lorafusion_kernels.__about__ import __version__
from lorafusion_kernels.errors import LoRAFusionKernelsError, LoRAFusionKernelsWarning
from lorafusion_kernels.lora import FusedLoRALinear, fused_lora_linear
from lorafusion_kernels.metadata import MultiLoRABatch
from lorafusion_kernels.multi_lora import fused_multi_lora_linear
from lorafusion_kernels.multi_lora_context import (
    multi_lora_batch,
    multi_lora_checkpoint_contexts,
    routed_checkpoint_function,
)
from lorafusion_kernels.multi_lora_siblings import fused_multi_lora_siblings
from lorafusion_kernels.peft_integration import patch_peft_model, unpatch_peft_model
from lorafusion_kernels.peft_siblings import fuse_sibling_layers, unfuse_sibling_layers

__all__ = [
    "FusedLoRALinear",
    "LoRAFusionKernelsError",
    "LoRAFusionKernelsWarning",
    "MultiLoRABatch",
    "__version__",
    "fuse_sibling_layers",
    "fused_lora_linear",
    "fused_multi_lora_linear",
    "fused_multi_lora_siblings",
    "multi_lora_batch",
    "multi_lora_checkpoint_contexts",
    "patch_peft_model",
    "routed_checkpoint_function",
    "unfuse_sibling_layers",
    "unpatch_peft_model",
]
