"""One pipeline stage of an HF decoder with one PEFT LoRA adapter per job.

The rank builds the whole ``AutoModelForCausalLM`` on the meta device (no memory, no time), turns
only its own modules into real tensors (the embedding on the first stage, its decoder layers, the
final norm and LM head on the last) and fills them from the checkpoint by name. PEFT then attaches
the adapters exactly as the single-process trainer does, to the stage's own layers only:
parameter names, and even the seeded initial LoRA weights, are those of the full model (every
``lora_A`` is drawn on its device from a generator seeded by its name,
:func:`~lorafusion_megatron.model.attach_adapters`). Adapters saved from the stages therefore
merge into one PEFT folder per job with the usual key names.

With ``runtime.fused_kernels`` (the default) every microbatch, mixed or not, runs through
``lorafusion_kernels.multi_lora_batch``: each LoRA layer routes each segment's tokens to that
segment's adapter (FusedMultiLoRA on a GPU, its plain-torch path on the CPU). Without, the layers
stay plain PEFT, which runs one adapter at a time: the stage runs each segment separately with its
adapter active and concatenates the results (samples never attend across segments, so this is the
same function), as the single-process trainer's plain path does. The forward of a stage runs the
decoder layers itself, with the same masks and rotary embeddings as the HF model's forward.
Each decoder layer reseeds the random generators before it runs (:mod:`lorafusion_megatron.dropout_seeds`),
so its dropout draws are those of the same layer and microbatch in the single-process trainer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.dropout_seeds import drawing_segment, install_dropout_seeding, with_draws_restored
from lorafusion_megatron.pipeline.partition import StageSpec, recomputed_layers

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PretrainedConfig

    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.packing import PackedBatch

__all__ = ["StageModel", "build_stage_model", "owned_modules"]


def owned_modules(spec: StageSpec) -> list[str]:
    """Module paths (in ``*ForCausalLM``) whose weights stage ``spec`` holds."""
    names = ["model.embed_tokens"] if spec.is_first else []
    names += [f"model.layers.{i}" for i in spec.layers]
    if spec.is_last:
        names += ["model.norm", "lm_head"]
    return names


@dataclass
class StageModel:
    """A stage's modules and how to run them.

    Attributes:
        spec: Which layers the stage holds.
        model: The PEFT model; modules of other stages stay on the meta device.
        config: The transformers config.
        adapters: Adapter names; index ``i`` is adapter ``i`` of the routing tables.
        attn_implementation: The attention kernel.
        dtype: Activation dtype.
        device: Where the stage computes.
        recomputed_layers: How many of the stage's decoder layers, the first ones, recompute their
            activations in the backward (the others keep them).
        fused: Route LoRA layers through ``lorafusion_kernels`` (else plain PEFT, one segment at a time).
    """

    spec: StageSpec
    model: PeftModel
    config: PretrainedConfig
    adapters: tuple[str, ...]
    attn_implementation: str
    dtype: torch.dtype
    device: torch.device
    recomputed_layers: int = 0
    fused: bool = True

    @property
    def hidden_size(self) -> int:
        """Width of the activations exchanged between stages."""
        return int(self.config.hidden_size)

    def lora_parameters(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        """This stage's trainable tensors of ``adapter`` (only its own layers carry adapters)."""
        from lorafusion_megatron.model import lora_parameters

        return lora_parameters(self.model, adapter)

    @functools.cached_property
    def _all_lora_parameters(self) -> tuple[torch.nn.Parameter, ...]:
        """Every adapter's tensors on this stage, looked up once (:meth:`_activate` runs per segment)."""
        return tuple(param for name in self.adapters for param in self.lora_parameters(name).values())

    def _attention(self, hidden: torch.Tensor, batch: PackedBatch) -> tuple[dict[str, Any], dict[str, Any]]:
        """Masks by attention type, and the keyword arguments every decoder layer gets besides its mask.

        The same as the HF model's forward makes from :func:`~lorafusion_megatron.packing.attention_inputs`:
        a 4-D mask for sdpa and eager (passed through as is), none for flash-attention and
        ``lorafusion_varlen``, which read position ids or the samples' cumulative lengths instead.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        from lorafusion_megatron.packing import attention_inputs

        extra = attention_inputs(batch, self.attn_implementation, self.dtype)
        kwargs = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": extra.pop("attention_mask", None),
            _cache_keyword(create_causal_mask): None,
            "position_ids": extra["position_ids"],
        }
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks, extra

    def forward(self, batch: PackedBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """Run the stage on one packed microbatch.

        Args:
            batch: The microbatch, on the stage's device.
            hidden: Activations ``[1, T, hidden]`` from the previous stage (``None`` on the first).

        Returns:
            Activations ``[1, T, hidden]`` for the next stage, or on the last stage the float32
            token losses ``[T]`` (0 where the target is ignored).
        """
        import torch

        import lorafusion_kernels
        from lorafusion_megatron.token_loss import causal_lm_token_losses

        causal_lm: Any = self.model.base_model.model
        if self.spec.is_first:
            hidden = causal_lm.model.embed_tokens(batch.input_ids)
        assert hidden is not None
        if self.fused:
            with lorafusion_kernels.multi_lora_batch(batch.multi_lora_routing(self.adapters), list(self.adapters)):
                hidden = self._layers(hidden, batch, lorafusion_kernels.multi_lora_checkpoint_contexts)
        else:
            parts = []
            for index, span in enumerate(batch.segments):
                self._activate(span.adapter)
                # A recomputation in the backward must see the segment's adapter active again.
                contexts = functools.partial(_recompute_with_adapter, self, span.adapter)
                rows = hidden[:, span.start : span.start + span.length]
                with drawing_segment(index):
                    parts.append(self._layers(rows, batch.segment(index), contexts))
            hidden = torch.cat(parts, dim=1)
        if not self.spec.is_last:
            return hidden
        # The LM head runs in chunks: the [T, vocab] logits never exist at once.
        return causal_lm_token_losses(causal_lm, causal_lm.model.norm(hidden), batch.targets)

    def _activate(self, adapter: str) -> None:
        """Make ``adapter`` PEFT's one active adapter (plain PEFT only), every adapter still trainable.

        PEFT freezes the inactive adapters, but a segment's backward runs after the next segments'
        forwards, and autograd accumulates no gradient into a parameter that stopped requiring it.
        """
        from lorafusion_megatron.model import set_active_adapters

        set_active_adapters(self.model, [adapter])
        for param in self._all_lora_parameters:
            param.requires_grad_(True)

    def _layers(
        self, hidden: torch.Tensor, batch: PackedBatch, checkpoint_contexts: Callable[[], tuple[Any, Any]]
    ) -> torch.Tensor:
        """The stage's decoder layers on ``hidden`` ``[1, T, hidden]`` of ``batch`` (``T`` tokens)."""
        import torch.utils.checkpoint

        # The recomputation draws the dropout of the microbatch (and segment) its forward ran.
        checkpoint_contexts = with_draws_restored(checkpoint_contexts)
        causal_lm: Any = self.model.base_model.model
        decoder = causal_lm.model
        masks, extra = self._attention(hidden, batch)
        position_embeddings = decoder.rotary_emb(hidden, position_ids=extra["position_ids"])
        layer_types = getattr(self.config, "layer_types", None)
        for i in self.spec.layers:
            layer = decoder.layers[i]
            kwargs = {
                **extra,
                "attention_mask": masks[layer_types[i] if layer_types else "full_attention"],
                "position_embeddings": position_embeddings,
            }
            if i - self.spec.start < self.recomputed_layers:
                hidden = torch.utils.checkpoint.checkpoint(
                    layer, hidden, use_reentrant=False, context_fn=checkpoint_contexts, **kwargs
                )
            else:
                hidden = layer(hidden, **kwargs)
        return hidden


@functools.cache
def _cache_keyword(mask_builder: Callable[..., Any]) -> str:
    """The name of ``mask_builder``'s KV-cache argument: ``cache`` from transformers 5.24, else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(mask_builder).parameters else "past_key_values"


@contextlib.contextmanager
def _adapter_active(stage: StageModel, adapter: str) -> Iterator[None]:
    stage._activate(adapter)
    yield


def _recompute_with_adapter(stage: StageModel, adapter: str) -> tuple[Any, Any]:
    """``torch.utils.checkpoint`` contexts: none for the forward, ``adapter`` active for the recomputation."""
    return contextlib.nullcontext(), _adapter_active(stage, adapter)


def _materialise(config: TrainerConfig, skeleton: Any, spec: StageSpec, device: torch.device) -> None:
    """Give the stage's modules real tensors: loaded from the checkpoint, or seeded random for a preset."""
    import torch

    from lorafusion_megatron.model import torch_dtype
    from lorafusion_megatron.pipeline.weights import init_random, load_weights

    dtype = torch_dtype(config.base_model.dtype)
    paths = owned_modules(spec)
    for path in paths:
        skeleton.get_submodule(path).to_empty(device=device)
    # Buffers computed at construction (the rotary frequencies) are rebuilt on the device.
    rotary = skeleton.model.rotary_emb
    with torch.device(device):
        skeleton.model.rotary_emb = type(rotary)(config=skeleton.config)
    parameters = [
        (f"{path}.{name}", param) for path in paths for name, param in skeleton.get_submodule(path).named_parameters()
    ]
    if config.base_model.is_preset:
        init_random(parameters, seed=config.runtime.seed, std=float(skeleton.config.initializer_range))
        return
    folder = Path(config.base_model.model_name_or_path)
    wanted = {name: name for name, _ in parameters}
    if "lm_head.weight" in wanted and getattr(skeleton.config, "tie_word_embeddings", False):
        from lorafusion_megatron.pipeline.weights import weight_map

        if "lm_head.weight" not in weight_map(folder):
            wanted["lm_head.weight"] = "model.embed_tokens.weight"
    tensors = load_weights(folder, wanted, device=device, dtype=dtype)
    with torch.no_grad():
        for name, param in parameters:
            param.copy_(tensors[name])


def build_stage_model(
    config: TrainerConfig, spec: StageSpec, device: torch.device, on_phase: Callable[[str], None] | None = None
) -> StageModel:
    """Build stage ``spec`` of the run's base model on ``device`` with every job's adapter.

    Args:
        config: The run (base model, jobs, seed, activation checkpointing).
        spec: The stage's layers.
        device: Where the stage computes.
        on_phase: Called with the name of each step of the build as it ends (start-up timing).

    Raises:
        TrainerError: The checkpoint lacks a tensor, or a job targets a module the model lacks.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from lorafusion_megatron.model import (
        attach_adapters,
        load_model_config,
        patch_kernels,
        resolve_attn_implementation,
        torch_dtype,
    )

    dtype = torch_dtype(config.base_model.dtype)
    attn = resolve_attn_implementation(config.base_model.attn_implementation, device)
    model_config = load_model_config(config.base_model)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            model_config, dtype=dtype, attn_implementation=attn
        )
    skeleton.name_or_path = config.base_model.model_name_or_path
    skeleton.config.use_cache = False
    mark = on_phase or (lambda _phase: None)
    mark("meta model")
    _materialise(config, skeleton, spec, device)
    mark("base weights")
    skeleton.requires_grad_(False)
    skeleton.train()
    # Adapters only on this stage's layers: no rank creates (on the CPU) the LoRA tensors of layers
    # it does not run, which took tens of seconds per rank for a 70B model with 4 adapters.
    model = attach_adapters(
        skeleton,
        config.jobs,
        seed=config.runtime.seed,
        name_or_path=config.base_model.model_name_or_path,
        layers=spec.layers,
    )
    mark("adapters")
    fused = config.runtime.fused_kernels and patch_kernels(model, siblings=config.runtime.fuse_sibling_layers)
    install_dropout_seeding({i: skeleton.model.layers[i] for i in spec.layers}, run_seed=config.runtime.seed)
    mark("kernel patch and dropout seeding")
    return StageModel(
        spec=spec,
        model=model,
        config=skeleton.config,
        adapters=tuple(job.name for job in config.jobs),
        attn_implementation=attn,
        dtype=dtype,
        device=device,
        recomputed_layers=recomputed_layers(
            model_config.to_dict(), spec.num_stages, config.runtime.activation_checkpointing
        )[spec.stage],
        fused=fused,
    )
