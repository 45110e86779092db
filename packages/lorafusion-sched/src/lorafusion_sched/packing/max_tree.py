"""Finding the first microbatch with room for a sample in O(log n) instead of trying each one.

With ``P`` the padding multiple and ``C`` the capacity, a microbatch of padded size ``size`` that
holds ``old`` tokens of adapter ``a`` takes ``L`` more tokens of ``a`` iff
``size - ceil_P(old) + ceil_P(old + L) <= C``. Since ``C - size + ceil_P(old)`` is a multiple of
``P``, that is iff ``L <= C - size + ceil_P(old) - old``: the microbatch's *room* for ``a``
(:func:`room_for`). A :class:`MaxTree` per adapter over the microbatches' rooms (:class:`Rooms`)
answers "the first microbatch from here that takes ``L`` tokens of ``a``" by one descent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lorafusion_sched.packing.problem import round_up

__all__ = ["MaxTree", "Rooms", "room_for"]


def room_for(capacity: int, padding: int, size: int, old: int) -> int:
    """Tokens of an adapter that still fit a microbatch of padded ``size`` already holding ``old`` of its tokens."""
    return capacity - size + round_up(old, padding) - old


class MaxTree:
    """A max segment tree over one value per position, positions appended at the end.

    Leaves past the last position hold -1, which no need (>= 0) matches.
    """

    def __init__(self) -> None:
        self.leaves = 1
        self.count = 0
        self.tree = [-1, -1]

    def append(self, value: int) -> None:
        """Add a position at the end with ``value`` (the tree doubles when full)."""
        if self.count == self.leaves:
            old = self.tree[self.leaves : self.leaves + self.count]
            self.leaves *= 2
            self.tree = [-1] * (2 * self.leaves)
            self.tree[self.leaves : self.leaves + self.count] = old
            for node in range(self.leaves - 1, 0, -1):
                self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
        self.count += 1
        self.set(self.count - 1, value)

    def set(self, index: int, value: int) -> None:
        """Change position ``index``'s value."""
        node = index + self.leaves
        self.tree[node] = value
        while node > 1:
            node //= 2
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def first_at_least(self, need: int, start: int = 0) -> int | None:
        """The smallest position ``>= start`` whose value is ``>= need``; None if there is none."""
        if start >= self.count:
            return None
        node = start + self.leaves
        while self.tree[node] < need:
            while node % 2:  # a right child: its parent also covers positions left of start, so climb on
                node //= 2
            if node == 0:
                return None
            node += 1  # the subtree just right of every position seen so far
        while node < self.leaves:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        return node - self.leaves


class Rooms:
    """Every microbatch's room for each adapter's tokens, one :class:`MaxTree` per adapter."""

    def __init__(self, adapters: Iterable[int], capacity: int, padding: int) -> None:
        self.capacity = capacity
        self.padding = padding
        self.trees = {a: MaxTree() for a in sorted(set(adapters))}

    def append(self, size: int, tokens: Mapping[int, int]) -> None:
        """Add a microbatch of padded ``size`` holding ``tokens[a]`` tokens of each adapter ``a``."""
        for a, tree in self.trees.items():
            tree.append(room_for(self.capacity, self.padding, size, tokens.get(a, 0)))

    def set(self, index: int, size: int, tokens: Mapping[int, int]) -> None:
        """Microbatch ``index`` now has padded ``size`` and ``tokens[a]`` tokens of each adapter ``a``."""
        for a, tree in self.trees.items():
            tree.set(index, room_for(self.capacity, self.padding, size, tokens.get(a, 0)))

    def first(self, adapter: int, length: int, start: int = 0) -> int | None:
        """The first microbatch from ``start`` that takes ``length`` more tokens of ``adapter``; None if none."""
        return self.trees[adapter].first_at_least(length, start)
