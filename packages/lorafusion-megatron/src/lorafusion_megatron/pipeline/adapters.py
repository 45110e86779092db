"""Write each job's adapter from the stages into one PEFT folder (as the single-process trainer does).

Every stage holds its own layers' LoRA tensors under the full model's names; the first stage of
replica 0 gathers the other stages' tensors over the pipeline group and writes
``adapter_model.safetensors`` and ``adapter_config.json`` exactly as ``PeftModel.save_pretrained``
lays them out (keys without the adapter name), atomically replacing an older folder. Replicas hold
identical adapters, so the others write nothing.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.adapters_io import replace_adapter, sort_target_modules
from lorafusion_megatron.write_errors import clear_write_errors

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["gather_adapters", "stage_adapter_tensors", "write_adapter"]


def stage_adapter_tensors(model: PeftModel, adapter: str) -> dict[str, torch.Tensor]:
    """This stage's tensors of ``adapter`` under PEFT's saved key names, copied to the CPU."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def gather_adapters(model: PeftModel, adapters: list[str], layout: Layout) -> dict[str, dict[str, torch.Tensor]] | None:
    """Every adapter's tensors from all stages, on the first stage (``None`` on the other ranks).

    Collective over the pipeline group: every stage of every replica must call it.
    """
    import torch.distributed as dist

    local = {adapter: stage_adapter_tensors(model, adapter) for adapter in adapters}
    if layout.num_stages == 1:
        return local
    pieces: list[object] | None = [None] * layout.num_stages if layout.is_first else None
    first_rank = dist.get_global_rank(layout.pipeline_group, 0)
    dist.gather_object(local, pieces, dst=first_rank, group=layout.pipeline_group)
    if pieces is None:
        return None
    merged: dict[str, dict[str, torch.Tensor]] = {adapter: {} for adapter in adapters}
    for piece in pieces:
        assert isinstance(piece, dict)
        for adapter, tensors in piece.items():
            merged[adapter].update(tensors)
    return merged


def write_adapter(model: PeftModel, adapter: str, tensors: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Write one adapter's folder: the PEFT config and the merged tensors (atomically replaced).

    Raises:
        CannotWriteError: A full disk or a read-only file system (the folder keeps what it held).
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    with clear_write_errors(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.tmp-") as tmp:
            written = Path(tmp) / "adapter"
            written.mkdir()
            config = copy.deepcopy(model.peft_config[adapter])
            assert isinstance(config, LoraConfig)
            config.inference_mode = True
            config.layers_to_transform = None  # this stage's layers; the saved adapter covers all of them
            config.save_pretrained(str(written))
            sort_target_modules(written / "adapter_config.json")
            ordered = {key: tensors[key].contiguous() for key in sorted(tensors)}
            save_file(ordered, str(written / "adapter_model.safetensors"), metadata={"format": "pt"})
            replace_adapter(written, directory, adapter)
