"""Adapter grouping and the order of packing tasks (paper section 5.2, "Bubble Lemma & Adapter Grouping").

Groups run in a strict round: for every global batch index ``g``, each group packs its adapters'
global batch ``g``. Between two global batches of one adapter therefore lie the microbatches of
all other groups, which is what the bubble lemma needs (at least ``S - 1`` of them, or ``S - 1``
rounds of ``d`` with ``d`` data-parallel replicas). Inside a group,
adapters share microbatches freely, which balances them.

Head-tail pairing: adapters sorted by mean sample length are paired longest with shortest while
the adapters outside the pair are still expected to fill ``S - 1`` microbatches; otherwise the
adapter expected to need more microbatches runs alone. Groups hold one or two adapters.

Adapters with fewer global batches leave the rotation; each time the set of active adapters
changes a new phase starts and the active adapters are grouped again, so a late phase is not
left with a group that no longer has partners to separate its global batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AdapterProfile", "Task", "group_adapters", "plan_tasks"]


@dataclass(frozen=True, slots=True)
class AdapterProfile:
    """What grouping needs to know about an adapter.

    Attributes:
        index: Position of the adapter in the job list.
        mean: Mean sample length, tokens.
        std: Sample standard deviation of the lengths (0 for one sample).
        global_batch_size: Samples per global batch.
        num_global_batches: Global batches to schedule.
    """

    index: int
    mean: float
    std: float
    global_batch_size: int
    num_global_batches: int

    def microbatches_low(self, capacity: int, sigma_factor: float) -> int:
        """Conservative microbatches per global batch: ``ceil(gbs * max(mean - k std, 0) / C)``."""
        per_sample = max(self.mean - sigma_factor * self.std, 0.0)
        return math.ceil(self.global_batch_size * per_sample / capacity)

    def microbatches_mean(self, capacity: int) -> int:
        """Expected microbatches per global batch: ``ceil(gbs * mean / C)``."""
        return math.ceil(self.global_batch_size * self.mean / capacity)


@dataclass(frozen=True, slots=True)
class Task:
    """One packing problem: global batch ``global_batch`` of the adapters in ``group``."""

    global_batch: int
    group: tuple[int, ...]


def group_adapters(
    profiles: Sequence[AdapterProfile], capacity: int, stages: int, sigma_factor: float, replicas: int = 1
) -> list[tuple[int, ...]]:
    """Group adapters by head-tail pairing under the bubble check.

    The check for a candidate group ``G``: ``sum_{a not in G} microbatches_low(a) >= d (S - 1)``,
    i.e. the other groups are expected to fill the ``S - 1`` rounds of ``d`` microbatches that must
    separate ``G``'s consecutive global batches.

    Args:
        profiles: The active adapters.
        capacity: Token capacity of a microbatch.
        stages: Pipeline stages ``S``.
        sigma_factor: ``k`` in the conservative microbatch estimate.
        replicas: Data-parallel replicas ``d`` (a round is one microbatch per replica).

    Returns:
        Groups of adapter indices, in execution order (longest adapters first).
    """
    ordered = sorted(profiles, key=lambda p: (-p.mean, p.index))
    low = {p.index: p.microbatches_low(capacity, sigma_factor) for p in ordered}
    total = sum(low.values())

    def separated(group: Sequence[AdapterProfile]) -> bool:
        return total - sum(low[p.index] for p in group) >= replicas * (stages - 1)

    groups: list[tuple[int, ...]] = []
    head, tail = 0, len(ordered) - 1
    while head < tail:
        long, short = ordered[head], ordered[tail]
        if separated((long, short)):
            groups.append(tuple(sorted((long.index, short.index))))
            head += 1
            tail -= 1
        elif long.microbatches_mean(capacity) >= short.microbatches_mean(capacity):
            groups.append((long.index,))
            head += 1
        else:
            groups.append((short.index,))
            tail -= 1
    if head == tail:
        groups.append((ordered[head].index,))
    return groups


def plan_tasks(
    profiles: Sequence[AdapterProfile], capacity: int, stages: int, sigma_factor: float, replicas: int = 1
) -> tuple[list[Task], list[list[tuple[int, ...]]]]:
    """The ordered packing tasks over all global batches, regrouping whenever an adapter runs out.

    Returns:
        The tasks in execution order, and the groups of every phase.
    """
    tasks: list[Task] = []
    phases: list[list[tuple[int, ...]]] = []
    ends = sorted({p.num_global_batches for p in profiles if p.num_global_batches > 0})
    start = 0
    for end in ends:
        active = [p for p in profiles if p.num_global_batches >= end]
        groups = group_adapters(active, capacity, stages, sigma_factor, replicas)
        phases.append(groups)
        tasks.extend(Task(global_batch=g, group=group) for g in range(start, end) for group in groups)
        start = end
    return tasks, phases
