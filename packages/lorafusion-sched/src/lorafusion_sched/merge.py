"""Merge pass across consecutive packing tasks (paper Algorithm 1, lines 12-14).

Each task's microbatches are sorted largest first, so its last one is the least filled. For every
pair of consecutive tasks, the next task's samples are re-packed first-fit decreasing into that
last microbatch (or, when the task was itself emptied into an earlier microbatch, into that one)
followed by the next task's own microbatch slots; the re-packing is kept when it
frees at least one microbatch. Otherwise samples of the next task move into the last microbatch
(whole microbatches first, smallest first; then single samples, longest first). Either way the
capacity holds, a microbatch never gets two global batches of one adapter, and the bubble lemma
still holds.

On 2,560 ``het`` samples (4 adapters, S = 4, C = 4096) moving samples alone removed 1 of 718
microbatches; with the re-packing the plan has 699 (lower bound 687).

Slots keep their positions during the pass (emptied ones stay as empty slots), so the lemma check
is local: a sample of adapter ``a``'s global batch ``h`` may go to round ``r`` only if ``r`` is at
least ``S`` rounds after the last round of ``h - 1`` and not after the last round of ``h`` (the
pass keeps an upper bound of those last rounds). Every intermediate layout therefore satisfies the
lemma. Emptied slots are removed afterwards and no-ops re-inserted
(:func:`lorafusion_sched.sequence.fewest_noops`): in the merged order
:func:`~lorafusion_sched.sequence.insert_noops` inserts the fewest possible, so merging never adds
microbatches to that order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lorafusion_sched.packing.max_tree import Rooms
from lorafusion_sched.packing.problem import round_up
from lorafusion_sched.sequence import Slot

__all__ = ["merge_pass"]


class _Merger:
    def __init__(
        self,
        slots: list[Slot],
        lengths: Sequence[Sequence[int]],
        capacity: int,
        padding: int,
        stages: int,
        replicas: int,
    ) -> None:
        self.slots = slots
        self.lengths = lengths
        self.capacity = capacity
        self.padding = padding
        self.stages = stages
        self.replicas = replicas
        self.last_round: dict[tuple[int, int], int] = {}
        for index, slot in enumerate(slots):
            for adapter, (batch, _samples) in slot.items():
                self.last_round[(adapter, batch)] = index // replicas

    def tokens(self, slot: Slot) -> dict[int, int]:
        return {a: sum(self.lengths[a][s] for s in samples) for a, (_b, samples) in slot.items()}

    def size(self, per_adapter: dict[int, int]) -> int:
        return sum(round_up(t, self.padding) for t in per_adapter.values())

    def lemma_ok(self, position: int, adapter: int, batch: int) -> bool:
        previous = self.last_round.get((adapter, batch - 1))
        return previous is None or position // self.replicas - previous >= self.stages

    def movable(self, target: int, adapter: int, batch: int) -> bool:
        present = self.slots[target].get(adapter)
        if present is not None and present[0] != batch:
            return False
        return self.lemma_ok(target, adapter, batch)

    def repack(self, target: int, sources: list[int]) -> int:
        """Re-pack the sources' samples into ``target`` then the source slots; keep it if it frees a slot.

        First fit decreasing under the pass's rules (one global batch per adapter in a slot, the
        bubble lemma, no slot after the batch's last round), the slot with room found through
        :class:`~lorafusion_sched.packing.max_tree.Rooms`.

        Returns:
            Samples moved into ``target`` (0 when the re-packing was not kept).
        """
        items = sorted(
            ((a, b, s) for q in sources for a, (b, samples) in self.slots[q].items() for s in samples),
            key=lambda c: (-self.lengths[c[0]][c[2]], c[0], c[2]),
        )
        positions = [target, *sources]
        contents: list[Slot] = [{a: (b, list(ss)) for a, (b, ss) in self.slots[target].items()}]
        contents += [{} for _ in sources]
        totals = [self.tokens(self.slots[target])] + [{} for _ in sources]
        rooms = Rooms((a for a, _b, _s in items), self.capacity, self.padding)
        for per_adapter in totals:
            rooms.append(self.size(per_adapter), per_adapter)
        moved = 0
        for a, b, s in items:
            length = self.lengths[a][s]
            j = rooms.first(a, length)  # the first slot with room; then the other rules
            while j is not None:
                if positions[j] // self.replicas > self.last_round[(a, b)]:
                    # Later than the batch's last round would shorten the gap to batch b + 1; every
                    # later slot is later still, so the sample has no place.
                    return 0
                present = contents[j].get(a)
                if present[0] == b if present is not None else self.lemma_ok(positions[j], a, b):
                    break
                j = rooms.first(a, length, j + 1)
            if j is None:
                return 0
            contents[j].setdefault(a, (b, []))[1].append(s)
            totals[j][a] = totals[j].get(a, 0) + length
            rooms.set(j, self.size(totals[j]), totals[j])
            moved += j == 0
        if sum(1 for c in contents[1:] if c) >= sum(1 for q in sources if self.slots[q]):
            return 0
        for position, slot in zip(positions, contents, strict=True):
            self.slots[position] = {a: (b, sorted(ss)) for a, (b, ss) in slot.items()}
        return moved

    def move(self, target: int, source: int, adapter: int, samples: list[int]) -> None:
        batch, remaining = self.slots[source][adapter]
        left = [s for s in remaining if s not in samples]
        if left:
            self.slots[source][adapter] = (batch, left)
        else:
            del self.slots[source][adapter]
        _b, present = self.slots[target].get(adapter, (batch, []))
        self.slots[target][adapter] = (batch, sorted([*present, *samples]))

    def absorb(self, target: int, sources: list[int]) -> int:
        """Move what fits from ``sources`` (smallest first) into ``target``; returns samples moved."""
        moved = 0
        have = self.tokens(self.slots[target])
        for source in sorted(sources, key=lambda q: (self.size(self.tokens(self.slots[q])), q)):
            slot = self.slots[source]
            if not slot:
                continue
            merged = dict(have)
            for a, t in self.tokens(slot).items():
                merged[a] = merged.get(a, 0) + t
            if self.size(merged) <= self.capacity and all(self.movable(target, a, b) for a, (b, _s) in slot.items()):
                for a, (_b, samples) in sorted(slot.items()):
                    moved += len(samples)
                    self.move(target, source, a, list(samples))
                have = merged
                continue
            candidates = sorted(
                ((a, b, s) for a, (b, samples) in slot.items() for s in samples),
                key=lambda c: (-self.lengths[c[0]][c[2]], c[0], c[2]),
            )
            for a, b, s in candidates:
                trial = dict(have)
                trial[a] = trial.get(a, 0) + self.lengths[a][s]
                if self.size(trial) <= self.capacity and self.movable(target, a, b):
                    self.move(target, source, a, [s])
                    have = trial
                    moved += 1
            break
        return moved


def merge_pass(
    slots: list[Slot],
    task_of: Sequence[int | None],
    lengths: Sequence[Sequence[int]],
    *,
    capacity: int,
    padding: int,
    stages: int,
    replicas: int,
) -> int:
    """Merge in place; emptied slots stay empty (callers drop them and re-insert no-ops).

    Args:
        slots: The sequence (no-ops included), changed in place.
        task_of: Task id of each slot, ``None`` for no-ops; tasks appear in increasing order.
        lengths: Sample lengths per adapter.
        capacity: Microbatch capacity.
        padding: Padding multiple.
        stages: Pipeline stages.
        replicas: Data-parallel degree.

    Returns:
        Number of samples moved.
    """
    members: dict[int, list[int]] = {}
    for index, task in enumerate(task_of):
        if task is not None:
            members.setdefault(task, []).append(index)
    order = sorted(members)
    merger = _Merger(slots, lengths, capacity, padding, stages, replicas)
    moved = 0
    target: int | None = None
    for current, following in itertools.pairwise(order):
        filled = [q for q in members[current] if slots[q]]
        if filled:
            target = filled[-1]
        if target is None:
            continue
        # A task emptied into an earlier target leaves that target open for the next task: small
        # tasks (one sample each, say) then share microbatches beyond pairs.
        gained = merger.repack(target, members[following])
        moved += gained if gained else merger.absorb(target, members[following])
    return moved
