"""Pydantic models at the package boundary: the jobs and options going in, the plan coming out.

Everything inside the planner works on plain tuples and numpy arrays; only these models cross the
public API and the JSON files. All are frozen and refuse unknown fields, and every validation error
names the field and the offending value. Each field takes what its type in the JSON schema takes:
whole numbers (:data:`WholeNumber`), numbers (``StrictFloat``: ints and floats) and booleans
(``StrictBool``), never their text (``"4096"``, ``"0.5"``, ``"true"``).
"""

from __future__ import annotations

import bisect
import itertools
import operator
import unicodedata
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lorafusion_sched.__about__ import __version__
from lorafusion_sched.errors import UnknownNameError

__all__ = [
    "MAX_PIPELINE_STAGES",
    "SCHEMA_VERSION",
    "AdapterInfo",
    "AdapterJob",
    "CostModel",
    "Microbatch",
    "Plan",
    "PlanOptions",
    "PlanStats",
    "RunStats",
    "RuntimeSettings",
    "Segment",
    "SimulationResult",
    "Violation",
    "require_model",
    "whole_number",
]

SCHEMA_VERSION = 1
"""Version of the plan JSON document; bumped on any incompatible change."""

HIGHS_INT_MAX = 2**31 - 1
"""The largest value of an integer HiGHS option (``random_seed``, ``mip_max_nodes``)."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def whole_number(value: object, place: str) -> int:
    """``value`` as an ``int``, or a ``ValueError`` that names ``place`` and the value.

    Takes what the JSON schema's ``integer`` takes: integers, and floats with no fractional part
    (``4096.0``, which JSON Schema counts as an integer). What pydantic's lax mode would also take
    is refused: strings (``"4096"``), fractional floats and booleans (``True`` would be 1). Integer
    types of other libraries (``numpy.int64``) are converted through ``__index__``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{place} = {value}: give a whole number, not a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            hint = f" ({int(value)})"
        except ValueError:
            hint = ""
        raise ValueError(f"{place} = {value!r}: give a whole number{hint}, not a string")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(f"{place} = {value!r}: give a whole number, not a fraction")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{place} = {value!r}: give a whole number, not a {type(value).__name__}") from None


def _check_whole_number(value: object, info: ValidationInfo) -> object:
    """A ``before`` validator for a whole-number field; ``None`` passes on to the field's own type."""
    return value if value is None else whole_number(value, str(info.field_name))


def _check_whole_numbers(value: object, info: ValidationInfo) -> object:
    """A ``before`` validator for a tuple of whole numbers; each error names the item's index.

    A string or mapping passes on unchanged for pydantic to refuse as a tuple.
    """
    if isinstance(value, str | bytes | dict) or not isinstance(value, Iterable):
        return value
    return [whole_number(item, f"{info.field_name}[{i}]") for i, item in enumerate(value)]


def require_model(value: object, model: type[BaseModel], name: str) -> None:
    """Raise a ``TypeError`` that says how to build a ``model`` when ``value`` is not one.

    The public functions call it on their arguments, so that a dict (e.g. a plan from ``json.load``)
    or a lone job is refused at the call, not deep inside the planner.
    """
    if not isinstance(value, model):
        raise TypeError(
            f"{name} has type {type(value).__name__}, not {model.__name__}: build one with {model.__name__}(...) "
            f"or, from a dict, {model.__name__}.model_validate(...)"
        )


WholeNumber = Annotated[int, BeforeValidator(_check_whole_number)]
"""An ``int`` field that takes no strings, fractions or booleans (JSON schema ``integer``)."""

OptionalWholeNumber = Annotated[int | None, BeforeValidator(_check_whole_number)]
"""A :data:`WholeNumber` or ``None``."""

WholeNumbers = Annotated[tuple[int, ...], BeforeValidator(_check_whole_numbers)]
"""A tuple of :data:`WholeNumber` (a list is fine in Python and JSON)."""

PositiveWholeNumbers = Annotated[tuple[Annotated[int, Field(ge=1)], ...], BeforeValidator(_check_whole_numbers)]
""":data:`WholeNumbers`, each at least 1."""

_LINE_BREAKING = frozenset({"Cc", "Zl", "Zp"})
"""Unicode categories refused in adapter names: control characters and line or paragraph separators."""


def _check_adapter_name(value: str) -> str:
    """An ``after`` validator: a name that prints as itself on one line of a table or message.

    Refused: a name of only whitespace, whitespace around it (``"a "`` would pass for ``"a"`` in a
    table), control characters or line separators (a newline breaks the CLI's tables), a name of
    zero-width characters only, and one not in Unicode's composed form (``"e\u0301"`` prints as
    ``"é"``, another name).
    """
    if not value.strip():
        raise ValueError(f"name = {value!r}: give a name with at least one character that is not whitespace")
    if value != value.strip():
        raise ValueError(f"name = {value!r}: remove the whitespace at its start or end ({value.strip()!r})")
    bad = next((c for c in value if unicodedata.category(c) in _LINE_BREAKING), None)
    if bad is not None:
        raise ValueError(
            f"name = {value!r}: remove the control character {bad!r} (U+{ord(bad):04X}); a name is shown on one "
            f"line in tables and messages"
        )
    if all(unicodedata.category(c) == "Cf" for c in value):  # zero-width characters only: prints as nothing
        raise ValueError(f"name = {value!r}: give a name with a visible character")
    if unicodedata.normalize("NFC", value) != value:  # "e" + U+0301 prints as "é" (U+00E9), another name
        composed = unicodedata.normalize("NFC", value)
        raise ValueError(
            f"name = {value!a}: write it in Unicode's composed form (NFC), {composed!a}; it prints as "
            f"{composed!r}, which is another name"
        )
    return value


AdapterName = Annotated[str, Field(min_length=1), AfterValidator(_check_adapter_name)]
"""An adapter's name: not empty, no whitespace at either end, no control characters."""


class AdapterJob(BaseModel):
    """One LoRA fine-tuning job: its samples' token lengths and its global batch size.

    Global batch ``g`` of the job is its samples ``[g * global_batch_size, (g + 1) * global_batch_size)``
    in the given order; the scheduler reorders samples only inside a global batch.
    """

    model_config = _FROZEN

    name: AdapterName = Field(
        description="Unique adapter name; the plan refers to the job by it. No whitespace at either end, no "
        "control characters."
    )
    sample_tokens: WholeNumbers = Field(description="Token count of every sample, in training order.")
    global_batch_size: WholeNumber = Field(description="Samples per optimizer step of this adapter.")

    @field_validator("sample_tokens")
    @classmethod
    def _lengths_positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value:
            raise ValueError("sample_tokens is empty: give at least one sample length")
        bad = [(i, t) for i, t in enumerate(value) if t < 1]
        if bad:
            i, t = bad[0]
            raise ValueError(f"sample_tokens[{i}] = {t}: every sample needs at least one token")
        return value

    @field_validator("global_batch_size")
    @classmethod
    def _gbs_positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"global_batch_size = {value}: it must be at least 1")
        return value


class CostModel(BaseModel):
    """Seconds per stage for a microbatch of ``n`` padded tokens: ``fixed + per_token * n`` forward.

    Or, with ``forward_points`` (measured ``(tokens, seconds)`` pairs, e.g. a profile's), the forward
    interpolated between them: linear between two points, the first point's seconds below it (a
    smaller microbatch is taken to be no faster than the smallest measured), and in proportion to the
    tokens past the last. A line cannot follow a stage that the host's kernel launches bound below
    some size and the GPU above it (flat, then steep); a plan made for such a line misjudges which
    microbatch sizes pay. The line's two fields are then not used.

    The backward takes ``backward_factor`` times the forward. ``stage_factors`` scales each stage
    (e.g. a last stage that also runs the LM head). A no-op costs nothing but keeps its slot. The
    defaults are illustrative; only ratios matter for bubble ratios and speedups.
    """

    model_config = _FROZEN

    forward_fixed_s: StrictFloat = Field(default=2e-3, ge=0, allow_inf_nan=False)
    forward_per_token_s: StrictFloat = Field(default=2e-5, ge=0, allow_inf_nan=False)
    backward_factor: StrictFloat = Field(default=2.0, gt=0, allow_inf_nan=False)
    stage_factors: tuple[Annotated[StrictFloat, Field(allow_inf_nan=False)], ...] | None = Field(
        default=None, description="One positive factor per stage."
    )
    forward_points: tuple[tuple[WholeNumber, Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]], ...] | None = (
        Field(
            default=None,
            description=(
                "Measured forward seconds at padded token counts, as (tokens, seconds) pairs by rising tokens; "
                "when given, they replace the line (forward_fixed_s, forward_per_token_s)."
            ),
        )
    )

    @field_validator("forward_points")
    @classmethod
    def _rising_points(cls, value: tuple[tuple[int, float], ...] | None) -> tuple[tuple[int, float], ...] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("no points: give at least one (tokens, seconds) pair, or leave forward_points out")
        for (before, _), (tokens, _) in itertools.pairwise(value):
            if tokens <= before:
                raise ValueError(f"{tokens} tokens follows {before}: list the points by rising tokens")
        if value[0][0] < 1:
            raise ValueError(f"{value[0][0]} tokens: a measured microbatch holds at least 1 token")
        return value

    @field_validator("stage_factors")
    @classmethod
    def _positive_factors(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if value is not None and (not value or min(value) <= 0):
            raise ValueError(f"stage_factors = {value}: give one positive factor per pipeline stage")
        return value

    @model_validator(mode="after")
    def _forward_takes_time(self) -> CostModel:
        if self.forward_points is None and self.forward_fixed_s == 0 and self.forward_per_token_s == 0:
            raise ValueError(
                "forward_fixed_s = forward_per_token_s = 0: a forward that takes no time leaves nothing to "
                "simulate; give either a positive value"
            )
        return self

    def forward_seconds(self, padded_tokens: int, stage: int) -> float:
        """Forward seconds of one microbatch on ``stage`` (0 for a no-op)."""
        factor = self.stage_factors[stage] if self.stage_factors else 1.0
        return factor * self.unscaled_forward_seconds(padded_tokens)

    def unscaled_forward_seconds(self, padded_tokens: int) -> float:
        """Forward seconds of one microbatch before its stage's factor (0 for a no-op).

        The simulator computes it once per microbatch and scales it for each stage.
        """
        if padded_tokens == 0:
            return 0.0
        points = self.forward_points
        if points is None:
            return self.forward_fixed_s + self.forward_per_token_s * padded_tokens
        j = bisect.bisect_left(points, padded_tokens, key=operator.itemgetter(0))
        if j == 0:
            return points[0][1]
        if j == len(points):
            tokens, seconds = points[-1]
            return seconds * padded_tokens / tokens
        (x0, y0), (x1, y1) = points[j - 1], points[j]
        return y0 + (y1 - y0) * (padded_tokens - x0) / (x1 - x0)


MAX_PIPELINE_STAGES = 1024
"""The most pipeline stages :class:`PlanOptions` takes (a typo's 40,000 would plan millions of no-ops)."""


class PlanOptions(BaseModel):
    """How to plan: microbatch capacity, pipeline shape, padding, and the solver's limits."""

    model_config = _FROZEN

    capacity: WholeNumber = Field(description="Token capacity of one microbatch, padding included.")
    pipeline_stages: WholeNumber = Field(
        default=1, description="Pipeline stages S: the bubble lemma needs S-1 others between."
    )
    padding_multiple: WholeNumber = Field(
        default=1, description="Each adapter's segment is padded up to a multiple of this."
    )
    data_parallel: WholeNumber = Field(
        default=1, description="Data-parallel replicas d; microbatches go round-robin to them."
    )
    drop_last: StrictBool = Field(default=False, description="Drop an adapter's last global batch when it is partial.")
    truncate: StrictBool = Field(
        default=False, description="Cut samples longer than the capacity to it instead of refusing them."
    )
    use_milp: StrictBool = Field(default=True, description="Try the two-stage MILP where greedy misses a bound.")
    merge: StrictBool = Field(default=True, description="Run the merge pass across consecutive global batches.")
    neighbourhood: OptionalWholeNumber = Field(
        default=3, ge=1, description="Least-filled greedy microbatches the MILP re-packs; None: all (slow)."
    )
    time_limit: StrictFloat | None = Field(
        default=0.02,
        gt=0,
        allow_inf_nan=False,
        description="Wall-clock seconds per MILP solve; None: node_limit alone, the same plan on every run (slower).",
    )
    node_limit: WholeNumber = Field(
        default=10_000, ge=1, le=HIGHS_INT_MAX, description="Branch-and-bound nodes per MILP solve."
    )
    mip_rel_gap: StrictFloat = Field(
        default=0.0, ge=0, le=1, allow_inf_nan=False, description="Relative gap at which a MILP solve stops."
    )
    seed: WholeNumber = Field(default=0, ge=0, le=HIGHS_INT_MAX, description="Random seed handed to HiGHS.")
    workers: OptionalWholeNumber = Field(
        default=None, ge=1, description="Processes solving global batches in parallel; default: the CPU count."
    )
    sigma_factor: StrictFloat = Field(
        default=0.25,
        ge=0,
        allow_inf_nan=False,
        description="Grouping: microbatch estimates use mean - k*std tokens per sample.",
    )
    cost_model: CostModel | None = Field(
        default=None,
        description="Seconds per microbatch (as the profiler fits it); given, a global batch that runs alone is "
        "split into the microbatches this model finds fastest. None: no split.",
    )

    @field_validator("capacity", "pipeline_stages", "padding_multiple", "data_parallel")
    @classmethod
    def _at_least_one(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} = {value}: it must be at least 1")
        if info.field_name == "pipeline_stages" and value > MAX_PIPELINE_STAGES:
            raise ValueError(
                f"pipeline_stages = {value}: at most {MAX_PIPELINE_STAGES} (more stages than any model has "
                f"layers; each stage adds about one no-op microbatch per global batch to the plan)"
            )
        return value

    @model_validator(mode="after")
    def _cost_model_matches_stages(self) -> PlanOptions:
        factors = None if self.cost_model is None else self.cost_model.stage_factors
        if factors is not None and len(factors) != self.pipeline_stages:
            raise ValueError(
                f"cost_model.stage_factors has {len(factors)} entries for pipeline_stages = {self.pipeline_stages}: "
                f"give one factor per stage, or none"
            )
        return self

    @model_validator(mode="after")
    def _capacity_multiple_of_padding(self) -> PlanOptions:
        if self.capacity % self.padding_multiple:
            lower = self.capacity - self.capacity % self.padding_multiple
            choices = f"{lower} or {lower + self.padding_multiple}" if lower else str(self.padding_multiple)
            raise ValueError(
                f"capacity = {self.capacity} is not a multiple of padding_multiple = {self.padding_multiple}: "
                f"use capacity = {choices}"
            )
        return self


class Segment(BaseModel):
    """The samples of one adapter's global batch inside one microbatch (contiguous tokens)."""

    model_config = _FROZEN

    adapter: str = Field(description="Adapter name.")
    global_batch: WholeNumber = Field(ge=0, description="Index of the adapter's global batch these samples belong to.")
    samples: WholeNumbers = Field(min_length=1, description="Indices into the adapter's sample_tokens.")
    tokens: WholeNumber = Field(ge=1, description="Real tokens: the sum of the samples' lengths.")
    padded_tokens: WholeNumber = Field(ge=1, description="tokens rounded up to the padding multiple.")


class Microbatch(BaseModel):
    """One packed microbatch, or an explicit no-op that only keeps a pipeline slot."""

    model_config = _FROZEN

    segments: tuple[Segment, ...] = Field(default=(), description="Per-adapter segments; empty for a no-op.")
    noop: StrictBool = Field(default=False, description="True for an empty slot inserted to honour the bubble lemma.")
    step_after: tuple[str, ...] = Field(
        default=(), description="Adapters whose optimizer steps once this microbatch's backward left every stage."
    )
    replica: OptionalWholeNumber = Field(
        default=None, ge=0, description="Data-parallel replica; None without data parallel."
    )

    @property
    def padded_tokens(self) -> int:
        """Padded tokens of all segments (0 for a no-op)."""
        return sum(s.padded_tokens for s in self.segments)

    @property
    def tokens(self) -> int:
        """Real tokens of all segments (0 for a no-op)."""
        return sum(s.tokens for s in self.segments)


class AdapterInfo(BaseModel):
    """An adapter as the plan saw it: enough to re-check the plan without the jobs file."""

    model_config = _FROZEN

    name: AdapterName
    global_batch_size: WholeNumber = Field(ge=1)
    num_samples: WholeNumber = Field(ge=1, description="Samples in the job (before drop_last).")
    num_global_batches: WholeNumber = Field(ge=0, description="Global batches the plan schedules.")
    sample_tokens: PositiveWholeNumbers = Field(description="Lengths as scheduled (after truncation, if any).")
    truncated_samples: WholeNumber = Field(default=0, ge=0, description="Samples cut to the capacity.")


class PlanStats(BaseModel):
    """How good the plan is and how it was made."""

    model_config = _FROZEN

    num_microbatches: WholeNumber = Field(ge=0, description="All microbatches, no-ops included.")
    num_noops: WholeNumber = Field(
        ge=0, description="No-op microbatches inserted for the bubble lemma or data parallel."
    )
    lower_bound: WholeNumber = Field(
        ge=0, description="ceil(sum over adapter global batches of padded tokens / capacity)."
    )
    fill_ratio: StrictFloat = Field(
        ge=0, le=1, allow_inf_nan=False, description="Padded tokens / (non-no-op microbatches x capacity)."
    )
    token_ratio: StrictFloat = Field(
        ge=0, le=1, allow_inf_nan=False, description="Real tokens / (non-no-op microbatches x capacity)."
    )
    num_groups: WholeNumber = Field(ge=0, description="Adapter groups used (summed over phases when adapters run out).")
    groups: tuple[tuple[str, ...], ...] = Field(description="Groups of the first phase, in execution order.")
    num_tasks: WholeNumber = Field(ge=0, description="Packing problems: (group, global batch) pairs.")
    greedy_at_bound: WholeNumber = Field(ge=0, description="Tasks where greedy met both lower bounds, so no MILP ran.")
    milp_runs: WholeNumber = Field(ge=0, description="Tasks where the MILP ran.")
    milp_wins: WholeNumber = Field(
        ge=0,
        description="Tasks whose MILP packing beat greedy (fewer or a smaller last microbatch) and is in the plan.",
    )
    milp_timeouts: WholeNumber = Field(ge=0, description="MILP solves stopped by the time or node limit.")
    merged_samples: WholeNumber = Field(
        ge=0,
        description="Samples moved into an earlier microbatch by the merge pass (0 if the unmerged sequence is kept).",
    )
    dropped_samples: WholeNumber = Field(ge=0, description="Samples left out by drop_last.")
    split_batches: WholeNumber = Field(
        ge=0,
        default=0,
        description="Global batches run alone that were split into more, smaller microbatches (needs cost_model).",
    )
    workers: WholeNumber = Field(ge=0, description="Processes that solved MILPs (1: in this process).")
    solve_seconds: StrictFloat = Field(
        ge=0,
        allow_inf_nan=False,
        description="Wall time of plan(), seconds (the only field that differs between runs when time_limit is None).",
    )


def _check_schema_version(value: object) -> object:
    """A ``before`` validator: a whole number, and the one version this package reads.

    The message starts as pydantic's own for a literal (``Input should be 1``), which callers may
    match, and goes on to say which version this package reads and what to do.
    """
    version = whole_number(value, "schema_version")
    if version == SCHEMA_VERSION:
        return version
    remedy = (
        f"a plan of schema {version} was written by a newer lorafusion-sched: upgrade this one, or plan again with it"
        if version > SCHEMA_VERSION
        else f"no lorafusion-sched writes schema {version}: plan again"
    )
    raise PydanticCustomError(
        "schema_version",
        "Input should be {expected}, the plan schema lorafusion-sched {package} reads; {remedy}",
        {"expected": SCHEMA_VERSION, "package": __version__, "remedy": remedy},
    )


def _require_schema_version(schema: dict[str, Any]) -> None:
    """A plan file must state its ``schema_version`` (see :meth:`Plan._version_stated_in_json`)."""
    schema["required"] = ["schema_version", *schema.get("required", [])]


class Plan(BaseModel):
    """The versioned plan document that the runtime executes (Contract 1)."""

    # The docstring above is the JSON schema's description. A plan read from JSON text
    # (model_validate_json, io.load_plan) must state its schema_version; one built in Python may
    # leave it to its default.
    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_require_schema_version)

    schema_version: Annotated[Literal[1], BeforeValidator(_check_schema_version)] = Field(
        default=1, description="Version of the plan schema; bumped on any incompatible change."
    )
    capacity: WholeNumber = Field(ge=1)
    pipeline_stages: WholeNumber = Field(ge=1)
    padding_multiple: WholeNumber = Field(ge=1)
    data_parallel: WholeNumber = Field(default=1, ge=1)
    adapters: tuple[AdapterInfo, ...]
    stats: PlanStats
    microbatches: tuple[Microbatch, ...]

    @model_validator(mode="before")
    @classmethod
    def _version_stated_in_json(cls, data: Any, info: ValidationInfo) -> Any:
        """A plan read from JSON text without ``schema_version`` is refused: only the file says what it follows.

        A plan built in Python (``Plan(...)``, ``Plan.model_validate(dict)``) may leave it to its default.
        """
        if info.mode == "json" and isinstance(data, dict) and "schema_version" not in data:
            raise ValueError(
                f"schema_version is missing: a plan file states the schema it follows, and lorafusion-sched "
                f'{__version__} reads schema {SCHEMA_VERSION}; add "schema_version": {SCHEMA_VERSION} if the file '
                f"follows it, or plan again"
            )
        return data


class RuntimeSettings(BaseModel):
    """The settings of the runtime that will execute a plan, for ``verify`` to check the plan against.

    A field left ``None`` is not checked. A plan fits a runtime when its capacity is at most the
    runtime's, its pipeline stages at least the runtime's, its data-parallel degree the runtime's,
    its padding multiple a multiple of the runtime's, and its global batch counts those that the
    runtime's ``drop_last`` gives.
    """

    model_config = _FROZEN

    capacity: OptionalWholeNumber = Field(
        default=None,
        ge=1,
        description="Tokens per microbatch the runtime can hold; the plan's capacity must not exceed it.",
    )
    pipeline_stages: OptionalWholeNumber = Field(
        default=None,
        ge=1,
        description="The runtime's pipeline stages; the plan's must be at least as many (the bubble lemma's distance).",
    )
    data_parallel: OptionalWholeNumber = Field(
        default=None, ge=1, description="The runtime's data-parallel replicas; the plan's must be the same."
    )
    padding_multiple: OptionalWholeNumber = Field(
        default=None,
        ge=1,
        description="The multiple the runtime pads each segment to; it must divide the plan's padding multiple.",
    )
    drop_last: StrictBool | None = Field(
        default=None,
        description="Whether the runtime drops each job's partial last global batch; the plan's global batch "
        "counts must follow it (the plan file does not record it).",
    )


class Violation(BaseModel):
    """One broken invariant found by ``verify``."""

    model_config = _FROZEN

    kind: Literal[
        "schema",
        "settings",
        "jobs",
        "sample_missing",
        "sample_repeated",
        "sample_wrong_batch",
        "tokens",
        "capacity",
        "two_global_batches",
        "batch_order",
        "bubble_lemma",
        "step_after",
        "noop",
        "replica",
        "stats",
    ]
    microbatch: OptionalWholeNumber = Field(default=None, description="Index of the offending microbatch, if one.")
    adapter: str | None = None
    message: str

    def __str__(self) -> str:
        where = f"microbatch {self.microbatch}: " if self.microbatch is not None else ""
        return f"[{self.kind}] {where}{self.message}"


class RunStats(BaseModel):
    """One simulated pipeline run (the plan or a baseline)."""

    model_config = _FROZEN

    name: str
    num_microbatches: WholeNumber
    makespan_s: StrictFloat
    bubble_ratio: StrictFloat = Field(description="Mean over stages of idle time / makespan.")
    bubble_ratio_per_stage: tuple[StrictFloat, ...]
    tokens: WholeNumber = Field(description="Real tokens trained.")
    tokens_per_s: StrictFloat


class SimulationResult(BaseModel):
    """The plan's continuous pipeline and the baselines, simulated with the same cost model."""

    model_config = _FROZEN

    pipeline_stages: WholeNumber
    cost_model: CostModel
    runs: tuple[RunStats, ...] = Field(description="The plan first ('lorafusion'), then the baselines.")

    def run(self, name: str) -> RunStats:
        """The run called ``name`` (``lorafusion``, ``megatron`` or ``mlora``).

        Raises:
            UnknownNameError: (a ``KeyError``) naming the runs this result has.
        """
        for r in self.runs:
            if r.name == name:
                return r
        names = [r.name for r in self.runs]
        hint = "" if len(names) > 1 else "; simulate(..., baselines=True) adds 'megatron' and 'mlora'"
        raise UnknownNameError(f"run {name!r} is not in this result; choose one of {names}{hint}")
