"""The microbatch sequence inside the planner: slots, rounds, no-ops, reordering and optimizer steps.

A slot maps an adapter index to ``(global batch, sample ids)``; an empty slot is a no-op. With
``d`` data-parallel replicas, slot ``i`` runs on replica ``i % d`` at round ``i // d`` (round =
position in that replica's pipeline; ``d = 1`` gives round = index).

The rule for data parallelism: an adapter's gradients are all-reduced over replicas before its
optimizer steps, so every replica must have finished global batch ``g`` before any replica starts
``g + 1``. The bubble lemma is therefore checked on rounds across replicas: the first round of
``g + 1`` is at least ``S`` rounds after the last round of ``g``. Every replica steps the adapter
after its microbatch of that last round (``step_after`` is set on all ``d`` slots of the round),
and the sequence is padded with no-ops to a whole number of rounds.

:func:`insert_noops` inserts the fewest no-ops the given order allows; :func:`fewest_noops` also
tries other orders (:func:`list_schedule`) and keeps the shortest sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

__all__ = ["Slot", "fewest_noops", "insert_noops", "list_schedule", "shortest_possible", "step_rounds"]

Slot = dict[int, tuple[int, list[int]]]
"""Adapter index -> (global batch, sample ids); empty for a no-op."""


def insert_noops(slots: Sequence[Slot], stages: int, replicas: int) -> list[int | None]:
    """Where to put no-ops so every adapter's consecutive global batches are ``S`` rounds apart.

    One left-to-right pass suffices and inserts the fewest no-ops: before each slot it inserts
    just enough no-ops to satisfy the lemma for the adapters in that slot. An insertion only
    delays later slots, so it never breaks a pair already satisfied, and every slot sits at the
    earliest round any valid insertion could give it. Existing no-ops (empty slots) are kept.

    Args:
        slots: The sequence; samples of one adapter appear in global-batch order.
        stages: Pipeline stages ``S``.
        replicas: Data-parallel degree ``d``.

    Returns:
        The new sequence as indices into ``slots``, ``None`` for an inserted no-op, padded to a
        multiple of ``replicas``.
    """
    out: list[int | None] = []
    last: dict[int, tuple[int, int]] = {}
    for index, slot in enumerate(slots):
        need = len(out)
        for adapter, (batch, _samples) in slot.items():
            previous = last.get(adapter)
            if previous is not None and previous[0] != batch:
                need = max(need, (previous[1] + stages) * replicas)
        out.extend([None] * (need - len(out)))
        round_ = len(out) // replicas
        for adapter, (batch, _samples) in slot.items():
            last[adapter] = (batch, round_)
        out.append(index)
    out.extend([None] * (-len(out) % replicas))
    return out


def shortest_possible(count: int, replicas: int) -> int:
    """Length of a sequence of ``count`` slots with no no-ops but the padding to whole rounds."""
    return count + -count % replicas


def list_schedule(
    slots: Sequence[Slot], stages: int, replicas: int, priority: Callable[[int], tuple[int, ...]]
) -> list[int | None]:
    """Reorder the slots where that saves no-ops: list scheduling under the bubble lemma.

    Each adapter's global batches keep their order; the slots of one global batch may change
    places. A slot is *ready* once, for each of its adapters, every slot of the previous global
    batches is placed; it may then go at round ``last round of the previous batch + S`` or later.
    At each position the ready slot that fits there without a no-op and has the smallest
    ``priority`` is placed; when none fits, no-ops are inserted up to the earliest round a ready
    slot fits, and the smallest priority among those that fit there is placed.

    With ``priority(i) = (i,)`` and slots that :func:`insert_noops` leaves without no-ops, the
    sequence is unchanged. Where the given order waits on one adapter while another could run,
    the other runs first: e.g. at a phase boundary, an adapter with global batches still to go
    should not queue behind one finishing its last.

    Args:
        slots: The sequence; no empty slots.
        stages: Pipeline stages ``S``.
        replicas: Data-parallel degree ``d``.
        priority: Slot index -> sort key; smaller goes first among the slots that fit.

    Returns:
        Indices into ``slots`` with ``None`` for a no-op, padded to a multiple of ``replicas``;
        :func:`insert_noops` adds nothing to it.

    Raises:
        ValueError: An empty slot, or slots in no order that keeps every adapter's global
            batches in order (one slot needs another's later batch first).
    """
    if not all(slots):
        raise ValueError("list_schedule takes no empty slots: drop the no-ops first")
    remaining: dict[tuple[int, int], int] = {}
    slots_of: dict[tuple[int, int], list[int]] = {}
    batches: dict[int, set[int]] = {}
    for index, slot in enumerate(slots):
        for adapter, (batch, _samples) in slot.items():
            remaining[(adapter, batch)] = remaining.get((adapter, batch), 0) + 1
            slots_of.setdefault((adapter, batch), []).append(index)
            batches.setdefault(adapter, set()).add(batch)
    pending = {a: sorted(b, reverse=True) for a, b in batches.items()}  # popped from the end
    current = {a: b[-1] for a, b in pending.items()}
    ready_round: dict[int, int] = {}  # adapter -> first round its current batch may use

    waiting: list[tuple[int, tuple[int, ...], int]] = []  # (earliest round, priority, slot)
    fits: list[tuple[tuple[int, ...], int]] = []  # (priority, slot) that fit at the current round

    def push_if_ready(index: int) -> None:
        slot = slots[index]
        if all(current.get(a) == b for a, (b, _s) in slot.items()):
            earliest = max(ready_round.get(a, 0) for a in slot)
            heapq.heappush(waiting, (earliest, priority(index), index))

    for index in range(len(slots)):
        push_if_ready(index)
    out: list[int | None] = []
    while waiting or fits:
        round_ = len(out) // replicas
        if not fits:
            round_ = max(round_, waiting[0][0])
            out.extend([None] * (round_ * replicas - len(out)))
        while waiting and waiting[0][0] <= round_:
            _earliest, key, index = heapq.heappop(waiting)
            heapq.heappush(fits, (key, index))
        _key, index = heapq.heappop(fits)
        out.append(index)
        for adapter, (batch, _samples) in slots[index].items():
            remaining[(adapter, batch)] -= 1
            if remaining[(adapter, batch)] == 0:
                pending[adapter].pop()
                ready_round[adapter] = round_ + stages
                if pending[adapter]:
                    current[adapter] = pending[adapter][-1]
                    for later in slots_of[(adapter, current[adapter])]:
                        push_if_ready(later)
                else:
                    del current[adapter]
    if len(out) - out.count(None) < len(slots):
        raise ValueError("the slots' global batches cannot all be kept in order: one slot needs another's later batch")
    out.extend([None] * (-len(out) % replicas))
    return out


def fewest_noops(slots: Sequence[Slot], stages: int, replicas: int) -> list[int | None]:
    """The shortest of three sequences: the given order, and two list schedules of it.

    :func:`insert_noops` keeps the given order. :func:`list_schedule` runs twice: with the given
    order as priority, and with the slots whose adapters have the most global batches still to
    come first (then the given order): an adapter with a long way to go should not wait behind one
    that is finishing. Ties keep the earlier candidate, so a sequence without no-ops is returned
    unchanged.

    Args:
        slots: The sequence; no empty slots.
        stages: Pipeline stages ``S``.
        replicas: Data-parallel degree ``d``.

    Returns:
        Indices into ``slots`` with ``None`` for a no-op, padded to a multiple of ``replicas``.

    Raises:
        ValueError: An empty slot; or, where the given order needs no-ops, slots in no order
            that keeps every adapter's global batches in order (as :func:`list_schedule`).
    """
    if not all(slots):
        raise ValueError("fewest_noops takes no empty slots: drop the no-ops first")
    best = insert_noops(slots, stages, replicas)
    if len(best) == shortest_possible(len(slots), replicas):
        return best
    last_batch: dict[int, int] = {}
    for slot in slots:
        for adapter, (batch, _samples) in slot.items():
            last_batch[adapter] = max(batch, last_batch.get(adapter, batch))

    def to_go(index: int) -> tuple[int, ...]:
        return (-max(last_batch[a] - b for a, (b, _s) in slots[index].items()), index)

    for priority in ((lambda index: (index,)), to_go):
        candidate = list_schedule(slots, stages, replicas, priority)
        if len(candidate) < len(best):
            best = candidate
    return best


def step_rounds(slots: Sequence[Slot], replicas: int) -> dict[int, list[int]]:
    """Round -> adapters whose global batch ends in that round (they step after it)."""
    last: dict[tuple[int, int], int] = {}
    for index, slot in enumerate(slots):
        for adapter, (batch, _samples) in slot.items():
            last[(adapter, batch)] = index // replicas
    rounds: dict[int, list[int]] = {}
    for (adapter, _batch), round_ in sorted(last.items()):
        rounds.setdefault(round_, []).append(adapter)
    return {r: sorted(set(adapters)) for r, adapters in rounds.items()}
