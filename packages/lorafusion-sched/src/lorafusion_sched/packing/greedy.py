"""Greedy packing: first-fit decreasing with per-adapter padding.

The greedy result is both the fallback and the MILPs' warm start, so it must always be valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafusion_sched.packing.max_tree import Rooms
from lorafusion_sched.packing.problem import Packing, PackingProblem, bin_size, round_up

__all__ = ["greedy_pack"]


@dataclass(slots=True)
class _Bin:
    items: list[int] = field(default_factory=list)
    per_adapter: dict[int, int] = field(default_factory=dict)
    size: int = 0

    def size_with(self, problem: PackingProblem, item: int) -> int:
        a = problem.adapters[item]
        old = self.per_adapter.get(a, 0)
        p = problem.padding
        return self.size - round_up(old, p) + round_up(old + problem.lengths[item], p)

    def add(self, problem: PackingProblem, item: int) -> None:
        self.size = self.size_with(problem, item)
        a = problem.adapters[item]
        self.per_adapter[a] = self.per_adapter.get(a, 0) + problem.lengths[item]
        self.items.append(item)


def first_fit_decreasing(problem: PackingProblem) -> list[_Bin]:
    """Place items longest first into the first bin where the padded size stays within capacity.

    :class:`~lorafusion_sched.packing.max_tree.Rooms` keeps every bin's room for each adapter, so
    the first bin that takes an item is found in O(log n), not by trying each open bin:
    O(n A log n) for ``n`` items of ``A`` adapters.
    """
    order = sorted(range(problem.num_items), key=lambda i: (-problem.lengths[i], i))
    rooms = Rooms(problem.adapters, problem.capacity, problem.padding)
    bins: list[_Bin] = []
    for i in order:
        j = rooms.first(problem.adapters[i], problem.lengths[i])
        if j is None:
            j = len(bins)
            bins.append(_Bin())
            rooms.append(0, {})
        bins[j].add(problem, i)
        rooms.set(j, bins[j].size, bins[j].per_adapter)
    return bins


def greedy_pack(problem: PackingProblem) -> Packing:
    """First-fit decreasing: items longest first, each into the first bin that still takes it.

    Returns:
        Bins as item lists, sorted by padded size, largest first (so the smallest, the one the
        merge pass can fill, is last). Every bin is within capacity.
    """
    bins = first_fit_decreasing(problem)
    packing = [sorted(b.items) for b in bins]
    packing.sort(key=lambda items: (-bin_size(problem, items), items))
    return packing
