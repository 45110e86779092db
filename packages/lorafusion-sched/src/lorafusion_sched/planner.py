"""The facade: ``plan(jobs, options) -> Plan`` (paper Algorithm 1 with grouping, merge and repair).

Steps: check the jobs; group adapters and order the packing tasks; pack every task greedily;
improve the tasks where greedy misses a bound with the two-stage MILP, in a process pool; lay the
microbatches out task after task; insert no-ops for the bubble lemma; merge across tasks; drop
emptied microbatches and re-insert no-ops, reordering the microbatches where a list schedule needs
fewer (and trying the unmerged sequence too where no-ops remain); where a MILP packing won, keep
the greedy packings' sequence if it is shorter; with a cost model, split the global batches that
run alone where that simulates faster; set ``step_after``; verify.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

from lorafusion_sched.advice import noop_advice
from lorafusion_sched.errors import SchedError, SchedWarning
from lorafusion_sched.grouping import AdapterProfile, Task, plan_tasks
from lorafusion_sched.lone_batches import Splitting, fastest_with_splits
from lorafusion_sched.merge import merge_pass
from lorafusion_sched.models import (
    AdapterInfo,
    AdapterJob,
    Microbatch,
    Plan,
    PlanOptions,
    PlanStats,
    Segment,
    require_model,
)
from lorafusion_sched.packing import highs
from lorafusion_sched.packing.pool import solve_in_workers
from lorafusion_sched.packing.problem import Packing, PackingProblem, round_up
from lorafusion_sched.packing.solve import TaskResult, pack_greedy, pack_with_milp
from lorafusion_sched.sequence import Slot, fewest_noops, insert_noops, shortest_possible, step_rounds
from lorafusion_sched.verify import derived_stats, verify

__all__ = ["Progress", "default_workers", "plan", "resolve_workers"]

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while tasks are packed."""

_POOL_MIN_TASKS = 16
"""Below this many MILP tasks a worker's start-up (about 0.3 s here) costs more than it saves."""


def default_workers() -> int:
    """CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(requested: int | None) -> int:
    """The worker processes to use: ``requested``, at most the CPUs this process may use (their number if ``None``).

    More processes than CPUs only compete for them: each is a fresh interpreter importing HiGHS, and
    time-limited MILP solves that share a CPU stop earlier with worse answers (4 x 2,000 samples on
    2 CPUs planned in 2.5 s with 2 workers, 7.4 s with 16 and 24.9 s with 64). A request above the
    CPUs, as in a config copied from a larger machine, is capped with one warning.
    """
    cpus = default_workers()
    if requested is None:
        return cpus
    if requested > cpus:
        warnings.warn(
            f"workers = {requested} is more than the {cpus} CPUs this process may use; planning with {cpus} worker "
            f"processes (more only compete for the CPUs and make planning slower): set workers to at most {cpus}, "
            f"or leave it unset to use them all",
            SchedWarning,
            stacklevel=3,
        )
        return cpus
    return requested


def _checked_lengths(jobs: Sequence[AdapterJob], options: PlanOptions) -> tuple[list[list[int]], list[int]]:
    """Lengths per adapter (truncated if allowed) and truncation counts; raises on bad jobs."""
    if not jobs:
        raise SchedError("jobs is empty: give at least one adapter")
    names = [j.name for j in jobs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SchedError(f"adapter names must be unique; repeated: {repeated}")
    lengths: list[list[int]] = []
    truncated: list[int] = []
    for job in jobs:
        too_long = [(i, t) for i, t in enumerate(job.sample_tokens) if t > options.capacity]
        if too_long and not options.truncate:
            i, t = too_long[0]
            count = "the only sample that does" if len(too_long) == 1 else f"{len(too_long)} of its samples do"
            raise SchedError(
                f"adapter {job.name!r}: sample_tokens[{i}] = {t} exceeds capacity = {options.capacity} "
                f"({count}): raise the capacity, or set the option truncate = true (demo: --truncate) to cut them to it"
            )
        lengths.append([min(t, options.capacity) for t in job.sample_tokens])
        truncated.append(len(too_long))
        if options.drop_last and len(job.sample_tokens) < job.global_batch_size:
            raise SchedError(
                f"adapter {job.name!r}: {len(job.sample_tokens)} samples < global_batch_size = "
                f"{job.global_batch_size}, so drop_last = true would drop all of them"
            )
    return lengths, truncated


def _num_batches(job: AdapterJob, drop_last: bool) -> int:
    n, gbs = len(job.sample_tokens), job.global_batch_size
    return n // gbs if drop_last else -(-n // gbs)


def _problems(
    tasks: Sequence[Task], jobs: Sequence[AdapterJob], lengths: Sequence[Sequence[int]], options: PlanOptions
) -> list[tuple[PackingProblem, list[tuple[int, int]]]]:
    """Each task's packing problem and its items as (adapter, sample)."""
    out = []
    for task in tasks:
        items: list[tuple[int, int]] = []
        for a in task.group:
            gbs = jobs[a].global_batch_size
            stop = min((task.global_batch + 1) * gbs, len(lengths[a]))
            items.extend((a, s) for s in range(task.global_batch * gbs, stop))
        problem = PackingProblem(
            adapters=tuple(a for a, _s in items),
            lengths=tuple(lengths[a][s] for a, s in items),
            capacity=options.capacity,
            padding=options.padding_multiple,
        )
        out.append((problem, items))
    return out


def _solve_milps(
    work: list[tuple[int, PackingProblem, Packing]],
    options: PlanOptions,
    workers: int,
    tick: Callable[[], None],
) -> tuple[dict[int, TaskResult], int]:
    """MILP results by task id (tasks a failed worker left out are missing), and the processes used."""
    settings = highs.SolverSettings(
        time_limit=options.time_limit, node_limit=options.node_limit, mip_rel_gap=options.mip_rel_gap, seed=options.seed
    )
    results: dict[int, TaskResult] = {}
    if workers <= 1 or len(work) < _POOL_MIN_TASKS:
        for task_id, problem, greedy in work:
            results[task_id] = pack_with_milp(problem, greedy, settings, options.neighbourhood)
            tick()
        return results, 1

    def collect(task_id: int, result: TaskResult) -> None:
        results[task_id] = result
        tick()

    workers = min(workers, len(work))
    try:
        failure = solve_in_workers(work, settings, options.neighbourhood, workers, collect)
    except OSError as err:  # no process could start (e.g. an embedded interpreter): solve here
        warnings.warn(
            f"MILP worker processes could not start ({err}); solving in this process", SchedWarning, stacklevel=3
        )
        return _solve_milps(work, options, 1, tick)
    if failure is not None:
        missing = len(work) - len(results)
        warnings.warn(
            f"{missing} MILP tasks kept their greedy packing, a worker failed: {failure}", SchedWarning, stacklevel=3
        )
    return results, workers


def _segments(slot: Slot, jobs: Sequence[AdapterJob], lengths: Sequence[Sequence[int]], padding: int) -> list[Segment]:
    segments = []
    for a in sorted(slot):
        batch, samples = slot[a]
        tokens = sum(lengths[a][s] for s in samples)
        segments.append(
            Segment(
                adapter=jobs[a].name,
                global_batch=batch,
                samples=tuple(samples),
                tokens=tokens,
                padded_tokens=round_up(tokens, padding),
            )
        )
    return segments


def _pack(
    problems: Sequence[tuple[PackingProblem, list[tuple[int, int]]]],
    options: PlanOptions,
    workers: int,
    progress: Progress | None,
) -> tuple[list[TaskResult], list[TaskResult], int]:
    """Greedy for every task, then the MILP where greedy misses a bound.

    Returns:
        The results (the MILP's where it ran), the greedy results, and the processes used.
    """
    total, done = len(problems), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    results: dict[int, TaskResult] = {}
    work: list[tuple[int, PackingProblem, Packing]] = []
    for task_id, (problem, _items) in enumerate(problems):
        results[task_id] = pack_greedy(problem)
        if options.use_milp and not results[task_id].at_bound:
            work.append((task_id, problem, results[task_id].packing))
        else:
            tick()
    greedy = [results[t] for t in range(total)]
    used = 1
    if work:
        milp, used = _solve_milps(work, options, workers, tick)
        results.update(milp)
    return [results[t] for t in range(total)], greedy, used


def _sequence(
    tasks: Sequence[Task],
    problems: Sequence[tuple[PackingProblem, list[tuple[int, int]]]],
    packed: Sequence[TaskResult],
    lengths: Sequence[Sequence[int]],
    options: PlanOptions,
) -> tuple[list[Slot], int]:
    """Lay tasks out in order, insert no-ops, merge, then reorder and re-insert no-ops where that saves some.

    Returns:
        The slots, no-ops empty, and the number of samples the merge moved.
    """
    stages, d = options.pipeline_stages, options.data_parallel
    slots: list[Slot] = []
    task_of: list[int | None] = []
    for task_id, task in enumerate(tasks):
        items = problems[task_id][1]
        for bin_items in packed[task_id].packing:
            slot: Slot = {}
            for i in bin_items:
                a, s = items[i]
                slot.setdefault(a, (task.global_batch, []))[1].append(s)
            slots.append({a: (g, sorted(samples)) for a, (g, samples) in slot.items()})
            task_of.append(task_id)

    def reordered(sequence: list[Slot]) -> list[Slot]:
        return [{} if i is None else sequence[i] for i in fewest_noops(sequence, stages, d)]

    if not options.merge:
        return reordered(slots), 0
    unmerged = [{a: (g, list(samples)) for a, (g, samples) in slot.items()} for slot in slots]  # merge_pass edits
    order = insert_noops(slots, stages, d)
    laid_out: list[Slot] = [{} if i is None else slots[i] for i in order]
    merged = merge_pass(
        laid_out,
        [None if i is None else task_of[i] for i in order],
        lengths,
        capacity=options.capacity,
        padding=options.padding_multiple,
        stages=stages,
        replicas=d,
    )
    compact = [slot for slot in laid_out if slot]
    result = reordered(compact)
    if len(result) > shortest_possible(len(compact), d):
        # The merge never lengthens the sequence of the given order, but the list schedule is a
        # heuristic and may find more in the unmerged sequence (more, smaller microbatches to fill
        # the waits with); keep the shorter.
        alternative = reordered(unmerged)
        if len(alternative) < len(result):
            return alternative, 0
    return result, merged


def _split_if_faster(
    final: list[Slot], lengths: Sequence[Sequence[int]], options: PlanOptions
) -> tuple[list[Slot], int]:
    """``final`` with its lone global batches split, if the whole plan then simulates faster.

    Only with ``options.cost_model`` (:mod:`lorafusion_sched.lone_batches`). Returns the sequence
    and the number of global batches split.
    """
    if options.cost_model is None:
        return final, 0
    how = Splitting(
        lengths=lengths,
        capacity=options.capacity,
        padding=options.padding_multiple,
        stages=options.pipeline_stages,
        replicas=options.data_parallel,
        cost=options.cost_model,
    )
    return fastest_with_splits(final, how)


def _stats(
    microbatches: Sequence[Microbatch],
    adapters: Sequence[AdapterInfo],
    phases: Sequence[Sequence[tuple[int, ...]]],
    packed: Sequence[TaskResult],
    options: PlanOptions,
) -> PlanStats:
    return PlanStats(
        **derived_stats(options.capacity, options.padding_multiple, adapters, microbatches),
        num_groups=sum(len(groups) for groups in phases),
        groups=tuple(tuple(adapters[a].name for a in group) for group in (phases[0] if phases else [])),
        num_tasks=len(packed),
        greedy_at_bound=sum(r.at_bound for r in packed),
        milp_runs=sum(r.milp_ran for r in packed),
        milp_wins=sum(r.milp_won for r in packed),
        milp_timeouts=sum(r.timeouts for r in packed),
        merged_samples=0,
        workers=1,
        solve_seconds=0.0,
    )


def plan(jobs: Iterable[AdapterJob], options: PlanOptions, *, progress: Progress | None = None) -> Plan:
    """Plan the microbatches of several LoRA jobs sharing one pipeline.

    Args:
        jobs: The adapters (unique names).
        options: Capacity, pipeline stages, padding multiple, solver limits and an optional cost model.
        progress: Optional ``progress(done, total)`` callback over packing tasks.

    Returns:
        A plan that :func:`lorafusion_sched.verify` accepts.

    Raises:
        SchedError: No jobs, repeated names, a sample longer than the capacity (unless
            ``truncate``), or ``drop_last`` leaving an adapter with nothing.
        TypeError: ``jobs`` is not a list of :class:`AdapterJob` or ``options`` not a
            :class:`PlanOptions` (e.g. dicts: build the models from them).

    Warns:
        SchedWarning: ``workers`` is above the CPUs this process may use (it is capped to them);
            more than 20% of the plan's microbatches are no-ops (the message names the adapters
            left alone at the end and what helps: :func:`lorafusion_sched.advice.noop_advice`).
    """
    start = time.perf_counter()
    if isinstance(jobs, AdapterJob | Mapping | str):
        raise TypeError(f"jobs has type {type(jobs).__name__}: pass a list of AdapterJob, e.g. plan([job], options)")
    jobs = list(jobs)
    for i, job in enumerate(jobs):
        require_model(job, AdapterJob, f"jobs[{i}]")
    require_model(options, PlanOptions, "options")
    # model_copy(update=...) skips the validators: checked again, so that e.g. a cost model's stage
    # factors that no longer match pipeline_stages get the message, not an IndexError mid-plan.
    options = PlanOptions.model_validate(options.model_dump())
    lengths, truncated = _checked_lengths(jobs, options)
    workers = resolve_workers(options.workers)
    d = options.data_parallel
    batches = [_num_batches(job, options.drop_last) for job in jobs]
    profiles = [
        AdapterProfile(
            index=i,
            mean=statistics.fmean(lengths[i]),
            std=statistics.stdev(lengths[i]) if len(lengths[i]) > 1 else 0.0,
            global_batch_size=job.global_batch_size,
            num_global_batches=batches[i],
        )
        for i, job in enumerate(jobs)
    ]
    tasks, phases = plan_tasks(profiles, options.capacity, options.pipeline_stages, options.sigma_factor, d)
    problems = _problems(tasks, jobs, lengths, options)
    packed, greedy, workers = _pack(problems, options, workers, progress)
    final, merged = _sequence(tasks, problems, packed, lengths, options)
    if any(r.milp_won for r in packed):
        # Each task's MILP packing is never worse than its greedy one, but the no-ops and the merge act
        # on the whole sequence, where a task's better packing can end up a microbatch longer (3 of 400
        # random workloads): then the greedy sequence is kept, so the plan is never longer than greedy's.
        greedy_final, greedy_merged = _sequence(tasks, problems, greedy, lengths, options)
        if len(greedy_final) < len(final):
            final, merged = greedy_final, greedy_merged
            packed = [
                dataclasses.replace(r, packing=g.packing, milp_won=False) for r, g in zip(packed, greedy, strict=True)
            ]
    final, split = _split_if_faster(final, lengths, options)
    steps = step_rounds(final, d)
    microbatches = [
        Microbatch(
            segments=tuple(_segments(slot, jobs, lengths, options.padding_multiple)),
            noop=not slot,
            step_after=tuple(sorted(jobs[a].name for a in steps.get(index // d, []))),
            replica=index % d if d > 1 else None,
        )
        for index, slot in enumerate(final)
    ]
    adapters = tuple(
        AdapterInfo(
            name=job.name,
            global_batch_size=job.global_batch_size,
            num_samples=len(job.sample_tokens),
            num_global_batches=batches[a],
            sample_tokens=tuple(lengths[a]),
            truncated_samples=truncated[a],
        )
        for a, job in enumerate(jobs)
    )
    stats = _stats(microbatches, adapters, phases, packed, options)
    result = Plan(
        capacity=options.capacity,
        pipeline_stages=options.pipeline_stages,
        padding_multiple=options.padding_multiple,
        data_parallel=d,
        adapters=adapters,
        stats=stats,
        microbatches=tuple(microbatches),
    )
    violations = verify(result)
    if violations:  # a bug in this package, never the user's input
        raise RuntimeError(f"internal error, the plan does not verify: {violations[0]}")
    advice = noop_advice(result, cost_model_given=options.cost_model is not None)
    if advice is not None:
        warnings.warn(advice, SchedWarning, stacklevel=2)
    seconds = time.perf_counter() - start
    final_stats = stats.model_copy(
        update={"merged_samples": merged, "split_batches": split, "workers": workers, "solve_seconds": seconds}
    )
    return result.model_copy(update={"stats": final_stats})
