"""A stage's frozen base weights: read by name from a local checkpoint, or seeded random for presets.

Only the tensors of the stage's own modules are read (``safetensors`` opens the files lazily and
reads each requested tensor alone), so a rank of a 70B model never holds more than its stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    import torch

__all__ = ["init_random", "load_weights", "weight_map"]


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file name of a checkpoint folder (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {str(k): str(v) for k, v in mapping.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single.name)
    raise TrainerError(
        f"{folder} holds no model.safetensors (or index): the pipeline runtime reads safetensors checkpoints only; "
        "re-save the model with save_pretrained(safe_serialization=True)"
    )


def load_weights(
    folder: Path, wanted: dict[str, str], *, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Read the named tensors of a checkpoint folder.

    Args:
        folder: A Hugging Face model folder.
        wanted: Name in the result -> name in the checkpoint (several may share a checkpoint tensor,
            e.g. a tied LM head).
        device: Where the tensors go.
        dtype: Floating-point tensors are cast to it.

    Returns:
        The tensors, by result name.

    Raises:
        TrainerError: A tensor is missing from the checkpoint.
    """
    from safetensors import safe_open

    files = weight_map(folder)
    missing = sorted({source for source in wanted.values() if source not in files})
    if missing:
        raise TrainerError(f"the checkpoint in {folder} lacks {len(missing)} tensor(s) of this stage: {missing[:5]}")
    by_file: dict[str, list[str]] = {}
    for source in sorted(set(wanted.values())):
        by_file.setdefault(files[source], []).append(source)
    loaded = {}
    for file, sources in by_file.items():
        with safe_open(str(folder / file), framework="pt", device=str(device)) as handle:
            for source in sources:
                tensor = handle.get_tensor(source)
                loaded[source] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return {name: loaded[source] for name, source in wanted.items()}


def init_random(parameters: Iterable[tuple[str, torch.nn.Parameter]], *, seed: int, std: float) -> None:
    """Seeded random base weights, each tensor from its own name, so any partition gives the same model.

    Matrices get ``N(0, std)`` (transformers' ``initializer_range``), norm weights ones, biases zeros.
    Each tensor is drawn in place where it lives, in its own dtype, by a generator on its device
    seeded from the tensor's name alone: on a GPU no weight passes through host memory, so filling
    a 35 GB stage of a 70B preset is 17.5 G bf16 values written by the GPU (estimated well under a
    second; not yet timed) rather than minutes of CPU sampling and copying. CPU and CUDA generators
    draw different numbers from one seed, so the weights are identical across partitions on one
    device type, not between a CPU and a GPU run.

    Args:
        parameters: ``(name in the full model, parameter)`` pairs, already on their device.
        seed: The run's seed (``runtime.seed``).
        std: Standard deviation of the matrices.
    """
    import torch

    from lorafusion_megatron.data.job_data import job_seed

    with torch.no_grad():
        for name, param in parameters:
            if param.dim() >= 2:
                generator = torch.Generator(device=param.device).manual_seed(job_seed(seed, name, "base") % 2**63)
                param.normal_(0.0, std, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
