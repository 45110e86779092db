"""Split global batches that run alone into more, smaller microbatches where a cost model finds that faster.

Between two global batches of one adapter lie ``S - 1`` rounds of other work (the bubble lemma).
When little other work is left (a job with many more global batches than the others, or a plan of
one job), those rounds become no-ops, and in the extreme the pipeline drains after each of an
adapter's global batches. A global batch of ``T`` tokens in ``k`` microbatches then takes about

    time(k) = (k + S - 1) (1 + b) (fixed + per_token T / k)

(``b`` the backward factor): the drain costs ``S - 1`` microbatch times, each shorter with more,
smaller microbatches, while every microbatch adds its fixed cost. The packer minimises microbatches
(its objective counts slots, not seconds), so only a cost model can say when smaller is faster; with
the default :class:`~lorafusion_sched.models.CostModel` the best ``k`` is several times a packing
to capacity, with a profiled one (large fixed costs) often the packing itself.

Two ways of splitting are tried, and :func:`fastest_with_splits` keeps whichever makes the whole
plan simulate fastest (the plan as it was included):

* **Per global batch, before a drain** (:func:`split_lone_batches`): a global batch (or the
  global batches of a group, which share microbatches) whose microbatches follow one another and
  are followed by ``S - 1`` rounds of no-ops (or the end of the plan). Its samples are dealt into
  ``k + 1``, ``k + 2``, ... microbatches and each drained pipeline simulated; the fastest count is
  kept, and the search stops :data:`PATIENCE` counts past it.
* **The lone tail** (:func:`split_lone_tail`): the microbatches at the end of the plan that hold
  one adapter each, where no-ops are spread between several adapters' batches and no single batch
  is followed by a whole drain (two long jobs left by short ones, with 2 replicas, for one).
  Every global batch there is dealt into microbatches of about ``capacity / n`` tokens, for the
  ``n`` (1 to :data:`MAX_DIVISOR`) with which that part of the plan simulates fastest.

Samples are dealt longest first, each to the least loaded microbatch, and a split that would put a
microbatch over the capacity is not made. The sequence is laid out again with the fewest no-ops its
order allows. A split changes no optimizer step: a global batch keeps its samples.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lorafusion_sched.models import CostModel
from lorafusion_sched.packing.problem import round_up
from lorafusion_sched.sequence import Slot, insert_noops
from lorafusion_sched.simulate import sequence_seconds

__all__ = ["MAX_DIVISOR", "PATIENCE", "Splitting", "fastest_with_splits", "split_lone_batches", "split_lone_tail"]

PATIENCE = 4
"""Microbatch counts (divisors for the tail) tried past the fastest so far before a search stops."""

MAX_DIVISOR = 16
"""The smallest microbatch the tail's split aims at is ``capacity / MAX_DIVISOR`` tokens."""


@dataclass(frozen=True, slots=True)
class Splitting:
    """What splitting needs to know: the samples' lengths, the microbatch limits, the pipeline and its costs.

    Attributes:
        lengths: Token lengths per adapter (as scheduled).
        capacity: Token capacity of a microbatch, padding included.
        padding: Each segment's padding multiple.
        stages: Pipeline stages ``S``.
        replicas: Data-parallel replicas ``d``.
        cost: Seconds per microbatch.
    """

    lengths: Sequence[Sequence[int]]
    capacity: int
    padding: int
    stages: int
    replicas: int
    cost: CostModel

    def padded(self, adapter: int, samples: Sequence[int]) -> int:
        """Padded tokens of one segment."""
        return round_up(sum(self.lengths[adapter][s] for s in samples), self.padding)

    def seconds(self, sequence: Sequence[Slot]) -> float:
        """Simulated makespan of a laid-out sequence (no-ops empty)."""
        return sequence_seconds([self.size(slot) for slot in sequence], self.stages, self.replicas, self.cost)

    def laid_out(self, compact: Sequence[Slot]) -> list[Slot]:
        """``compact`` (no no-ops) with the fewest no-ops its order allows, in whole rounds."""
        return [{} if i is None else compact[i] for i in insert_noops(compact, self.stages, self.replicas)]

    def size(self, slot: Slot) -> int:
        """Padded tokens of one microbatch (0 for a no-op)."""
        return sum(self.padded(a, samples) for a, (_g, samples) in slot.items())

    def deal(self, unit: Sequence[Slot], count: int) -> list[Slot] | None:
        """``unit``'s samples in ``count`` microbatches of near-equal tokens.

        Longest sample first, each to the least loaded microbatch. Each sample stays with its
        adapter's global batch; a microbatch holds one segment per adapter.

        Returns:
            The microbatches in order of their first (adapter, sample); ``None`` if one would exceed
            the capacity.
        """
        items = sorted(
            (
                (adapter, batch, sample)
                for slot in unit
                for adapter, (batch, samples) in slot.items()
                for sample in samples
            ),
            key=lambda item: (-self.lengths[item[0]][item[2]], item[0], item[2]),
        )
        heap: list[tuple[int, int]] = [(0, bin_) for bin_ in range(count)]
        bins: list[Slot] = [{} for _ in range(count)]
        for adapter, batch, sample in items:
            load, bin_ = heapq.heappop(heap)
            bins[bin_].setdefault(adapter, (batch, []))[1].append(sample)
            heapq.heappush(heap, (load + self.lengths[adapter][sample], bin_))
        dealt = [{a: (g, sorted(samples)) for a, (g, samples) in sorted(b.items())} for b in bins if b]
        if max(self.size(slot) for slot in dealt) > self.capacity:
            return None
        return sorted(dealt, key=lambda slot: min((a, samples[0]) for a, (_g, samples) in slot.items()))


def _lone_units(slots: Sequence[Slot], stages: int, replicas: int) -> list[list[int]]:
    """The slot indices of every lone unit followed by a drain.

    A unit: the global batches that share microbatches, joined (one global batch, or a group's).
    It is lone when no adapter has two global batches in it and no other microbatch lies between
    its microbatches, and followed by a drain when ``S - 1`` rounds of no-ops (or the end of the
    plan) follow its last round.
    """
    parent: dict[tuple[int, int], tuple[int, int]] = {}

    def root(key: tuple[int, int]) -> tuple[int, int]:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for slot in slots:
        keys = [(adapter, batch) for adapter, (batch, _samples) in slot.items()]
        for key in keys:
            parent.setdefault(key, key)
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
    units: dict[tuple[int, int], list[int]] = {}
    adapters: dict[tuple[int, int], list[int]] = {}
    for index, slot in enumerate(slots):
        if slot:
            first = root(next((a, g) for a, (g, _s) in slot.items()))
            units.setdefault(first, []).append(index)
    for key in parent:
        adapters.setdefault(root(key), []).append(key[0])
    candidates = []
    for unit, indices in units.items():
        if len(set(adapters[unit])) < len(adapters[unit]):
            continue
        if any(slots[i] for i in range(indices[0], indices[-1]) if i not in indices):
            continue
        last_round = indices[-1] // replicas
        if any(slots[(last_round + 1) * replicas : (last_round + stages) * replicas]):
            continue
        candidates.append(indices)
    return candidates


def _fastest_split(unit: list[Slot], how: Splitting, hint: int) -> list[Slot]:
    """The split of ``unit``'s samples whose drained pipeline is fastest (``unit`` itself on a tie).

    Counts above ``k`` are tried from ``hint`` (the best count of the previous unit of the same
    adapters, or ``k + 1``) up, then from below ``hint`` down, each way until :data:`PATIENCE` in a
    row are no faster than the best so far. The time is flat and uneven near its least (deals of
    whole samples, padding), so a closed-form optimum of the formula above lands a few percent off
    (``capacity`` 16,384, one ``xsum`` global batch of 64: least at 22 microbatches, formula 33, 3%
    slower there), while the global batches of one job mostly share their best count.
    """

    def seconds(split: list[Slot]) -> float:
        return sequence_seconds([how.size(slot) for slot in split], how.stages, how.replicas, how.cost)

    lowest, highest = len(unit) + 1, sum(len(samples) for slot in unit for _g, samples in slot.values())
    best, best_seconds = unit, seconds(unit)
    for start, step in ((max(lowest, min(hint, highest)), 1), (min(hint, highest + 1) - 1, -1)):
        misses, count = 0, start
        while lowest <= count <= highest and misses < PATIENCE:
            split = how.deal(unit, count)
            if split is not None and (candidate := seconds(split)) < best_seconds:
                best, best_seconds, misses = split, candidate, 0
            else:
                misses += 1
            count += step
    return best


def split_lone_batches(slots: Sequence[Slot], how: Splitting) -> list[Slot]:
    """Split every lone global batch (or group's) followed by a drain where its drained pipeline is then faster.

    Args:
        slots: A valid sequence, no-ops empty, in whole rounds of ``how.replicas``.
        how: Lengths, limits, pipeline and costs.

    Returns:
        The new sequence (no-ops empty, whole rounds, valid under the bubble lemma); ``slots``
        unchanged (as a new list) when no split pays.
    """
    replacement: dict[int, list[Slot]] = {}
    hints: dict[frozenset[int], int] = {}
    for indices in _lone_units(slots, how.stages, how.replicas):
        unit = [slots[i] for i in indices]
        adapters = frozenset(a for slot in unit for a in slot)
        split = _fastest_split(unit, how, hints.get(adapters, len(unit) + 1))
        if split is not unit:
            hints[adapters] = len(split)
            replacement[indices[0]] = split
            replacement.update((i, []) for i in indices[1:])
    if not replacement:
        return list(slots)
    return how.laid_out([new for index, slot in enumerate(slots) if slot for new in replacement.get(index, [slot])])


def _tail_split(tail: Sequence[Slot], target: float, how: Splitting) -> list[Slot]:
    """``tail`` (one adapter per slot) with each global batch dealt into microbatches of about ``target`` tokens.

    A batch's new microbatches take the places of its old ones in order, the extra ones after its
    last; a batch that would not fit the capacity so, or is already split finer, stays as it is.
    """
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for slot in tail:
        [(adapter, (batch, samples))] = slot.items()
        groups.setdefault((adapter, batch), []).append(samples)
    dealt: dict[tuple[int, int], list[list[int]]] = {}
    for (adapter, batch), old in groups.items():
        samples = sorted(s for group in old for s in group)
        count = min(len(samples), math.ceil(sum(how.lengths[adapter][s] for s in samples) / target))
        split = how.deal([{adapter: (batch, samples)}], count) if count > len(old) else None
        dealt[(adapter, batch)] = old if split is None else [slot[adapter][1] for slot in split]
    remaining = {key: len(old) for key, old in groups.items()}
    out: list[Slot] = []
    for slot in tail:
        [(adapter, (batch, _samples))] = slot.items()
        key = (adapter, batch)
        remaining[key] -= 1
        taken = len(groups[key]) - remaining[key] - 1
        new = dealt[key]
        chunk = new[taken:] if remaining[key] == 0 else new[taken : taken + 1]
        out.extend({adapter: (batch, group)} for group in chunk)
    return out


def _only_drains(slots: Sequence[Slot], head: int, how: Splitting) -> bool:
    """Whether every no-op after the first ``head`` microbatches follows a lone global batch in its drain.

    Those are what :func:`split_lone_batches` shortens; the tail's split would only repeat it, at
    the cost of simulating the tail once per divisor.
    """
    covered: set[int] = set()
    for indices in _lone_units(slots, how.stages, how.replicas):
        covered.update(range(indices[-1] + 1, (indices[-1] // how.replicas + how.stages) * how.replicas))
    seen = 0
    for index, slot in enumerate(slots):
        if slot:
            seen += 1
        elif seen >= head and index not in covered:
            return False
    return True


def split_lone_tail(slots: Sequence[Slot], how: Splitting) -> list[Slot]:
    """Split the global batches of the plan's lone tail into the microbatch size that simulates fastest.

    The tail: the microbatches at the end of the plan that hold one adapter each, less any global
    batch that began before them. A tail whose no-ops all lie in the drains after lone global
    batches is left to :func:`split_lone_batches`. Its global batches are dealt into microbatches
    of about ``capacity / n`` tokens for ``n = 1, 2, ..., MAX_DIVISOR`` (a batch already in more
    is kept), each sequence laid out again, and the one whose tail simulates fastest kept; the
    search stops :data:`PATIENCE` divisors past the fastest.

    Args:
        slots: A valid sequence, no-ops empty, in whole rounds of ``how.replicas``.
        how: Lengths, limits, pipeline and costs.

    Returns:
        The new sequence; ``slots`` unchanged (as a new list) when no split pays.
    """
    compact = [slot for slot in slots if slot]
    start = len(compact)
    while start and len(compact[start - 1]) == 1:
        start -= 1
    started = {(a, g) for slot in compact[:start] for a, (g, _samples) in slot.items()}
    while start < len(compact) and next(iter((a, g) for a, (g, _s) in compact[start].items())) in started:
        start += 1  # a global batch that began before the tail keeps its microbatches
    head, tail = compact[:start], compact[start:]
    if not tail or _only_drains(slots, len(head), how):
        return list(slots)

    def tail_seconds(sequence: list[Slot]) -> float:
        seen, cut = 0, 0
        for index, slot in enumerate(sequence):
            if slot:
                if seen == len(head):
                    cut = index - index % how.replicas
                    break
                seen += 1
        return how.seconds(sequence[cut:])

    best, best_seconds = list(slots), tail_seconds(list(slots))
    misses = 0
    for divisor in range(1, MAX_DIVISOR + 1):
        candidate = how.laid_out(head + _tail_split(tail, how.capacity / divisor, how))
        if (seconds := tail_seconds(candidate)) < best_seconds:
            best, best_seconds, misses = candidate, seconds, 0
        else:
            misses += 1
            if misses == PATIENCE:
                break
    return best


def _split_count(before: Sequence[Slot], after: Sequence[Slot]) -> int:
    """Global batches whose microbatches (what each holds of any adapter) differ between the two sequences."""

    def microbatches(sequence: Sequence[Slot]) -> dict[tuple[int, int], list[tuple[tuple[int, ...], ...]]]:
        out: dict[tuple[int, int], list[tuple[tuple[int, ...], ...]]] = {}
        for slot in sequence:
            held = tuple(sorted((a, g, *samples) for a, (g, samples) in slot.items()))
            for adapter, (batch, _samples) in slot.items():
                out.setdefault((adapter, batch), []).append(held)
        return {key: sorted(held) for key, held in out.items()}

    old, new = microbatches(before), microbatches(after)
    return sum(1 for key, held in new.items() if old[key] != held)


def fastest_with_splits(slots: list[Slot], how: Splitting) -> tuple[list[Slot], int]:
    """The fastest of ``slots`` and its splits, by the whole plan's simulated makespan.

    Candidates: the sequence as it is, :func:`split_lone_batches` of it and :func:`split_lone_tail`
    of it. A split is kept only if strictly faster. (Splitting the tail's result per global batch
    too gained at most 0.6% over the better of the two on the benchmark's workloads, for twice the
    time.)

    Returns:
        The sequence and the number of global batches split.
    """
    candidates = [split_lone_batches(slots, how), split_lone_tail(slots, how)]
    best, best_seconds = slots, how.seconds(slots)
    for candidate in candidates:
        if candidate != best and (seconds := how.seconds(candidate)) < best_seconds:
            best, best_seconds = candidate, seconds
    return best, _split_count(slots, best) if best is not slots else 0
