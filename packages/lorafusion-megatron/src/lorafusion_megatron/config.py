"""The trainer's configuration: pydantic models that a YAML file maps onto one to one.

Torch-free on purpose: ``lorafusion-megatron validate`` checks a config on a login node without
torch, CUDA or the model. Every field carries a docstring (rendered by the docs and shown next to
the default); unknown keys are errors; key names follow what LoRA users know from PEFT (``r``,
``lora_alpha``, ``lora_dropout``, ``target_modules``) and from LLaMA-Factory / axolotl / the HF
Trainer (``learning_rate``, ``num_train_epochs``, ``warmup_ratio``, ``save_steps``).

A run trains several jobs (one LoRA adapter each) on one frozen base model::

    output_dir: runs/demo
    base_model: {model_name_or_path: tiny}
    jobs:
      - name: summarise
        dataset: {path: data/summarise.jsonl}
        r: 16
        lora_alpha: 32

Top-level keys starting with ``x-`` are ignored: they hold YAML anchors that jobs merge in
(``x-lora: &lora {r: 16}`` then ``- {name: a, <<: *lora, ...}``).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lorafusion_megatron.config_overrides import set_dotted
from lorafusion_megatron.config_section import ConfigSection
from lorafusion_megatron.config_yaml import UniqueKeyLoader
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.presets import PRESETS
from lorafusion_megatron.run_layout import CHECKPOINTS, RUN_OUTPUTS
from lorafusion_sched.models import HIGHS_INT_MAX

__all__ = [
    "SYNTHETIC_DATASETS",
    "BaseModelConfig",
    "DatasetConfig",
    "JobConfig",
    "LoggingConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "TrainerConfig",
    "config_fingerprint",
    "fingerprinted_config",
    "load_config",
    "nearest_multiples",
    "parse_config",
]

SYNTHETIC_DATASETS = ("xsum", "cnndm", "wikisum", "mixed")
"""Synthetic length distributions of ``lorafusion_sched.workloads`` a job can train on."""

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")

_MAX_JOB_NAME = 100
"""The longest job name: it names files and folders (``.NAME.lorafusion-run.lock`` among them)."""

Dtype = Literal["float32", "bfloat16", "float16"]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


def nearest_multiples(value: int, multiple: int) -> str:
    """What to write instead of ``value``, which is not a multiple of ``multiple``: the one or two nearest multiples."""
    lower = value - value % multiple
    return f"use {lower} or {lower + multiple}" if lower else f"use {multiple} (or a smaller padding_multiple)"


class KeyedValueError(ValueError):
    """A check across keys that names the one to change: its error line shows ``loc``, not where pydantic ran it.

    A model validator's errors have no location of their own (pydantic reports the whole model).
    """

    def __init__(self, loc: tuple[int | str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class BaseModelConfig(ConfigSection):
    """The frozen base model that every job shares."""

    model_name_or_path: str
    """A local Hugging Face model folder (with ``config.json``), or a preset built with random
    weights: ``tiny``, ``llama-3.1-8b``, ``qwen2.5-32b``, ``llama-3.1-70b``."""

    tokenizer_name_or_path: str | None = None
    """Tokenizer folder; default: the model folder. Presets without one tokenise text as bytes."""

    dtype: Dtype = "bfloat16"
    """Dtype of the base weights and activations; LoRA weights and optimizer states stay float32."""

    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention over packed samples: ``varlen`` (PyTorch's variable-length flash attention on a GPU, no mask),
    ``flash_attention_2`` (the flash-attn package), or ``sdpa``/``eager`` with a block-diagonal mask. ``auto``:
    flash_attention_2 if installed, else varlen, on a GPU; sdpa on the CPU."""

    @property
    def is_preset(self) -> bool:
        """Whether ``model_name_or_path`` names a preset rather than a folder."""
        return self.model_name_or_path in PRESETS


class DatasetConfig(ConfigSection):
    """Where a job's samples come from: a file or folder, or a synthetic length distribution.

    The first record decides the layout: a ``messages_field`` list of chat turns is rendered with
    the tokenizer's chat template and trains on the assistant turns only; records with both
    ``prompt_field`` and ``response_field`` train on the response only (prompt tokens get label
    -100); otherwise ``text_field`` is trained on in full.
    """

    path: str | None = None
    """A ``.jsonl`` / ``.json`` file (one object per line, or one JSON array of objects), a ``.parquet``
    file, or a folder written by ``datasets.Dataset.save_to_disk``. Relative paths are relative to the
    config file."""

    synthetic: Literal["xsum", "cnndm", "wikisum", "mixed"] | None = None
    """Instead of ``path``: random tokens with lengths drawn from this synthetic workload of
    ``lorafusion_sched`` (for throughput runs; nothing to learn)."""

    num_samples: PositiveInt = 512
    """Samples to draw for a synthetic dataset (ignored with ``path``)."""

    length_scale: float = Field(default=1.0, gt=0)
    """Multiplies synthetic lengths (e.g. 0.05 for the tiny demo model); ignored with ``path``."""

    prompt_field: str = "prompt"
    """Column holding the prompt (masked from the loss)."""

    response_field: str = "response"
    """Column holding the response (trained on)."""

    text_field: str = "text"
    """Column holding a whole text (trained on in full) when there is no prompt/response pair."""

    messages_field: str = "messages"
    """Column holding a chat: a list of ``{role, content}`` turns (OpenAI style), rendered with the
    tokenizer's chat template; only ``assistant`` turns are trained on."""

    max_samples: PositiveInt | None = None
    """Use only the first ``max_samples`` records."""

    shuffle: bool = True
    """Shuffle the samples once per epoch (seeded by ``runtime.seed`` and the job name)."""

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if (self.path is None) == (self.synthetic is None):
            raise ValueError("give exactly one of `path` (a file or folder) or `synthetic` (a workload name)")
        return self


class JobConfig(ConfigSection):
    """One LoRA fine-tuning job: its data, adapter, optimizer and length of training."""

    name: str
    """Unique job name; also the PEFT adapter name and the default output folder name."""

    dataset: DatasetConfig
    """The job's training samples."""

    r: PositiveInt = 16
    """LoRA rank."""

    lora_alpha: PositiveInt = 32
    """LoRA scaling numerator: the update is scaled by ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""

    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout probability on the LoRA branch's input."""

    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (suffixes, as in PEFT) that get LoRA, e.g. ``[q_proj, v_proj]``, or ``all-linear``."""

    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by ``lora_alpha / sqrt(r)``."""

    learning_rate: float = Field(default=1e-4, gt=0)
    """Peak AdamW learning rate."""

    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW beta1."""

    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    """AdamW beta2."""

    adam_epsilon: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""

    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up: cosine or linear to zero at the last step, or constant."""

    warmup_ratio: float = Field(default=0.0, ge=0, le=1)
    """Fraction of the job's optimizer steps spent warming the learning rate up linearly from 0."""

    max_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the adapter's gradient to this global L2 norm before each step; ``null`` disables."""

    global_batch_size: PositiveInt = 16
    """Samples per optimizer step (the scheduler packs them into microbatches)."""

    num_train_epochs: PositiveInt = 1
    """Passes over the dataset (ignored when ``max_steps`` is set)."""

    max_steps: PositiveInt | None = None
    """Train for exactly this many optimizer steps, cycling through the data; overrides epochs."""

    output_dir: str | None = None
    """Where the final adapter goes; default ``<output_dir>/adapters/<name>``."""

    val_size: float | None = Field(default=None, gt=0)
    """Hold this much of ``dataset`` out of training as the job's evaluation set: a fraction below 1
    (``0.1``: 10%, rounded up) or a whole number of samples (``200``). Which samples is fixed by
    ``runtime.seed`` and the job name, so a re-run or a resume holds out the same ones. It must leave
    samples to train on (``validate`` counts the records)."""

    eval_dataset: DatasetConfig | None = None
    """Evaluate on this dataset instead of a held-out part of ``dataset`` (same formats and fields;
    its ``shuffle`` is unused)."""

    eval_steps: PositiveInt | None = None
    """Evaluate every this many of the job's optimizer steps, and after its last step; ``null``: only
    after its last step. Needs ``val_size`` or ``eval_dataset``."""

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, value: str) -> str:
        if not _JOB_NAME.match(value):
            raise ValueError(
                f"job name {value!r} must start with a letter or digit and hold only letters, digits, '_' and '-' "
                "(it names the PEFT adapter and its folder)"
            )
        if len(value) > _MAX_JOB_NAME:
            raise ValueError(
                f"job name {value[:20]}... is {len(value)} characters long: use at most {_MAX_JOB_NAME} (it names "
                "files and folders, such as the job folder's lock file, and a file system allows 255 bytes per name)"
            )
        if value in "lora_":
            raise ValueError(
                f"job name {value!r} is part of PEFT's parameter prefix 'lora_', which makes PEFT re-initialise the "
                "adapter when loading it: choose another name"
            )
        return value

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets_listed(cls, value: object) -> object:
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"write a list, e.g. [{value}] (brackets even for one module), or all-linear")
        return value

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _dataset_mapping(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            raise ValueError(f"write a mapping, e.g. {info.field_name}: {{path: {value}}}")
        return value

    @field_validator("target_modules")
    @classmethod
    def _targets_not_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("target_modules is empty: list module names such as [q_proj, v_proj], or all-linear")
        return value

    @field_validator("val_size")
    @classmethod
    def _fraction_or_count(cls, value: float | None) -> float | None:
        if value is not None and value >= 1 and not value.is_integer():
            raise ValueError(
                f"val_size = {value} is neither a fraction below 1 (0.1 holds out 10% of the samples) "
                "nor a whole number of samples"
            )
        return value

    @model_validator(mode="after")
    def _one_eval_source(self) -> JobConfig:
        if self.val_size is not None and self.eval_dataset is not None:
            raise ValueError(
                "give either `val_size` (hold out part of `dataset`) or `eval_dataset` (a separate dataset), not both"
            )
        if self.eval_steps is not None and not self.evaluates:
            raise ValueError(
                f"eval_steps = {self.eval_steps} but job {self.name!r} has no evaluation set: add `val_size` "
                "(e.g. 0.1) or `eval_dataset`, or remove eval_steps"
            )
        return self

    @property
    def evaluates(self) -> bool:
        """Whether the job has an evaluation set (``val_size`` or ``eval_dataset``)."""
        return self.val_size is not None or self.eval_dataset is not None


class SchedulerConfig(ConfigSection):
    """How ``lorafusion_sched`` packs the jobs' samples into microbatches."""

    capacity: PositiveInt | Literal["auto"] = "auto"
    """Tokens per microbatch (a multiple of ``padding_multiple``), or ``auto``: the choice of
    ``lorafusion-megatron profile`` for this output folder; ``train`` on GPUs profiles first when
    there is none yet, and on the CPU ``auto`` is 4096."""

    padding_multiple: PositiveInt = 64
    """Each adapter's segment of a microbatch is counted rounded up to this multiple."""

    long_samples: Literal["truncate", "drop"] = "truncate"
    """A sample longer than the capacity is cut to it (with a warning) or left out."""

    drop_last: bool = False
    """Leave out a job's last global batch when it is not full."""

    milp_time_limit: float | None = Field(default=0.5, gt=0)
    """Seconds per packing MILP before the greedy packing is kept. A busy host then finds fewer MILP
    answers, so two runs of one config may pack, and train, differently (``--resume`` reuses the
    checkpoint's plan: exact either way). ``null``: each solve stops at HiGHS's node limit alone:
    the same plan on every run (on the CPU, the same adapters too), planning a few times slower."""

    @model_validator(mode="after")
    def _capacity_multiple(self) -> SchedulerConfig:
        if isinstance(self.capacity, int) and self.capacity % self.padding_multiple:
            raise ValueError(
                f"capacity = {self.capacity} is not a multiple of padding_multiple = {self.padding_multiple}: "
                f"{nearest_multiples(self.capacity, self.padding_multiple)}"
            )
        return self

    @property
    def resolved_capacity(self) -> int:
        """The capacity in tokens (``auto`` resolved)."""
        if self.capacity == "auto":
            default = 4096
            return max(self.padding_multiple, default - default % self.padding_multiple)
        return self.capacity


class RuntimeConfig(ConfigSection):
    """How the microbatches execute."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: the GPU when there is one, else the CPU; ``cuda`` on a host without one: ``validate``
    warns (the run may train elsewhere), ``train`` refuses."""

    fused_kernels: bool = True
    """Run LoRA layers through ``lorafusion_kernels`` (one pass per mixed microbatch); ``false``: plain
    PEFT, one forward per adapter's segment (same result to rounding without dropout, slower; with
    ``lora_dropout > 0`` other masks)."""

    fuse_sibling_layers: bool = False
    """With ``fused_kernels``: run the LoRA layers that read one input (q/k/v, gate/up) as one call per
    group (19-43% less host time than their separate calls; LLaMa-3.1-8B on H100: the trainer at
    1.10-1.11x the frozen model with it, 1.20-1.23x without, see the trainer benchmarks). The members
    then share each token's dropout mask, as one LoRA layer on a fused qkv projection does; ``false``:
    one mask per layer, as separate PEFT layers draw (identical results with ``lora_dropout: 0``)."""

    activation_checkpointing: StrictBool | Literal["balanced", "auto"] | list[NonNegativeInt] = False
    """Recompute decoder layers' activations in the backward instead of keeping them: each recomputed
    layer keeps less memory and costs one more forward of the layer (LLaMa-3.1-8B, 8,192 tokens, H100:
    1.45 GiB and 8.6 ms per layer). ``true``: every layer; ``false``: none; a list: how many layers
    each pipeline stage recomputes, one count per stage (``[16]`` on one process: the first 16
    layers); ``balanced``: every layer, except that the pipeline stages with more work than the
    lightest one (whole layers rarely divide evenly) recompute fewer, just enough to even out the
    stages (one process: every layer); ``auto``: as few as fit the GPUs' memory at the capacity, per
    stage, chosen by ``lorafusion-megatron profile`` (which ``train`` runs first, as for
    ``scheduler.capacity: auto``; stage ``s`` of ``S`` holds up to ``S - s`` microbatches); every
    layer while there is no profile (the CPU). May change on ``--resume`` (the adapters come out the same)."""

    seed: int = Field(default=0, ge=0, le=HIGHS_INT_MAX)
    """Seed for LoRA initialisation, dropout, shuffling, synthetic data and the scheduler's MILP solver
    (whose seed is a 32-bit signed integer: at most 2,147,483,647)."""

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_setting(cls, value: Any) -> Any:
        counts = isinstance(value, list) and all(type(c) is int and c >= 0 for c in value)
        if isinstance(value, bool) or value in ("balanced", "auto") or (counts and value):
            return value
        yaml_11 = isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n")
        raise ValueError(
            "give true, false, balanced, auto, or a list with one count of recomputed layers per pipeline "
            "stage (e.g. [20, 18])"
            + (f"; {value} is text in a config file (YAML 1.2): write true or false" if yaml_11 else "")
        )


class LoggingConfig(ConfigSection):
    """What the run reports while training."""

    logging_steps: PositiveInt = 10
    """Log each job's loss, learning rate and gradient norm (and write its TensorBoard scalars) every this
    many of its optimizer steps, and at its last step."""

    tensorboard_dir: str | None = None
    """TensorBoard event folder (one sub-folder per job); ``null``: no TensorBoard. Needs
    ``pip install "lorafusion-megatron[tensorboard]"``; without it ``validate`` and ``train`` warn and
    the run goes on without scalars."""

    progress_bar: bool = True
    """Show a rich progress bar with per-job loss and tokens/s."""


class TrainerConfig(ConfigSection):
    """A whole run: one base model, several jobs, and how to schedule, execute, log and save."""

    output_dir: str
    """Run folder: checkpoints, the plan, the summary and (by default) the adapters."""

    base_model: BaseModelConfig
    """The frozen model the jobs share."""

    jobs: list[JobConfig] = Field(min_length=1)
    """The LoRA jobs trained together (names must be unique)."""

    scheduler: SchedulerConfig = SchedulerConfig()
    """Microbatch packing."""

    runtime: RuntimeConfig = RuntimeConfig()
    """Execution."""

    logging: LoggingConfig = LoggingConfig()
    """Progress and TensorBoard."""

    parallel: ParallelConfig = ParallelConfig()
    """Pipeline stages, data-parallel replicas and schedule; default: one process."""

    save_steps: PositiveInt | None = None
    """Write a checkpoint after every this many optimizer steps, counted over all jobs together
    (with 4 jobs, ``save_steps: 40`` saves about every 10 steps of each); ``null``: none (Ctrl-C
    still writes one; a finished run writes its adapters, not a last checkpoint)."""

    save_total_limit: PositiveInt | None = 2
    """Keep only the newest this many checkpoints; ``null`` keeps all."""

    @field_validator("jobs")
    @classmethod
    def _unique_names(cls, jobs: list[JobConfig]) -> list[JobConfig]:
        seen: set[str] = set()
        for index, job in enumerate(jobs):
            if job.name in seen:
                raise KeyedValueError(
                    ("jobs", index, "name"), f"job name {job.name!r} appears twice: give every job its own name"
                )
            seen.add(job.name)
        return jobs

    @model_validator(mode="after")
    def _evaluation_on_one_process(self) -> TrainerConfig:
        self.check_evaluation_supported(self.parallel)
        return self

    def check_evaluation_supported(self, parallel: ParallelConfig, *, under_torchrun: bool = False) -> None:
        """Refuse evaluation on a run that ``parallel`` hands to the pipeline runtime (it cannot evaluate yet).

        Args:
            parallel: The parallelism the run will use (the config's, or after command-line flags).
            under_torchrun: The run joins an external ``torchrun``, which always takes the pipeline
                runtime, even with one process.

        Raises:
            TrainerError: Some job has ``val_size`` or ``eval_dataset`` and ``parallel`` is not one
                process running the ``lorafusion`` schedule.
        """
        evaluating = [job.name for job in self.jobs if job.evaluates]
        if not evaluating:
            return
        reasons = []
        if parallel.pipeline_stages > 1:
            reasons.append(f"parallel.pipeline_stages = {parallel.pipeline_stages}")
        if parallel.data_parallel > 1:
            reasons.append(f"parallel.data_parallel = {parallel.data_parallel}")
        if parallel.schedule != "lorafusion":
            reasons.append(f"parallel.schedule = {parallel.schedule}")
        if under_torchrun:
            reasons.append("a launch under torchrun")
        if reasons:
            raise TrainerError(
                f"job(s) {', '.join(evaluating)} evaluate (val_size / eval_dataset), but {' and '.join(reasons)} "
                "runs on the pipeline runtime, which does not evaluate yet: train on one process "
                "(pipeline_stages: 1, data_parallel: 1, schedule: lorafusion), or remove val_size, eval_dataset "
                "and eval_steps from those jobs"
            )

    @field_validator("base_model", mode="before")
    @classmethod
    def _model_mapping(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError(f"write a mapping, e.g. base_model: {{model_name_or_path: {value}}}")
        return value

    @model_validator(mode="after")
    def _distinct_outputs(self) -> TrainerConfig:
        """A job's adapter folder is replaced whole at the end: it must hold nothing else the run reads or writes.

        Nor be, or lie inside, one of the files and folders the run writes in ``output_dir``
        (:data:`~lorafusion_megatron.run_layout.RUN_OUTPUTS`). And ``output_dir`` must not be, or lie
        inside, a folder the run reads (the model, the tokenizer, a dataset saved as a folder).
        """

        def place(path: str | Path) -> Path:
            return Path(os.path.abspath(path))

        def holds(folder: Path, path: Path) -> bool:
            return folder == path or folder in path.parents

        run = place(self.output_dir)
        reads = [("the base model", self.base_model.model_name_or_path)] if not self.base_model.is_preset else []
        if self.base_model.tokenizer_name_or_path is not None:
            reads.append(("the tokenizer", self.base_model.tokenizer_name_or_path))
        for job in self.jobs:
            for what, dataset in (("dataset", job.dataset), ("eval_dataset", job.eval_dataset)):
                if dataset is not None and dataset.path is not None:
                    reads.append((f"job {job.name!r}'s {what}", dataset.path))
        for what, path in reads:
            if holds(place(path), run):
                raise KeyedValueError(
                    ("output_dir",),
                    f"{run} is, or lies inside, {what} ({place(path)}): the run would write its plan, summary, "
                    "checkpoints and adapters there; give the run a folder of its own",
                )
        inputs = reads.copy()
        if self.logging.tensorboard_dir is not None:
            inputs.append(("logging.tensorboard_dir", self.logging.tensorboard_dir))
        seen: dict[Path, str] = {}
        for index, job in enumerate(self.jobs):
            folder = place(self.job_output_dir(job))
            key = ("jobs", index, "output_dir")
            own = f"job {job.name!r} writes its adapter to {folder}, replacing that folder when it ends"
            if holds(folder, run):
                raise KeyedValueError(key, f"{own}, and it holds output_dir {run}: give the job a folder of its own")
            for name in RUN_OUTPUTS:
                if holds(run / name, folder):
                    raise KeyedValueError(
                        key,
                        f"{own}, but the run writes its own {name} there (in output_dir): give the job a folder "
                        f"of its own, e.g. the default {run / 'adapters' / job.name}",
                    )
            for what, path in inputs:
                if holds(folder, place(path)):
                    raise KeyedValueError(
                        key, f"{own}, and it holds {what} ({place(path)}): give the job a folder of its own"
                    )
            for other, name in seen.items():
                if other == folder:
                    raise KeyedValueError(key, f"jobs {name!r} and {job.name!r} both write their adapter to {folder}")
                if holds(other, folder) or holds(folder, other):
                    raise KeyedValueError(
                        key,
                        f"jobs {name!r} and {job.name!r} write their adapters to {other} and {folder}, "
                        "one inside the other: give each a folder of its own",
                    )
            seen[folder] = job.name
        return self

    def job_output_dir(self, job: JobConfig) -> Path:
        """Where ``job``'s final adapter is written."""
        return Path(job.output_dir) if job.output_dir is not None else Path(self.output_dir) / "adapters" / job.name

    @property
    def checkpoint_dir(self) -> Path:
        """Folder holding ``checkpoint-<n>`` sub-folders."""
        return Path(self.output_dir) / CHECKPOINTS


def fingerprinted_config(config: TrainerConfig) -> dict[str, Any]:
    """Everything in ``config`` that decides the trained weights, as JSON data (what a resume must match).

    Logging, checkpoint and evaluation cadence, evaluation datasets, output folders and the collective
    timeout are left out: they may change between a run and its resume without changing the result.
    ``val_size`` stays in: it decides which samples are trained on. Checkpoints store this data beside
    its hash (:func:`config_fingerprint`), so a refused resume can name the keys that changed.
    """
    data = config.model_dump(mode="json", exclude={"logging": True, "save_steps": True, "save_total_limit": True})
    data["parallel"] = config.parallel.layout_settings()
    data.pop("output_dir")
    for job in data["jobs"]:
        for key in ("output_dir", "eval_dataset", "eval_steps"):
            job.pop(key)
    return data


def config_fingerprint(config: TrainerConfig) -> str:
    """16 hex digits of the sha256 of :func:`fingerprinted_config` (compact JSON, sorted keys)."""
    blob = json.dumps(fingerprinted_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "<top level>"


def _known_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the model found at ``loc`` (for "did you mean" hints)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        nested = [a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        current = nested[0] if nested else None
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


_OTHER_TRAINERS_NAMES = {
    "lr": "learning_rate",
    "rank": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "batch_size": "global_batch_size",
    "epochs": "num_train_epochs",
    "steps": "max_steps",
    "model": "model_name_or_path",
}
"""Keys that other trainers' configs use for a key of ours (a spelling match would mislead: ``lr`` ~ ``r``)."""


def _field_location(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` without the union branches pydantic appends to it (``capacity.literal['auto']`` -> ``capacity``).

    A string after the walk has left the config's models (a leaf field) names a branch of the
    field's type, not a key; list indices stay.
    """
    current: Any = TrainerConfig
    kept: list[int | str] = []
    for part in loc:
        if isinstance(part, int):
            kept.append(part)
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue  # a branch of a leaf field's union type
        kept.append(part)
        field = current.model_fields.get(part)
        args = getattr(field.annotation, "__args__", ()) if field is not None else ()
        annotation = field.annotation if field is not None else None
        nested = [a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        current = nested[0] if nested else None
    return tuple(kept)


def _format_error(error: Any) -> str:
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        known = _known_keys(TrainerConfig, loc[:-1])
        alias = _OTHER_TRAINERS_NAMES.get(str(loc[-1]))
        hint = [alias] if alias in known else difflib.get_close_matches(str(loc[-1]), known, n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(known)}"
        return f"{_location(loc)}: unknown key{suggestion}"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{_location(loc)}: required key is missing"
    if isinstance(error["input"], dict | list):  # a section's own check: its message names the keys
        return f"{_location(loc)}: {message}"
    value = error["input"]
    if error["type"] == "string_type" and (value is None or isinstance(value, bool | int | float)):
        # YAML read the text as a number (007 is 7), a boolean or null: quotes keep it as written.
        return (
            f"{_location(loc)}: {message} (got {value!r}); put it in quotes to keep it as written (YAML reads 007 as 7)"
        )
    return f"{_location(loc)}: {message} (got {value!r})"


def _error_lines(errors: list[Any]) -> list[str]:
    """One line per problem: the errors of a union field's branches merged into one ("... or ...")."""
    merged: dict[tuple[int | str, ...], list[Any]] = {}
    for error in errors:
        raised = error.get("ctx", {}).get("error")
        if isinstance(raised, KeyedValueError):
            location = raised.loc
        elif error["type"] == "extra_forbidden":
            location = tuple(error["loc"])
        else:
            location = _field_location(tuple(error["loc"]))
        merged.setdefault(location, []).append({**error, "loc": location})
    lines = []
    for branches in merged.values():
        if len(branches) == 1:
            lines.append(_format_error(branches[0]))
            continue
        messages = list(dict.fromkeys(str(e["msg"]).removeprefix("Value error, ") for e in branches))
        alternatives = [messages[0], *(m.removeprefix("Input should ") for m in messages[1:])]
        first = branches[0]
        lines.append(f"{_location(first['loc'])}: {', or '.join(alternatives)} (got {first['input']!r})")
    return lines


def parse_config(data: Any, *, source: str = "config") -> TrainerConfig:
    """Validate a mapping (the parsed YAML) into a :class:`TrainerConfig`.

    Args:
        data: The parsed document.
        source: Name used in error messages (usually the file path).

    Returns:
        The validated config.

    Raises:
        TrainerError: Listing every problem, each naming its key (``jobs.1.r``) and the value.
    """
    if not isinstance(data, dict):
        raise TrainerError(f"{source}: expected a mapping of keys (output_dir, base_model, jobs, ...), got {data!r}")
    # Top-level `x-...` keys only hold YAML anchors for jobs to share (as in docker-compose files).
    data = {key: value for key, value in data.items() if not (isinstance(key, str) and key.startswith("x-"))}
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as exc:
        lines = _error_lines(exc.errors())
        listed = "\n".join(f"  - {line}" for line in lines)
        raise TrainerError(f"{source} has {len(lines)} problem(s):\n{listed}") from None


def _resolve_relative(config: TrainerConfig, base: Path) -> TrainerConfig:
    """Make relative paths relative to the config file's folder rather than the working directory.

    They become absolute, so that what the run records (e.g. an adapter's ``base_model_name_or_path``)
    still names the same folder when read from another working directory.
    """

    def resolve(value: str | None) -> str | None:
        if value is None or Path(value).is_absolute():
            return value
        return os.path.abspath(base / value)

    model = config.base_model
    if not model.is_preset:
        model = model.model_copy(update={"model_name_or_path": resolve(model.model_name_or_path)})
    model = model.model_copy(update={"tokenizer_name_or_path": resolve(model.tokenizer_name_or_path)})

    def resolve_dataset(dataset: DatasetConfig | None) -> DatasetConfig | None:
        return None if dataset is None else dataset.model_copy(update={"path": resolve(dataset.path)})

    jobs = [
        job.model_copy(
            update={
                "dataset": resolve_dataset(job.dataset),
                "eval_dataset": resolve_dataset(job.eval_dataset),
                "output_dir": resolve(job.output_dir),
            }
        )
        for job in config.jobs
    ]
    logging = config.logging.model_copy(update={"tensorboard_dir": resolve(config.logging.tensorboard_dir)})
    return config.model_copy(
        update={"base_model": model, "jobs": jobs, "logging": logging, "output_dir": resolve(config.output_dir)}
    )


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainerConfig:
    """Read and validate a YAML config file.

    Relative paths inside the file (datasets, model folder, output folders) are resolved against the
    file's folder, so a config runs the same from any working directory.

    Args:
        path: The YAML file.
        overrides: Dotted keys to set before validation, e.g. ``{"output_dir": "runs/x"}``.

    Returns:
        The validated config.

    Raises:
        TrainerError: The file is missing or not YAML, or a key is unknown, missing or invalid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TrainerError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TrainerError(
            f"config {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass
    except TrainerError as exc:
        raise TrainerError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise TrainerError(f"{path} is not valid YAML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value, source=str(path))
    source = f"{path} with --set {', '.join(overrides)}" if overrides else str(path)
    return _resolve_relative(parse_config(data, source=source), path.parent)
