"""Re-check every invariant of a plan from the plan alone (Contract 1).

The runtime calls :func:`verify` before training and refuses a plan with violations. The checks:

* with the runtime's settings given (:class:`RuntimeSettings`), that the plan was made for them:
  its capacity at most the runtime's (its microbatches then fit), its pipeline stages at least the
  runtime's (the bubble lemma's distance is then long enough), the same data-parallel degree (the
  replicas and ``step_after`` rounds depend on it), a padding multiple that the runtime's
  divides (its padded segments are then padded for the runtime too), and the global batch counts
  that the runtime's ``drop_last`` gives;
* with the runtime's jobs given, that the plan is for them: the same adapter names, global batch
  sizes and sample lengths (a length the plan truncated to its capacity counted in
  ``truncated_samples``); the plan file is otherwise checked only against itself, so a consistent
  edit (an adapter or a global batch removed, with the header to match) passes without them;

* every scheduled sample appears exactly once, in a segment of its own global batch
  (``sample // global_batch_size``), and the segment's tokens and padded tokens are right;
* a microbatch holds at most ``capacity`` padded tokens and at most one segment per adapter, its
  segments in the order of the plan's adapters and each segment's samples rising (the format's order);
* an adapter's global batches appear in order;
* the bubble lemma: with ``d`` replicas and microbatch ``i`` at round ``i // d``, the first round
  of global batch ``g + 1`` is at least ``S`` rounds after the last round of ``g``;
* ``step_after`` names exactly the adapters whose global batch ends in that round, on every
  replica's microbatch of the round;
* no-ops have no segments, and ``replica`` is ``i % d`` (or absent when ``d = 1``);
* the statistics that follow from the plan are its own: microbatch and no-op counts, dropped
  samples (so a dropped global batch cannot pass for a smaller job), lower bound, fill and token
  ratios.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypedDict, cast

from lorafusion_sched.models import (
    AdapterInfo,
    AdapterJob,
    Microbatch,
    Plan,
    RuntimeSettings,
    Violation,
    require_model,
)
from lorafusion_sched.packing.problem import round_up

__all__ = ["verify"]


def _check_settings(plan: Plan, runtime: RuntimeSettings, out: list[Violation]) -> None:
    """The plan's header against the settings of the runtime that will execute it."""
    messages = []
    if runtime.capacity is not None and plan.capacity > runtime.capacity:
        messages.append(
            f"capacity = {plan.capacity}: the plan fills microbatches up to {plan.capacity} padded tokens, more than "
            f"the runtime's capacity {runtime.capacity}; plan again with capacity <= {runtime.capacity}"
        )
    if runtime.pipeline_stages is not None and plan.pipeline_stages < runtime.pipeline_stages:
        messages.append(
            f"pipeline_stages = {plan.pipeline_stages}: the plan keeps an adapter's global batches "
            f"{plan.pipeline_stages} rounds apart, the runtime's {runtime.pipeline_stages} pipeline stages need "
            f"{runtime.pipeline_stages}; plan again with pipeline_stages >= {runtime.pipeline_stages}"
        )
    if runtime.data_parallel is not None and plan.data_parallel != runtime.data_parallel:
        messages.append(
            f"data_parallel = {plan.data_parallel}: the plan deals microbatches to {plan.data_parallel} replicas, "
            f"the runtime has {runtime.data_parallel}; plan again with data_parallel = {runtime.data_parallel}"
        )
    if runtime.padding_multiple is not None and plan.padding_multiple % runtime.padding_multiple:
        messages.append(
            f"padding_multiple = {plan.padding_multiple}: the runtime pads segments to multiples of "
            f"{runtime.padding_multiple}, which does not divide {plan.padding_multiple}; plan again with "
            f"padding_multiple a multiple of {runtime.padding_multiple}"
        )
    out.extend(Violation(kind="settings", message=message) for message in messages)
    if runtime.drop_last is not None:
        flag = str(runtime.drop_last).lower()
        for a in plan.adapters:
            n, gbs = len(a.sample_tokens), a.global_batch_size
            want = n // gbs if runtime.drop_last else -(-n // gbs)
            if a.num_global_batches != want:
                message = (
                    f"num_global_batches = {a.num_global_batches}: {n} samples in global batches of {gbs} make "
                    f"{want} with the runtime's drop_last = {flag}; plan again with drop_last = {flag}"
                )
                out.append(Violation(kind="settings", adapter=a.name, message=message))


def _check_jobs(plan: Plan, jobs: Sequence[AdapterJob], out: list[Violation]) -> None:
    """The plan's adapters against the runtime's jobs: names, global batch sizes, sample lengths."""
    planned = {a.name: a for a in plan.adapters}
    given = {job.name: job for job in jobs}
    if set(planned) != set(given):
        out.append(
            Violation(
                kind="jobs",
                message=f"the plan is for adapters {sorted(planned)}, the runtime's jobs are {sorted(given)}: plan "
                "the runtime's jobs",
            )
        )
    for name in sorted(set(planned) & set(given)):
        info, job = planned[name], given[name]
        problem = _job_mismatch(info, job, plan.capacity)
        if problem is not None:
            out.append(
                Violation(kind="jobs", adapter=name, message=f"adapter {name!r}: {problem}: plan the runtime's jobs")
            )


def _job_mismatch(info: AdapterInfo, job: AdapterJob, capacity: int) -> str | None:
    """How the plan's adapter differs from the runtime's job of its name, if it does."""
    if info.global_batch_size != job.global_batch_size:
        return f"global_batch_size = {info.global_batch_size}, the job's is {job.global_batch_size}"
    if len(info.sample_tokens) != len(job.sample_tokens):
        return f"{len(info.sample_tokens)} samples, the job has {len(job.sample_tokens)}"
    for i, (planned, actual) in enumerate(zip(info.sample_tokens, job.sample_tokens, strict=True)):
        if planned != min(actual, capacity):
            return f"sample_tokens[{i}] = {planned}, the job's sample is {actual} tokens long"
    cut = sum(1 for actual in job.sample_tokens if actual > capacity)
    if info.truncated_samples != cut:
        return (
            f"truncated_samples = {info.truncated_samples}, but {cut} of the job's samples exceed capacity {capacity}"
        )
    return None


def _check_shape(plan: Plan, out: list[Violation]) -> None:
    d = plan.data_parallel
    names = [a.name for a in plan.adapters]
    if len(set(names)) != len(names):
        out.append(Violation(kind="schema", message=f"adapter names repeat: {sorted(names)}"))
    for a in plan.adapters:
        expected = -(-len(a.sample_tokens) // a.global_batch_size)
        if len(a.sample_tokens) != a.num_samples or a.num_global_batches not in (
            expected,
            len(a.sample_tokens) // a.global_batch_size,
        ):
            out.append(
                Violation(
                    kind="schema",
                    adapter=a.name,
                    message=f"num_samples = {a.num_samples} / num_global_batches = {a.num_global_batches} "
                    f"do not match {len(a.sample_tokens)} sample lengths and global_batch_size {a.global_batch_size}",
                )
            )
    if d > 1 and len(plan.microbatches) % d:
        out.append(
            Violation(
                kind="replica", message=f"{len(plan.microbatches)} microbatches is not a multiple of data_parallel {d}"
            )
        )
    for i, mb in enumerate(plan.microbatches):
        want = i % d if d > 1 else None
        if mb.replica != want:
            out.append(Violation(kind="replica", microbatch=i, message=f"replica = {mb.replica}, expected {want}"))
        if mb.noop != (not mb.segments):
            out.append(
                Violation(kind="noop", microbatch=i, message=f"noop = {mb.noop} but it has {len(mb.segments)} segments")
            )


class DerivedStats(TypedDict):
    """The :class:`PlanStats` fields that follow from the plan itself."""

    num_microbatches: int
    num_noops: int
    dropped_samples: int
    lower_bound: int
    fill_ratio: float
    token_ratio: float


def derived_stats(
    capacity: int, padding_multiple: int, adapters: Sequence[AdapterInfo], microbatches: Sequence[Microbatch]
) -> DerivedStats:
    """The :class:`PlanStats` fields that follow from the plan itself (``plan()`` states them, ``verify`` checks them).

    ``lower_bound = ceil(sum over adapter global batches of padded tokens / capacity)``; the ratios
    divide by the non-no-op microbatches times the capacity.
    """
    compute = [mb for mb in microbatches if not mb.noop]
    volume = 0
    for a in adapters:
        gbs = a.global_batch_size
        batches_with_samples = min(a.num_global_batches, -(-len(a.sample_tokens) // gbs))  # a bad count may be huge
        for g in range(batches_with_samples):
            volume += round_up(sum(a.sample_tokens[g * gbs : (g + 1) * gbs]), padding_multiple)
    denominator = max(1, len(compute) * capacity)
    return {
        "num_microbatches": len(microbatches),
        "num_noops": len(microbatches) - len(compute),
        "dropped_samples": sum(
            a.num_samples - min(a.num_samples, a.num_global_batches * a.global_batch_size) for a in adapters
        ),
        "lower_bound": -(-volume // capacity),
        "fill_ratio": sum(mb.padded_tokens for mb in compute) / denominator,
        "token_ratio": sum(mb.tokens for mb in compute) / denominator,
    }


def _check_stats(plan: Plan, out: list[Violation]) -> None:
    """The statistics that can be recomputed from the plan, against the ones it states."""
    expected = derived_stats(plan.capacity, plan.padding_multiple, plan.adapters, plan.microbatches)
    for name, value in expected.items():
        stated, want = getattr(plan.stats, name), cast(float, value)
        if abs(stated - want) > 1e-9 * max(1.0, abs(want)):
            out.append(Violation(kind="stats", message=f"stats.{name} = {stated}, but the plan gives {want}"))


def _check_order(index: int, mb: Microbatch, order: dict[str, int], out: list[Violation]) -> None:
    """The plan format's order: a microbatch's segments in the order of the plan's adapters, a segment's samples rising.

    A runtime may lay the row out as listed and rely on it; ``plan`` writes them so.
    """
    known = [order[s.adapter] for s in mb.segments if s.adapter in order]
    if known != sorted(known):
        listed = [s.adapter for s in mb.segments]
        out.append(
            Violation(
                kind="schema",
                microbatch=index,
                message=f"segments {listed} are not in the order of the plan's adapters",
            )
        )
    out.extend(
        Violation(
            kind="schema",
            microbatch=index,
            adapter=seg.adapter,
            message=f"the samples of {seg.adapter!r}'s segment, {list(seg.samples)}, are not in rising order",
        )
        for seg in mb.segments
        if list(seg.samples) != sorted(seg.samples)
    )


def _check_segments(plan: Plan, out: list[Violation]) -> dict[str, dict[int, tuple[int, int]]]:
    """Per-sample checks; returns adapter -> global batch -> (first round, last round)."""
    d = plan.data_parallel
    info = {a.name: a for a in plan.adapters}
    seen: dict[str, dict[int, int]] = {a.name: {} for a in plan.adapters}
    spans: dict[str, dict[int, tuple[int, int]]] = {a.name: {} for a in plan.adapters}
    latest: dict[str, int] = {}
    order = {a.name: k for k, a in enumerate(plan.adapters)}
    for i, mb in enumerate(plan.microbatches):
        round_ = i // d
        if mb.padded_tokens > plan.capacity:
            out.append(
                Violation(
                    kind="capacity",
                    microbatch=i,
                    message=f"{mb.padded_tokens} padded tokens exceed the capacity {plan.capacity}",
                )
            )
        adapters_here = [s.adapter for s in mb.segments]
        for name in sorted({n for n in adapters_here if adapters_here.count(n) > 1}):
            batches = sorted({s.global_batch for s in mb.segments if s.adapter == name})
            out.append(
                Violation(
                    kind="two_global_batches",
                    microbatch=i,
                    adapter=name,
                    message=f"adapter {name!r} has {adapters_here.count(name)} segments (global batches {batches})",
                )
            )
        _check_order(i, mb, order, out)
        for seg in mb.segments:
            a = info.get(seg.adapter)
            if a is None:
                out.append(Violation(kind="schema", microbatch=i, message=f"unknown adapter {seg.adapter!r}"))
                continue
            total = 0
            for s in seg.samples:
                if not 0 <= s < len(a.sample_tokens) or s // a.global_batch_size >= a.num_global_batches:
                    out.append(
                        Violation(
                            kind="sample_wrong_batch",
                            microbatch=i,
                            adapter=a.name,
                            message=f"sample {s} is not a scheduled sample of {a.name!r}",
                        )
                    )
                    continue
                total += a.sample_tokens[s]
                if s // a.global_batch_size != seg.global_batch:
                    out.append(
                        Violation(
                            kind="sample_wrong_batch",
                            microbatch=i,
                            adapter=a.name,
                            message=f"sample {s} belongs to global batch {s // a.global_batch_size}, "
                            f"not {seg.global_batch}",
                        )
                    )
                seen[a.name][s] = seen[a.name].get(s, 0) + 1
            if total != seg.tokens or round_up(seg.tokens, plan.padding_multiple) != seg.padded_tokens:
                out.append(
                    Violation(
                        kind="tokens",
                        microbatch=i,
                        adapter=a.name,
                        message=f"segment says tokens = {seg.tokens}, padded = {seg.padded_tokens}; its samples sum "
                        f"to {total}, padded to {round_up(total, plan.padding_multiple)}",
                    )
                )
            if latest.get(a.name, -1) > seg.global_batch:
                out.append(
                    Violation(
                        kind="batch_order",
                        microbatch=i,
                        adapter=a.name,
                        message=f"global batch {seg.global_batch} of {a.name!r} comes after batch {latest[a.name]}",
                    )
                )
            latest[a.name] = max(latest.get(a.name, -1), seg.global_batch)
            first, _last = spans[a.name].get(seg.global_batch, (round_, round_))
            spans[a.name][seg.global_batch] = (first, round_)
    for a in plan.adapters:
        scheduled = min(len(a.sample_tokens), a.num_global_batches * a.global_batch_size)
        missing = [s for s in range(scheduled) if s not in seen[a.name]]
        if missing:
            out.append(
                Violation(
                    kind="sample_missing",
                    adapter=a.name,
                    message=f"{len(missing)} samples of {a.name!r} are never scheduled (first: {missing[:5]})",
                )
            )
        repeated = sorted(s for s, n in seen[a.name].items() if n > 1)
        if repeated:
            out.append(
                Violation(
                    kind="sample_repeated",
                    adapter=a.name,
                    message=f"{len(repeated)} samples of {a.name!r} appear more than once (first: {repeated[:5]})",
                )
            )
    return spans


def _check_lemma_and_steps(plan: Plan, spans: dict[str, dict[int, tuple[int, int]]], out: list[Violation]) -> None:
    d, stages = plan.data_parallel, plan.pipeline_stages
    steps: dict[int, set[str]] = {}
    lemma: list[Violation] = []
    for name, batches in spans.items():
        for g, (_first, last) in sorted(batches.items()):
            steps.setdefault(last, set()).add(name)
            following = batches.get(g + 1)
            if following is not None and following[0] - last < stages:
                lemma.append(
                    Violation(
                        kind="bubble_lemma",
                        microbatch=following[0] * d,
                        adapter=name,
                        message=f"global batch {g + 1} of {name!r} starts at round {following[0]}, "
                        f"{following[0] - last} rounds after batch {g} ends (round {last}); needs {stages}",
                    )
                )
    out.extend(sorted(lemma, key=lambda v: (v.microbatch, v.adapter)))
    for i, mb in enumerate(plan.microbatches):
        want = sorted(steps.get(i // d, set()))
        if sorted(mb.step_after) != want:
            out.append(
                Violation(
                    kind="step_after",
                    microbatch=i,
                    message=f"step_after = {sorted(mb.step_after)}, expected {want}",
                )
            )


def verify(
    plan: Plan, *, runtime: RuntimeSettings | None = None, jobs: Iterable[AdapterJob] | None = None
) -> list[Violation]:
    """Every violated invariant of ``plan`` (empty when the plan is valid).

    Args:
        plan: A plan, e.g. from :func:`lorafusion_sched.plan` or read from JSON.
        runtime: The settings of the runtime that will execute the plan; each one given that the
            plan was not made for is a violation of kind ``settings`` (see :class:`RuntimeSettings`).
            ``None``: the plan is checked against its own header only.
        jobs: The jobs the runtime will train (as given to :func:`lorafusion_sched.plan`); a plan
            for other adapters, global batch sizes or sample lengths is a violation of kind
            ``jobs``. ``None``: the plan's adapters are checked against themselves only.

    Returns:
        Violations grouped by check (settings, jobs, shape, samples and microbatches, bubble lemma
        and steps, statistics); within a group, in the order found.

    Raises:
        TypeError: ``plan`` is not a :class:`Plan` (e.g. a dict from ``json.load``:
            ``Plan.model_validate_json`` reads a file's text), ``runtime`` not a :class:`RuntimeSettings`,
            or ``jobs`` not :class:`AdapterJob` models.
    """
    require_model(plan, Plan, "plan")
    if runtime is not None:
        require_model(runtime, RuntimeSettings, "runtime")
    given = None if jobs is None else list(jobs)
    for i, job in enumerate(given or []):
        require_model(job, AdapterJob, f"jobs[{i}]")
    out: list[Violation] = []
    if runtime is not None:
        _check_settings(plan, runtime, out)
    if given is not None:
        _check_jobs(plan, given, out)
    _check_shape(plan, out)
    spans = _check_segments(plan, out)
    _check_lemma_and_steps(plan, spans, out)
    _check_stats(plan, out)
    return out
