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
plan simulate fastest, if at least :data:`MIN_GAIN` times faster than the plan as it was:

* **Per global batch, before a drain** (:func:`split_lone_batches`): a global batch (or the
  global batches of a group, which share microbatches) whose microbatches follow one another and
  are followed by ``S - 1`` rounds of no-ops (or the end of the plan). Its samples are dealt into
  more microbatches and each drained pipeline simulated; the fastest count is kept
  (:func:`_fastest_split` says which counts are tried).
* **The lone tail** (:func:`split_lone_tail`): the microbatches at the end of the plan that hold
  one adapter each, or that follow every adapter that ended early (the jobs left at the end,
  whose microbatches may mix them), where no-ops are spread between several adapters' batches and
  no single batch is followed by a whole drain (two long jobs left by short ones, with 2 replicas,
  or two jobs of one length alone). Every global batch there is dealt into microbatches of about
  ``capacity / n`` tokens, one adapter each, for the ``n`` (1 to :data:`MAX_DIVISOR`) with which
  the tail's first global batches simulate fastest.

Samples are dealt longest first, each to the least loaded microbatch, and a split that would put a
microbatch over the capacity is not made. The split sequence is laid out again with the fewest
no-ops its order allows, and reordered by the planner's list schedules where that is shorter. A split changes no
optimizer step: a global batch keeps its samples.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lorafusion_sched.models import CostModel
from lorafusion_sched.packing.problem import round_up
from lorafusion_sched.sequence import Slot, fewest_noops, insert_noops
from lorafusion_sched.simulate import sequence_seconds

__all__ = [
    "GRID_STEP",
    "MAX_DIVISOR",
    "MIN_GAIN",
    "REFINE",
    "TAIL_WINDOW",
    "Splitting",
    "fastest_with_splits",
    "split_lone_batches",
    "split_lone_tail",
]

GRID_STEP = 1.15
"""Ratio between the microbatch counts a global batch's first search tries, before refining around the best."""

REFINE = 2
"""Counts tried either side of the best grid count."""

MAX_DIVISOR = 16
"""The smallest microbatch the tail's split aims at is ``capacity / MAX_DIVISOR`` tokens."""

MIN_GAIN = 1.03
"""A split is kept only if the whole plan simulates at least this much faster.

A model misleads by a few percent. A LLaMa-3.1-8B pipeline stage on an H200 ran its forward in
46 ms at 1,024 and 4,096 tokens alike, 47 ms at 2,048; with 2 replicas a line fitted to these
times predicted splits 0.1-1.1% faster that the measured times themselves make up to 3.3% slower.
Measured points (``CostModel.forward_points``) follow such a stage, but were measured on one stage
alone, not in a running pipeline."""

TAIL_WINDOW = 32
"""Global batches of the tail on which the tail's divisor is chosen (then applied to all of them)."""


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


def _grid(lowest: int, highest: int) -> list[int]:
    """``lowest`` to ``highest`` in steps of about :data:`GRID_STEP` times (every count while they are small)."""
    counts, count = [], lowest
    while count <= highest:
        counts.append(count)
        count = max(count + 1, round(count * GRID_STEP))
    return counts


def _similar(unit: list[Slot], how: Splitting) -> tuple[frozenset[int], int, int]:
    """What makes two units' best counts alike: their adapters, samples, and tokens to within 5%."""
    adapters = frozenset(a for slot in unit for a in slot)
    samples = sum(len(samples) for slot in unit for _g, samples in slot.values())
    tokens = sum(how.size(slot) for slot in unit)
    return adapters, samples, round(math.log(max(tokens, 1)) / math.log(1.05))


def _fastest_split(unit: list[Slot], how: Splitting, known: dict[tuple[frozenset[int], int, int], int]) -> list[Slot]:
    """The split of ``unit``'s samples whose drained pipeline is fastest (``unit`` itself on a tie).

    The time against the count is flat and uneven near its least (deals of whole samples,
    padding): a closed-form optimum of the formula above lands a few percent off (``capacity``
    16,384, one ``xsum`` global batch of 64: least at 22 microbatches, formula 33, 3% slower there),
    and a search that stops at the first counts no faster stops in a dip (9.8% off for a global
    batch of 512). So the first unit of its kind tries a grid of counts (:func:`_grid`) and the
    :data:`REFINE` counts either side of the grid's best; a similar unit (``known``, by
    :func:`_similar`) tries only that unit's best count and the counts next to it.
    """
    lowest, highest = len(unit) + 1, sum(len(samples) for slot in unit for _g, samples in slot.values())
    best, best_seconds, best_count = unit, how.seconds(unit), len(unit)

    kind = _similar(unit, how)

    def counts_to_try() -> Iterator[int]:
        if kind in known:
            yield from range(known[kind] - 1, known[kind] + 2)
        else:
            yield from _grid(lowest, highest)
            yield from range(best_count - REFINE, best_count + REFINE + 1)  # the grid's best, read once it is done

    for count in counts_to_try():
        if lowest <= count <= highest and count != best_count:
            split = how.deal(unit, count)
            if split is not None and (candidate := how.seconds(split)) < best_seconds:
                best, best_seconds, best_count = split, candidate, count
    known.setdefault(kind, best_count)
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
    known: dict[tuple[frozenset[int], int, int], int] = {}
    for indices in _lone_units(slots, how.stages, how.replicas):
        unit = [slots[i] for i in indices]
        split = _fastest_split(unit, how, known)
        if split is not unit:
            replacement[indices[0]] = split
            replacement.update((i, []) for i in indices[1:])
    if not replacement:
        return list(slots)
    return how.laid_out([new for index, slot in enumerate(slots) if slot for new in replacement.get(index, [slot])])


def _tail_split(tail: Sequence[Slot], target: float, how: Splitting, keep: set[tuple[int, int]]) -> list[Slot]:
    """``tail`` with each global batch dealt into microbatches of about ``target`` tokens.

    A batch's new microbatches take the places of its old ones in order, the extra ones after its
    last. A batch in ``keep``, one that would not fit the capacity so, or one already split finer,
    stays as it is. A microbatch that held several batches stays as it was if none of them is
    split, and otherwise gives way to each batch's own new microbatches, one adapter each.
    """
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for slot in tail:
        for adapter, (batch, samples) in slot.items():
            groups.setdefault((adapter, batch), []).append(samples)
    dealt: dict[tuple[int, int], list[list[int]]] = {}
    for (adapter, batch), old in groups.items():
        samples = sorted(s for group in old for s in group)
        count = min(len(samples), math.ceil(sum(how.lengths[adapter][s] for s in samples) / target))
        wanted = (adapter, batch) not in keep and count > len(old)
        split = how.deal([{adapter: (batch, samples)}], count) if wanted else None
        dealt[(adapter, batch)] = old if split is None else [slot[adapter][1] for slot in split]
    seen = dict.fromkeys(groups, 0)
    out: list[Slot] = []
    for slot in tail:
        pieces: list[Slot] = []
        for adapter, (batch, _samples) in slot.items():
            key = (adapter, batch)
            taken, seen[key] = seen[key], seen[key] + 1
            last = seen[key] == len(groups[key])
            pieces.extend({adapter: (batch, group)} for group in dealt[key][taken : None if last else taken + 1])
        if all(dealt[(adapter, batch)] is groups[(adapter, batch)] for adapter, (batch, _s) in slot.items()):
            out.append(slot)
        else:
            out.extend(pieces)
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


def _window(tail: Sequence[Slot], batches: int) -> list[Slot]:
    """The tail's microbatches up to the end of its first ``batches`` global batches (in order of their start)."""
    started: list[tuple[int, int]] = []
    last: dict[tuple[int, int], int] = {}
    for index, slot in enumerate(tail):
        for adapter, (batch, _samples) in slot.items():
            if (adapter, batch) not in last:
                started.append((adapter, batch))
            last[(adapter, batch)] = index
    if len(started) <= batches:
        return list(tail)
    return list(tail[: max(last[key] for key in started[:batches]) + 1])


def _tail_start(compact: Sequence[Slot]) -> int:
    """Where the plan's lone tail begins in ``compact`` (no no-ops): the earlier of two starts.

    The microbatches at the end that hold one adapter each; and those after the last microbatch of
    every adapter that ended early, one after whose end another adapter began two or more global
    batches. The second start takes in the jobs left at the end whose microbatches hold several of
    them: two jobs of one length, packed together where one's global batch ends and the other's
    begins.
    """
    single = len(compact)
    while single and len(compact[single - 1]) == 1:
        single -= 1
    last: dict[int, int] = {}
    begins: dict[int, list[int]] = {}  # per adapter, where each global batch begins (they run in order)
    for index, slot in enumerate(compact):
        for adapter, (batch, _samples) in slot.items():
            if len(begins.setdefault(adapter, [])) == batch:
                begins[adapter].append(index)
            last[adapter] = index
    early = [
        end
        for adapter, end in last.items()
        if any(len(starts) - bisect.bisect_right(starts, end) >= 2 for a, starts in begins.items() if a != adapter)
    ]
    return min(single, max(early) + 1 if early else 0)


def split_lone_tail(slots: Sequence[Slot], how: Splitting) -> list[Slot]:
    """Split the global batches of the plan's lone tail into the microbatch size that simulates fastest.

    The tail (:func:`_tail_start`): the microbatches at the end of the plan that hold one adapter
    each, or the jobs left at the end; a global batch that began before it keeps its microbatches.
    A tail whose no-ops all lie in the drains after lone global batches is left to
    :func:`split_lone_batches`. The size is chosen on the tail's
    first :data:`TAIL_WINDOW` global batches (simulated after the rest of the plan, from the round
    of the tail's first microbatch): each is dealt into microbatches of about ``capacity / n``
    tokens for ``n = 1, 2, ..., MAX_DIVISOR`` (a batch already in more is kept), and the fastest
    ``n`` is applied to the whole tail.

    Args:
        slots: A valid sequence, no-ops empty, in whole rounds of ``how.replicas``.
        how: Lengths, limits, pipeline and costs.

    Returns:
        The new sequence; ``slots`` unchanged (as a new list) when no split pays on the window.
    """
    compact = [slot for slot in slots if slot]
    start = _tail_start(compact)
    head, tail = compact[:start], compact[start:]
    if not tail or _only_drains(slots, len(head), how):
        return list(slots)
    keep = {(a, g) for slot in head for a, (g, _samples) in slot.items()}
    window = _window(tail, TAIL_WINDOW)

    def window_seconds(split_window: list[Slot]) -> float:
        laid = how.laid_out(head + split_window)
        seen = 0
        for index, slot in enumerate(laid):
            if slot:
                if seen == len(head):
                    return how.seconds(laid[index - index % how.replicas :])
                seen += 1
        return 0.0

    best_divisor, best_seconds = None, window_seconds(window)
    for divisor in range(1, MAX_DIVISOR + 1):
        if (seconds := window_seconds(_tail_split(window, how.capacity / divisor, how, keep))) < best_seconds:
            best_divisor, best_seconds = divisor, seconds
    if best_divisor is None:
        return list(slots)
    return how.laid_out(head + _tail_split(tail, how.capacity / best_divisor, how, keep))


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

    Candidates: the sequence as it is; :func:`split_lone_batches` of it and :func:`split_lone_tail`
    of it, each in the order the split left it and, where that is shorter, reordered by the
    planner's list schedules (:func:`~lorafusion_sched.sequence.fewest_noops`: more, smaller
    microbatches may fill waits another order leaves). A split is kept only if the whole plan then
    simulates :data:`MIN_GAIN` times faster. (Splitting the tail's result per global batch too
    gained at most 0.6% over the better of the two on the benchmark's workloads, for twice the
    time.)

    Returns:
        The sequence and the number of global batches split.
    """
    best, best_seconds = slots, how.seconds(slots) / MIN_GAIN
    for split in (split_lone_batches(slots, how), split_lone_tail(slots, how)):
        if split == slots:
            continue
        compact = [slot for slot in split if slot]
        reordered = [{} if i is None else compact[i] for i in fewest_noops(compact, how.stages, how.replicas)]
        for candidate in (split, reordered) if len(reordered) < len(split) else (split,):
            if (seconds := how.seconds(candidate)) < best_seconds:
                best, best_seconds = candidate, seconds
    return best, _split_count(slots, best) if best is not slots else 0
