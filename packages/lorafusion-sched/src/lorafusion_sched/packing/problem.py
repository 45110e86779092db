"""Problem data of one packing task and the bounds that decide whether a MILP can help.

A task is one global batch of one adapter group. Its items are samples ``i`` with an adapter
``a(i)`` and a length ``len(i)``. A bin (microbatch) holds any items; its size is
``sum_a roundup(sum_{i in bin, a(i)=a} len(i), P)`` (each adapter's segment padded to the padding
multiple ``P``), and must not exceed the capacity ``C``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Packing",
    "PackingProblem",
    "bin_size",
    "canonical_order",
    "item_ranks",
    "round_up",
    "smallest_bin_bound",
    "volume_bound",
]

Packing = list[list[int]]
"""Bins as lists of item indices."""


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class PackingProblem:
    """The items of one task: adapter id and length per item, capacity and padding multiple.

    Attributes:
        adapters: Adapter id of each item (any integers; only equality matters).
        lengths: Token length of each item; each must satisfy ``round_up(len, P) <= C``.
        capacity: Capacity ``C`` of a bin, padded tokens.
        padding: Padding multiple ``P``.
    """

    adapters: tuple[int, ...]
    lengths: tuple[int, ...]
    capacity: int
    padding: int

    @property
    def num_items(self) -> int:
        """Number of items."""
        return len(self.lengths)

    def adapter_totals(self) -> dict[int, int]:
        """Total length per adapter id."""
        totals: dict[int, int] = {}
        for a, t in zip(self.adapters, self.lengths, strict=True):
            totals[a] = totals.get(a, 0) + t
        return totals

    def padded_volume(self) -> int:
        """``sum_a roundup(T_a, P)``: a lower bound on the total size of any packing.

        Padding is subadditive (``roundup(x) + roundup(y) >= roundup(x + y)``), so splitting an
        adapter over bins never needs less than padding its total once.
        """
        return sum(round_up(t, self.padding) for t in self.adapter_totals().values())


def bin_size(problem: PackingProblem, items: Iterable[int]) -> int:
    """Padded size of a bin holding ``items``."""
    per_adapter: dict[int, int] = {}
    for i in items:
        a = problem.adapters[i]
        per_adapter[a] = per_adapter.get(a, 0) + problem.lengths[i]
    return sum(round_up(t, problem.padding) for t in per_adapter.values())


def volume_bound(problem: PackingProblem) -> int:
    """Fewest bins any packing can use: ``ceil(padded_volume / C)``."""
    return -(-problem.padded_volume() // problem.capacity)


def smallest_bin_bound(problem: PackingProblem, num_bins: int) -> int:
    """Smallest possible size of the smallest of ``num_bins`` non-empty bins.

    The other ``num_bins - 1`` bins hold at most ``C`` each, so the smallest holds at least
    ``padded_volume - (num_bins - 1) * C``; it also holds at least one item.
    """
    shortest = min(round_up(t, problem.padding) for t in problem.lengths)
    return max(problem.padded_volume() - (num_bins - 1) * problem.capacity, shortest)


def canonical_order(problem: PackingProblem, bins: Sequence[Sequence[int]], *, smallest_last: bool) -> Packing:
    """Relabel bins to satisfy the MILPs' symmetry breaking (so a packing can seed them).

    Items are ranked by decreasing length (ties by index). Bins are ordered by their best-ranked
    item; with ``smallest_last`` the smallest bin is moved to the end first. Then item of rank
    ``r`` sits in a bin with index at most ``r`` (or in the last bin).
    """
    rank = item_ranks(problem)
    nonempty = [list(b) for b in bins if b]
    last: list[list[int]] = []
    if smallest_last and nonempty:
        k = min(range(len(nonempty)), key=lambda j: (bin_size(problem, nonempty[j]), j))
        last = [nonempty.pop(k)]
    nonempty.sort(key=lambda b: min(rank[i] for i in b))
    return nonempty + last


def item_ranks(problem: PackingProblem) -> list[int]:
    """Rank of each item when sorted by decreasing length, ties by index."""
    order = sorted(range(problem.num_items), key=lambda i: (-problem.lengths[i], i))
    rank = [0] * problem.num_items
    for r, i in enumerate(order):
        rank[i] = r
    return rank
