"""Split a global batch that runs alone into more, smaller microbatches where a cost model finds that faster.

Between two global batches of one adapter lie ``S - 1`` rounds of other work (the bubble lemma).
When no other adapter has work left (a job with many more global batches than the others, or a plan
of one job), those rounds are no-ops and the pipeline drains after each of the adapter's global
batches. A global batch of ``T`` tokens in ``k`` microbatches then takes about

    time(k) = (k + S - 1) (1 + b) (fixed + per_token T / k)

(``b`` the backward factor): the drain costs ``S - 1`` microbatch times, each shorter with more,
smaller microbatches, while every microbatch adds its fixed cost. The packer minimises microbatches
(its objective counts slots, not seconds), so only a cost model can say when smaller is faster; with
the default :class:`~lorafusion_sched.models.CostModel` the best ``k`` is several times a packing
to capacity, with a profiled one (large fixed costs) often the packing itself.

A global batch is a candidate when its microbatches hold its adapter's samples alone, follow one
another (no other microbatch between them) and are followed by ``S - 1`` rounds of no-ops or the end
of the plan. For ``m = k + 1, k + 2, ...`` its samples are dealt into ``m`` microbatches (longest
first, each to the least loaded; none over the capacity) and the drained pipeline of those
microbatches is simulated; the fastest ``m`` is kept (``k`` on a tie), and the search stops after
:data:`PATIENCE` values of ``m`` without a faster one. The sequence is then laid out again with the
fewest no-ops its order allows. The simulation of one global batch alone ignores the overlap with
the work before it, so the planner keeps the split sequence only if the whole plan simulates faster.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from lorafusion_sched.models import CostModel
from lorafusion_sched.packing.problem import round_up
from lorafusion_sched.sequence import Slot, insert_noops
from lorafusion_sched.simulate import sequence_seconds

__all__ = ["PATIENCE", "split_lone_batches"]

PATIENCE = 3
"""Values of ``m`` tried past the fastest so far before the search for a global batch stops."""


def _lone_batches(slots: Sequence[Slot], stages: int, replicas: int) -> list[list[int]]:
    """The candidates' slot indices: lone, consecutive among the microbatches, followed by a drain."""
    where: dict[tuple[int, int], list[int]] = {}
    for index, slot in enumerate(slots):
        for adapter, (batch, _samples) in slot.items():
            where.setdefault((adapter, batch), []).append(index)
    candidates = []
    for indices in where.values():
        if any(len(slots[i]) > 1 for i in indices):
            continue
        if any(slots[i] for i in range(indices[0], indices[-1]) if i not in indices):
            continue
        last_round = indices[-1] // replicas
        if any(slots[(last_round + 1) * replicas : (last_round + stages) * replicas]):
            continue
        candidates.append(indices)
    return candidates


def _deal(samples: Sequence[int], lengths: Sequence[int], count: int) -> list[list[int]]:
    """``samples`` in ``count`` groups of near-equal tokens: longest first, each to the least loaded group."""
    heap: list[tuple[int, int]] = [(0, group) for group in range(count)]
    groups: list[list[int]] = [[] for _ in range(count)]
    for sample in sorted(samples, key=lambda s: (-lengths[s], s)):
        load, group = heapq.heappop(heap)
        groups[group].append(sample)
        heapq.heappush(heap, (load + lengths[sample], group))
    return sorted((sorted(group) for group in groups if group), key=lambda group: group[0])


def _fastest_split(
    groups: list[list[int]],
    lengths: Sequence[int],
    capacity: int,
    padding: int,
    stages: int,
    replicas: int,
    cost: CostModel,
) -> list[list[int]]:
    """The split of ``groups``' samples whose drained pipeline is fastest (``groups`` itself on a tie)."""

    def padded(split: list[list[int]]) -> list[int]:
        return [round_up(sum(lengths[s] for s in group), padding) for group in split]

    samples = sorted(s for group in groups for s in group)
    best, best_seconds = groups, sequence_seconds(padded(groups), stages, replicas, cost)
    misses = 0
    for count in range(len(groups) + 1, len(samples) + 1):
        split = _deal(samples, lengths, count)
        sizes = padded(split)
        seconds = sequence_seconds(sizes, stages, replicas, cost) if max(sizes) <= capacity else float("inf")
        if seconds < best_seconds:
            best, best_seconds, misses = split, seconds, 0
        else:
            misses += 1
            if misses == PATIENCE:
                break
    return best


def split_lone_batches(
    slots: Sequence[Slot],
    lengths: Sequence[Sequence[int]],
    *,
    capacity: int,
    padding: int,
    stages: int,
    replicas: int,
    cost: CostModel,
) -> tuple[list[Slot], int]:
    """Split every lone global batch followed by a drain where ``cost`` finds more microbatches faster.

    Args:
        slots: A valid sequence, no-ops empty, in whole rounds of ``replicas``.
        lengths: Token lengths per adapter (as scheduled).
        capacity: Token capacity of a microbatch, padding included.
        padding: Each segment's padding multiple.
        stages: Pipeline stages ``S``.
        replicas: Data-parallel replicas ``d``.
        cost: Seconds per microbatch.

    Returns:
        The new sequence (no-ops empty, whole rounds, valid under the bubble lemma) and the number of
        global batches split; ``slots`` unchanged (as a new list) when none is.
    """
    replacement: dict[int, list[Slot]] = {}
    for indices in _lone_batches(slots, stages, replicas):
        adapter = next(iter(slots[indices[0]]))
        batch = slots[indices[0]][adapter][0]
        groups = [list(slots[i][adapter][1]) for i in indices]
        split = _fastest_split(groups, lengths[adapter], capacity, padding, stages, replicas, cost)
        if split is not groups:
            replacement[indices[0]] = [{adapter: (batch, group)} for group in split]
            replacement.update((i, []) for i in indices[1:])
    if not replacement:
        return list(slots), 0
    compact = [new for index, slot in enumerate(slots) if slot for new in replacement.get(index, [slot])]
    order = insert_noops(compact, stages, replicas)
    return [{} if i is None else compact[i] for i in order], sum(1 for new in replacement.values() if new)
