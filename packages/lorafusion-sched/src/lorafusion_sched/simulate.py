"""Pipeline simulator: the plan's continuous 1F1B pipeline against two baselines (paper sections 4 and 6.5).

Every run is a sequence of microbatches per data-parallel replica, executed with the 1F1B schedule
on ``S`` stages: stage ``s`` first runs ``S - 1 - s`` forwards, then alternates one forward and
one backward, then drains the remaining backwards. A forward on stage ``s`` waits for the same
microbatch's forward on ``s - 1``; a backward waits for the backward on ``s + 1`` (on the last
stage, for its own forward). Communication is free; a no-op takes no time but keeps its slot.

Runs:

* ``lorafusion``: the plan's microbatches, one continuous pipeline (no flush between global
  batches: the plan's bubble lemma makes that safe).
* ``megatron``: each adapter alone in turn; each global batch split in order into microbatches of
  a fixed number of samples and run as its own 1F1B pipeline (flush per global batch).
* ``mlora``: for each global-batch index, adapters round-robin, fixed samples per microbatch
  (one adapter per microbatch, no token balancing), one continuous pipeline with the no-ops the
  bubble lemma needs.

Baseline microbatches are padded like the plan's segments (one segment, rounded up to ``P``).
With ``d`` replicas each replica runs its share of each pipeline independently (microbatch ``i``
on replica ``i % d``; the slowest one sets the time, and tokens/s counts all replicas' tokens), which
ignores the all-reduce.

A plan is verified before it is simulated, and refused if it has violations.
"""

from __future__ import annotations

import collections
import hashlib
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lorafusion_sched.errors import InvalidPlanError, SchedError
from lorafusion_sched.models import CostModel, Plan, RunStats, SimulationResult, require_model, whole_number
from lorafusion_sched.packing.problem import round_up
from lorafusion_sched.sequence import Slot, insert_noops
from lorafusion_sched.verify import verify

__all__ = ["Event", "baseline_microbatch_samples", "run_sequences", "sequence_seconds", "simulate", "timeline"]


@dataclass(frozen=True, slots=True)
class Event:
    """One forward (``F``) or backward (``B``) of one microbatch on one stage."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    label: str


@dataclass(frozen=True, slots=True)
class _Item:
    tokens: int
    label: str


@dataclass(frozen=True, slots=True)
class _Ops:
    """Every op of one simulated 1F1B pipeline: per stage and microbatch, durations, inputs' ends and ends."""

    forward: list[list[float]]
    backward: list[list[float]]
    f_input: list[list[float]]
    b_input: list[list[float]]
    f_end: list[list[float]]
    b_end: list[list[float]]
    end: float


def _simulate_ops(tokens: Sequence[int], stages: int, cost: CostModel, start: float) -> _Ops:
    """Simulate one 1F1B pipeline of microbatches of these padded sizes from ``start``.

    Stage ``s`` of ``S`` runs ``w = min(S - 1 - s, n)`` forwards, then alternates forward ``w + j``
    and backward ``j``, then runs the remaining backwards. Each op starts at
    ``max(end of the op before it on its stage, end of its input)``. The ops are computed in order of
    a key under which every op comes after its input and after the op before it on its stage: its
    start in the same schedule with every op taking one unit of time,

    * forward ``i`` on ``s``: ``s + i`` in the warm-up (``i < S - 1 - s``), else ``2 i + s``;
    * backward ``i`` on ``s``: ``2 S - 1 - s + 2 i``.

    The warm-ups (keys below ``S - 1``) need only one another; from key ``S - 1`` on, the stages
    whose index has the key's parity run a forward and the others a backward.
    """
    n = len(tokens)
    last = stages - 1
    unscaled = [cost.unscaled_forward_seconds(t) for t in tokens]  # interpolated once, not once per stage
    factors = cost.stage_factors or (1.0,) * stages
    forward = [[factor * seconds for seconds in unscaled] for factor in factors]
    backward = [[cost.backward_factor * seconds for seconds in row] for row in forward]
    f_end = [[0.0] * n for _ in range(stages)]
    b_end = [[0.0] * n for _ in range(stages)]
    f_input = [[start] * n, *f_end[:last]]  # forward i on s starts after f_input[s][i]
    b_input = [*b_end[1:], f_end[last]]  # backward i on s starts after b_input[s][i]
    clock = [start] * stages
    for s in range(stages):
        c, ends, inputs, durations = start, f_end[s], f_input[s], forward[s]
        for i in range(min(last - s, n)):
            ready = inputs[i]
            c = (c if c > ready else ready) + durations[i]
            ends[i] = c
        clock[s] = c
    for t in range(last, 2 * (n + last)):
        low = max(2 * last - t, t - 2 * n + 2, 0)  # forward i = (t - s) / 2 with S - 1 - s <= i < n
        for s in range(low + ((t - low) & 1), stages, 2):
            i = (t - s) >> 1
            ready, c = f_input[s][i], clock[s]
            f_end[s][i] = clock[s] = (c if c > ready else ready) + forward[s][i]
        low = max(2 * last + 1 - t, 0)  # backward i = (t + s + 1 - 2 S) / 2 with 0 <= i < n
        for s in range(low + ((t - low + 1) & 1), min(stages, 2 * (n + last) - t), 2):
            i = (t + s + 1 - 2 * stages) >> 1
            ready, c = b_input[s][i], clock[s]
            b_end[s][i] = clock[s] = (c if c > ready else ready) + backward[s][i]
    return _Ops(forward, backward, f_input, b_input, f_end, b_end, max(clock))


_REMEMBERED = 64
"""Pipelines whose end :func:`_pipeline_end` remembers (each by a 16-byte digest of its microbatches, not a copy)."""

_ends: collections.OrderedDict[tuple[bytes, int, CostModel, float], float] = collections.OrderedDict()


def _pipeline_end(tokens: Sequence[int], stages: int, cost: CostModel, start: float) -> float:
    """End of one 1F1B pipeline (:func:`_simulate_ops`), remembered for the last :data:`_REMEMBERED` pipelines.

    ``simulate`` of a plan planned with a cost model then runs no simulation the planner ran. The
    key holds a digest of the sizes, so that a planner's long sequences are not kept alive.
    """
    key = (hashlib.blake2b(repr(tuple(tokens)).encode(), digest_size=16).digest(), stages, cost, start)
    end = _ends.get(key)
    if end is None:
        end = _ends[key] = _simulate_ops(tokens, stages, cost, start).end
        if len(_ends) > _REMEMBERED:
            _ends.popitem(last=False)
    else:
        _ends.move_to_end(key)
    return end


def _one_f_one_b(
    items: Sequence[_Item], stages: int, cost: CostModel, start: float, events: list[Event] | None
) -> float:
    """Simulate one 1F1B pipeline from ``start``; returns its end time and appends its ops to ``events``."""
    if not items:
        return start
    if events is None:
        return _pipeline_end([it.tokens for it in items], stages, cost, start)
    ops = _simulate_ops([it.tokens for it in items], stages, cost, start)
    for s in range(stages):
        clock = start
        for kind, i in _stage_order(s, stages, len(items)):
            ends, ready, duration = (
                (ops.f_end[s], ops.f_input[s][i], ops.forward[s][i])
                if kind == "F"
                else (ops.b_end[s], ops.b_input[s][i], ops.backward[s][i])
            )
            if duration > 0:
                events.append(Event(s, kind, i, max(clock, ready), ends[i], items[i].label))
            clock = ends[i]
    return ops.end


def _stage_order(stage: int, stages: int, n: int) -> Iterator[tuple[str, int]]:
    """Stage ``stage``'s ops in 1F1B order: ``("F", i)`` and ``("B", i)``."""
    warmup = min(stages - 1 - stage, n)
    for i in range(warmup):
        yield "F", i
    for j in range(n - warmup):
        yield "F", warmup + j
        yield "B", j
    for i in range(n - warmup, n):
        yield "B", i


def run_sequences(
    pipelines: Sequence[Sequence[Sequence[_Item]]], stages: int, cost: CostModel, events: list[Event] | None = None
) -> tuple[float, list[float]]:
    """Run pipelines one after another (a flush between them); each has one sequence per replica.

    Returns:
        Makespan and busy seconds per stage (averaged over replicas): stage ``s`` is busy for
        ``factor_s (1 + backward_factor) forward(tokens)`` per microbatch.
    """
    work = sum(
        sum(cost.unscaled_forward_seconds(it.tokens) for items in per_replica for it in items) / len(per_replica)
        for per_replica in pipelines
    )
    factors = cost.stage_factors or (1.0,) * stages
    return _makespan(pipelines, stages, cost, events), [
        factor * (1.0 + cost.backward_factor) * work for factor in factors
    ]


def _makespan(
    pipelines: Sequence[Sequence[Sequence[_Item]]], stages: int, cost: CostModel, events: list[Event] | None = None
) -> float:
    """The end of the last of the pipelines run one after another; replica 0's ops go to ``events``."""
    clock = 0.0
    for per_replica in pipelines:
        ends = [
            _one_f_one_b(items, stages, cost, clock, events if r == 0 else None) for r, items in enumerate(per_replica)
        ]
        clock = max([clock, *ends])
    return clock


def sequence_seconds(padded_tokens: Sequence[int], stages: int, replicas: int, cost: CostModel) -> float:
    """Makespan of one continuous 1F1B pipeline of microbatches of these sizes (0: a no-op), dealt to replicas.

    Microbatch ``i`` runs on replica ``i % replicas``; the slowest replica sets the time. (The
    planner's splits call it for every candidate: no busy times are computed.)
    """
    items = [_Item(tokens, "") for tokens in padded_tokens]
    return _makespan([_split(items, replicas)], stages, cost)


def baseline_microbatch_samples(plan: Plan) -> dict[str, int]:
    """Default samples per baseline microbatch: the most whose mean padded size fits the capacity."""
    out = {}
    for a in plan.adapters:
        mean = round_up(math.ceil(statistics.fmean(a.sample_tokens)), plan.padding_multiple)
        out[a.name] = max(1, plan.capacity // mean)
    return out


def _scheduled(plan: Plan) -> list[list[list[int]]]:
    """Per adapter, per global batch, the sample ids the plan schedules."""
    out = []
    for a in plan.adapters:
        gbs = a.global_batch_size
        out.append(
            [list(range(g * gbs, min((g + 1) * gbs, len(a.sample_tokens)))) for g in range(a.num_global_batches)]
        )
    return out


def _split(items: Sequence[_Item], replicas: int) -> list[list[_Item]]:
    return [list(items[r::replicas]) for r in range(replicas)]


def _plan_pipelines(plan: Plan) -> list[list[list[_Item]]]:
    items = [_Item(mb.padded_tokens, "+".join(s.adapter for s in mb.segments) or "no-op") for mb in plan.microbatches]
    return [_split(items, plan.data_parallel)]


def _chunks(plan: Plan, adapter: int, samples: list[int], size: int) -> list[_Item]:
    info = plan.adapters[adapter]
    return [
        _Item(round_up(sum(info.sample_tokens[s] for s in samples[i : i + size]), plan.padding_multiple), info.name)
        for i in range(0, len(samples), size)
    ]


def _megatron_pipelines(plan: Plan, per_mb: dict[str, int]) -> list[list[list[_Item]]]:
    return [
        _split(_chunks(plan, a, samples, per_mb[plan.adapters[a].name]), plan.data_parallel)
        for a, batches in enumerate(_scheduled(plan))
        for samples in batches
    ]


def _mlora_pipelines(plan: Plan, per_mb: dict[str, int]) -> list[list[list[_Item]]]:
    scheduled = _scheduled(plan)
    slots: list[Slot] = []
    items: list[_Item] = []
    for g in range(max((len(b) for b in scheduled), default=0)):
        for a, batches in enumerate(scheduled):
            if g < len(batches):
                for item in _chunks(plan, a, batches[g], per_mb[plan.adapters[a].name]):
                    slots.append({a: (g, [])})
                    items.append(item)
    order = insert_noops(slots, plan.pipeline_stages, plan.data_parallel)
    laid_out = [_Item(0, "no-op") if i is None else items[i] for i in order]
    return [_split(laid_out, plan.data_parallel)]


def _stats(name: str, pipelines: list[list[list[_Item]]], plan: Plan, cost: CostModel, tokens: int) -> RunStats:
    makespan, busy = run_sequences(pipelines, plan.pipeline_stages, cost)
    if not math.isfinite(makespan) or (makespan > 0 and not math.isfinite(tokens / makespan)):
        raise SchedError(
            f"the {name} run's makespan, {makespan} s, is past what a float holds (or its tokens/s is): the cost "
            "model's seconds per microbatch are out of range; give them in seconds, e.g. forward_fixed_s = 0.002"
        )
    # A stage is never busy longer than the makespan; max() only removes rounding below zero,
    # which printed as "-0.0%" for a single-stage pipeline.
    per_stage = tuple(max(0.0, 1.0 - b / makespan) if makespan > 0 else 0.0 for b in busy)
    return RunStats(
        name=name,
        num_microbatches=sum(len(seq) for p in pipelines for seq in p),
        makespan_s=makespan,
        bubble_ratio=statistics.fmean(per_stage),
        bubble_ratio_per_stage=per_stage,
        tokens=tokens,
        tokens_per_s=tokens / makespan if makespan > 0 else 0.0,
    )


_VIOLATIONS_SHOWN = 3
"""Violations an invalid plan's error message quotes."""


def _require_valid(plan: Plan) -> None:
    """Refuse a plan that ``verify`` finds violations in: its simulation would measure a schedule no runtime may run.

    A plan whose no-ops were dropped, for one, simulates faster than the valid plan, and its
    samples would see stale weights in training.
    """
    violations = verify(plan)
    if violations:
        shown = "; ".join(str(v) for v in violations[:_VIOLATIONS_SHOWN])
        more = f"; and {len(violations) - _VIOLATIONS_SHOWN} more" if len(violations) > _VIOLATIONS_SHOWN else ""
        raise InvalidPlanError(
            f"the plan has {len(violations)} violation(s), so it is not simulated: {shown}{more}. Run "
            f"`lorafusion-sched verify` on the plan file (or verify(plan)) to see them all, and plan again",
            list(violations),
        )


def _check_cost(plan: Plan, cost: CostModel) -> None:
    require_model(plan, Plan, "plan")
    require_model(cost, CostModel, "cost_model")
    if cost.stage_factors is not None and len(cost.stage_factors) != plan.pipeline_stages:
        raise SchedError(
            f"cost_model.stage_factors has {len(cost.stage_factors)} entries: give one per pipeline stage "
            f"({plan.pipeline_stages})"
        )
    _require_valid(plan)


def simulate(
    plan: Plan,
    cost_model: CostModel | None = None,
    *,
    baselines: bool = True,
    microbatch_samples: dict[str, int] | None = None,
) -> SimulationResult:
    """Simulate the plan's pipeline and, optionally, the Megatron-style and mLoRA-style baselines.

    The plan is verified first (:func:`lorafusion_sched.verify`, without runtime settings): a plan
    with violations is refused, never simulated. The baselines are built from the plan's adapters
    (their samples and global batches), not from its microbatches, so they need no plan of their own.

    Args:
        plan: A valid plan (its adapters carry the sample lengths the baselines need).
        cost_model: Seconds per microbatch; default :class:`CostModel`.
        baselines: Also simulate ``megatron`` and ``mlora``.
        microbatch_samples: Samples per baseline microbatch by adapter name; default
            :func:`baseline_microbatch_samples`.

    Returns:
        Makespan, per-stage bubble ratio and tokens/s of every run, the plan's first.

    Raises:
        SchedError: If the plan has violations (the message counts them and quotes the first few),
            the cost model's stage factors do not match the pipeline, ``microbatch_samples``
            names an adapter the plan lacks or a count below 1, or a run's simulated seconds are past
            what a float holds (a cost model far out of range).
        TypeError: ``plan`` is not a :class:`Plan` or ``cost_model`` not a :class:`CostModel`.
    """
    cost = CostModel() if cost_model is None else cost_model
    _check_cost(plan, cost)
    chosen = _checked_microbatch_samples(plan, microbatch_samples or {})
    tokens = sum(mb.tokens for mb in plan.microbatches)
    runs = [_stats("lorafusion", _plan_pipelines(plan), plan, cost, tokens)]
    if baselines:
        per_mb = baseline_microbatch_samples(plan) | chosen
        runs.append(_stats("megatron", _megatron_pipelines(plan, per_mb), plan, cost, tokens))
        runs.append(_stats("mlora", _mlora_pipelines(plan, per_mb), plan, cost, tokens))
    return SimulationResult(pipeline_stages=plan.pipeline_stages, cost_model=cost, runs=tuple(runs))


def _checked_microbatch_samples(plan: Plan, per_mb: dict[str, int]) -> dict[str, int]:
    """``per_mb`` as ints, once every entry names an adapter of ``plan`` and a whole number of at least 1.

    Whole numbers as the models take them: ``numpy`` integers and ``2.0`` too.
    """
    names = [a.name for a in plan.adapters]
    out = {}
    for name, count in per_mb.items():
        if name not in names:
            raise SchedError(f"microbatch_samples names {name!r}, which is not an adapter of the plan ({names})")
        try:
            out[name] = whole_number(count, f"microbatch_samples[{name!r}]")
        except ValueError as exc:
            raise SchedError(str(exc)) from None
        if out[name] < 1:
            raise SchedError(f"microbatch_samples[{name!r}] = {count!r}: give a whole number of samples, at least 1")
    return out


def timeline(plan: Plan, run: str = "lorafusion", cost_model: CostModel | None = None) -> list[Event]:
    """The events of replica 0 of one run (for plotting); like :func:`simulate`, it refuses an invalid plan."""
    cost = CostModel() if cost_model is None else cost_model
    _check_cost(plan, cost)
    per_mb = baseline_microbatch_samples(plan)
    builders = {
        "lorafusion": lambda: _plan_pipelines(plan),
        "megatron": lambda: _megatron_pipelines(plan, per_mb),
        "mlora": lambda: _mlora_pipelines(plan, per_mb),
    }
    if run not in builders:
        raise SchedError(f"run = {run!r} is unknown: choose one of {', '.join(builders)}")
    events: list[Event] = []
    _makespan(builders[run](), plan.pipeline_stages, cost, events)
    return events
