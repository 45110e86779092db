"""The frozen base model and one PEFT LoRA adapter per job, named after the job."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lorafusion_megatron.attention import VARLEN, register_varlen_attention, torch_varlen_available
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.presets import PRESETS

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig, PeftModel
    from transformers import PretrainedConfig, PreTrainedModel

    from lorafusion_megatron.config import BaseModelConfig, JobConfig

__all__ = [
    "attach_adapters",
    "build_base_model",
    "load_model_config",
    "lora_config",
    "lora_parameters",
    "patch_kernels",
    "quiet_peft_deprecations",
    "resolve_attn_implementation",
    "resolve_device",
    "set_active_adapters",
    "torch_dtype",
]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16`` or ``float16``)."""
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (the GPU when one is visible) as a device.

    Raises:
        TrainerError: ``cuda`` was asked for but no GPU is visible.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainerError("runtime.device is cuda but no GPU is visible: use device: auto or cpu")
    return torch.device(name)


def resolve_attn_implementation(requested: str, device: torch.device) -> str:
    """The transformers attention implementation for ``base_model.attn_implementation``.

    ``auto`` is flash-attn's kernel on a GPU when the package is installed, else PyTorch's
    variable-length attention (:mod:`lorafusion_megatron.attention`) on a GPU, else sdpa with a mask.

    Raises:
        TrainerError: ``flash_attention_2`` without a GPU or the package, or ``varlen`` on a torch without it.
    """
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        if device.type != "cuda":
            return "sdpa"
        if has_flash:
            return "flash_attention_2"
        requested = "varlen" if torch_varlen_available() else "sdpa"
    if requested == "flash_attention_2" and (device.type != "cuda" or not has_flash):
        raise TrainerError(
            "base_model.attn_implementation is flash_attention_2, which needs a GPU and the flash-attn package: "
            "use auto, varlen or sdpa"
        )
    if requested == "varlen":
        if not torch_varlen_available():
            raise TrainerError("base_model.attn_implementation is varlen, which needs PyTorch 2.9 or later: use sdpa")
        register_varlen_attention()
        return VARLEN
    return requested


def load_model_config(config: BaseModelConfig) -> PretrainedConfig:
    """The transformers config of the base model (a preset's, or the folder's ``config.json``).

    Raises:
        TrainerError: The folder does not exist or holds no readable config.
    """
    from transformers import AutoConfig

    preset = PRESETS.get(config.model_name_or_path)
    if preset is not None:
        return AutoConfig.for_model(preset.model_type, **preset.config)
    path = Path(config.model_name_or_path)
    if not (path / "config.json").is_file():
        raise TrainerError(
            f"base_model.model_name_or_path {path} is neither a preset ({', '.join(PRESETS)}) nor a folder with a "
            "config.json: download the model first (e.g. `hf download <id> --local-dir <folder>`)"
        )
    try:
        return cast("PretrainedConfig", AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as exc:
        raise TrainerError(f"cannot read the model config in {path}: {exc}") from None


def build_base_model(
    config: BaseModelConfig, *, device: torch.device, seed: int, recomputed_layers: int = 0
) -> PreTrainedModel:
    """Load (or, for a preset, build with seeded random weights) the base model, frozen, on ``device``.

    A preset's weights are :func:`~lorafusion_megatron.pipeline.weights.init_random`'s, each tensor
    drawn from its name and ``seed``: the same model as the pipeline runtime's stages build.

    Args:
        config: The base model section.
        device: Where the model runs.
        seed: Seed of a preset's random weights.
        recomputed_layers: How many decoder layers, the first ones, recompute their activations in
            the backward (see :func:`~lorafusion_megatron.pipeline.partition.recomputed_layers`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch_dtype(config.dtype)
    attn = resolve_attn_implementation(config.attn_implementation, device)
    model_config = load_model_config(config)
    if config.is_preset:
        from lorafusion_megatron.pipeline.weights import init_random

        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                model_config, dtype=dtype, attn_implementation=attn
            )
        # Each tensor from its name, as every pipeline stage draws its own: one model in both runtimes.
        init_random(model.named_parameters(), seed=seed, std=float(model_config.initializer_range))
        model.name_or_path = config.model_name_or_path
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                config.model_name_or_path, dtype=dtype, attn_implementation=attn, device_map={"": device}
            )
        except (OSError, ValueError) as exc:
            raise TrainerError(
                f"cannot load the model in {config.model_name_or_path} ({exc}); check base_model.model_name_or_path"
            ) from None
    model.requires_grad_(False)
    model.config.use_cache = False
    if recomputed_layers:
        import lorafusion_kernels
        from lorafusion_megatron.dropout_seeds import with_draws_restored

        # The recomputation runs in autograd's thread for the device, which does not see the context
        # variables of the forward: the multi-adapter routing and the dropout draws are re-entered.
        contexts = with_draws_restored(lorafusion_kernels.multi_lora_checkpoint_contexts)
        kwargs = {"use_reentrant": False, "context_fn": contexts}
        # transformers renamed gradient_* to activation_checkpointing_* (the old name warns since ~5.20).
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # Every decoder layer checks its own flag on each call: the later ones keep their activations.
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
        for layer in layers[recomputed_layers:]:
            layer.gradient_checkpointing = False
        # With a frozen embedding nothing before the first layer needs a gradient; the checkpointed
        # layers still must see an input that does, or autograd skips their LoRA weights.
        model.enable_input_require_grads()
    model.train()
    return cast("PreTrainedModel", model)


@contextlib.contextmanager
def quiet_peft_deprecations() -> Iterator[None]:
    """Silence PEFT's call of transformers' deprecated ``is_gradient_checkpointing`` (PEFT 0.21, transformers 5.x).

    Users cannot act on it, and it turns into an error under ``-W error``.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def lora_config(job: JobConfig, base_model_name_or_path: str, *, layers: Sequence[int] | None = None) -> LoraConfig:
    """The PEFT ``LoraConfig`` of ``job`` (what ``adapter_config.json`` will hold).

    Args:
        job: The job's LoRA settings.
        base_model_name_or_path: Recorded in the config.
        layers: Decoder layers that get the adapter (PEFT's ``layers_to_transform``); ``None``: all.
    """
    from peft import LoraConfig

    return LoraConfig(
        r=job.r,
        lora_alpha=job.lora_alpha,
        lora_dropout=job.lora_dropout,
        target_modules=job.target_modules,
        use_rslora=job.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
        layers_to_transform=None if layers is None else sorted(layers),
    )


def _linear_names(model: torch.nn.Module) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _all_linear_names(model: PreTrainedModel) -> list[str]:
    """What PEFT's ``all-linear`` stands for: the names of every linear layer but the output layer."""
    import torch

    output = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not output
        }
    )


def _check_targets(model: PreTrainedModel, job: JobConfig) -> None:
    if job.target_modules == "all-linear":
        return
    available = _linear_names(model)
    missing = sorted(set(job.target_modules) - available)
    if missing:
        raise TrainerError(
            f"job {job.name}: target_modules {missing} are not linear layers of the model; "
            f"it has {sorted(available)} (or use all-linear)"
        )


def attach_adapters(
    model: PreTrainedModel,
    jobs: list[JobConfig],
    *,
    seed: int,
    name_or_path: str,
    layers: Sequence[int] | None = None,
) -> PeftModel:
    """Wrap ``model`` in PEFT with one LoRA adapter per job; all adapters trainable, base frozen.

    Every ``lora_A`` tensor is drawn from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (PEFT's default
    kaiming-uniform bound) by a generator on its device seeded from ``seed``, the job and the
    tensor's name alone; every ``lora_B`` is zero (PEFT's default). So an adapter starts the same
    whether it is trained alone or with other jobs, on one process or split over pipeline stages
    (on one device type: CPU and CUDA generators draw different numbers from one seed).

    Args:
        model: The frozen base model.
        jobs: The jobs, in config order.
        seed: Base seed of the LoRA initialisation.
        name_or_path: Recorded as ``base_model_name_or_path`` in every adapter config.
        layers: Only these decoder layers get adapters (a pipeline stage's own layers, so no rank
            creates the LoRA tensors of layers it does not run); ``None``: all layers.

    Raises:
        TrainerError: A job targets a module the model lacks.
    """
    import torch
    from peft import get_peft_model

    from lorafusion_megatron.data.job_data import job_seed

    for job in jobs:
        _check_targets(model, job)
    # "all-linear" by name: PEFT's layers_to_transform refuses the string, and PEFT's own expansion
    # (full module paths in recent versions) would differ between a whole model and a stage.
    jobs = [
        job.model_copy(update={"target_modules": _all_linear_names(model)})
        if job.target_modules == "all-linear"
        else job
        for job in jobs
    ]
    peft_model: PeftModel | None = None
    with quiet_peft_deprecations():
        for job in jobs:
            # Empty LoRA tensors (on the meta device): PEFT's own initialisation, drawn on the CPU
            # and copied to the device module by module, would be overwritten below; it took about
            # 10 ms per LoRA module, tens of seconds for a pipeline stage of a 32B model with 4 jobs.
            config = lora_config(job, name_or_path, layers=layers)
            if peft_model is None:
                peft_model = get_peft_model(model, config, adapter_name=job.name, low_cpu_mem_usage=True)
            else:
                peft_model.add_adapter(job.name, config, low_cpu_mem_usage=True)
    assert peft_model is not None
    set_active_adapters(peft_model, [job.name for job in jobs])
    with torch.no_grad():
        for job in jobs:
            for name in lora_parameters(peft_model, job.name):
                module_path = name.rpartition(".")[0]  # <layer>.lora_A.<job>
                layer: Any = peft_model.get_submodule(module_path.rsplit(".", 2)[0])  # a PEFT LoraLayer
                module = peft_model.get_submodule(module_path)
                module.to_empty(device=layer.get_base_layer().weight.device)
                param = module.get_parameter("weight")
                if ".lora_A." in name:
                    generator = torch.Generator(device=param.device)
                    generator.manual_seed(job_seed(seed, job.name, f"lora-init:{name}") % 2**63)
                    bound = 1.0 / math.sqrt(param.shape[1])
                    param.uniform_(-bound, bound, generator=generator)
                else:
                    param.zero_()
                param.requires_grad_(True)
    return peft_model


def set_active_adapters(model: PeftModel, names: list[str]) -> None:
    """Make ``names`` PEFT's active adapters (PEFT also marks every other adapter frozen)."""
    from peft.tuners.tuners_utils import BaseTuner

    tuner = model.base_model
    assert isinstance(tuner, BaseTuner)
    tuner.set_adapter(names)


def lora_parameters(model: torch.nn.Module, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The trainable tensors of ``adapter``: ``{parameter name: parameter}``, in module order."""
    markers = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
    return {name: param for name, param in model.named_parameters() if any(m in name for m in markers)}


def patch_kernels(model: Any, *, siblings: bool) -> bool:
    """Route LoRA layers through ``lorafusion_kernels``; ``False`` (plain PEFT) if it cannot.

    With ``siblings``, q/k/v and gate/up also run as one call per group where the kernels offer it.
    """
    import lorafusion_kernels

    patch = getattr(lorafusion_kernels, "patch_peft_model", None)
    if patch is None or not hasattr(lorafusion_kernels, "multi_lora_batch"):
        _log.warning(
            "lorafusion-kernels %s has no multi-adapter PEFT patch: running plain PEFT, one pass per adapter segment",
            lorafusion_kernels.__version__,
        )
        return False
    patch(model)
    if siblings:
        fuse_siblings(model)
    return True


def fuse_siblings(model: Any) -> int:
    """Fuse the model's sibling LoRA layers (q/k/v, gate/up); 0 with kernels that cannot."""
    import lorafusion_kernels

    fuse = getattr(lorafusion_kernels, "fuse_sibling_layers", None)
    if fuse is None:
        _log.warning("lorafusion-kernels %s cannot fuse sibling LoRA layers", lorafusion_kernels.__version__)
        return 0
    groups = int(fuse(model))
    _log.info("sibling LoRA layers fused: %d groups", groups)
    return groups
