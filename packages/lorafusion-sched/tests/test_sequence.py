"""No-op insertion and the list schedule that reorders slots where that saves no-ops."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafusion_sched.sequence import Slot, fewest_noops, insert_noops, list_schedule


@st.composite
def sequences(draw: st.DrawFn) -> tuple[list[Slot], int, int]:
    """A valid slot sequence: each adapter's global batches in order, one to three slots each."""
    num_adapters = draw(st.integers(1, 4))
    batches = [draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)) for _ in range(num_adapters)]
    position = [[0, 0] for _ in range(num_adapters)]  # (global batch, slots used of it)
    slots: list[Slot] = []
    while active := [a for a in range(num_adapters) if position[a][0] < len(batches[a])]:
        chosen = draw(st.lists(st.sampled_from(active), min_size=1, max_size=2, unique=True))
        slot: Slot = {}
        for a in chosen:
            batch, used = position[a]
            slot[a] = (batch, [len(slots)])
            position[a] = [batch + 1, 0] if used + 1 == batches[a][batch] else [batch, used + 1]
        slots.append(slot)
    return slots, draw(st.integers(1, 5)), draw(st.integers(1, 3))


def laid_out(slots: list[Slot], order: list[int | None]) -> list[Slot]:
    return [{} if i is None else slots[i] for i in order]


def in_batch_order(sequence: list[Slot]) -> bool:
    seen: dict[int, int] = {}
    for slot in sequence:
        for adapter, (batch, _samples) in slot.items():
            if seen.get(adapter, batch) > batch:
                return False
            seen[adapter] = batch
    return True


def shortest_by_search(slots: list[Slot], stages: int, replicas: int) -> int:
    """The fewest slots any valid order needs (all permutations; tiny inputs only)."""
    orders = (
        [slots[i] for i in permutation]
        for permutation in itertools.permutations(range(len(slots)))
        if in_batch_order([slots[i] for i in permutation])
    )
    return min(len(insert_noops(order, stages, replicas)) for order in orders)


@settings(max_examples=300, deadline=None)
@given(sequences())
def test_fewest_noops_is_a_valid_order_never_longer_than_the_given_one(case: tuple[list[Slot], int, int]) -> None:
    slots, stages, replicas = case
    order = fewest_noops(slots, stages, replicas)
    assert sorted(i for i in order if i is not None) == list(range(len(slots)))
    sequence = laid_out(slots, order)
    assert in_batch_order(sequence)
    assert insert_noops(sequence, stages, replicas) == list(range(len(sequence)))  # the lemma holds as is
    assert len(order) <= len(insert_noops(slots, stages, replicas))
    assert len(order) % replicas == 0


@settings(max_examples=100, deadline=None)
@given(sequences())
def test_a_sequence_without_noops_keeps_its_order(case: tuple[list[Slot], int, int]) -> None:
    slots, stages, replicas = case
    given_order = insert_noops(slots, stages, replicas)
    if None not in given_order[: len(slots)]:
        assert fewest_noops(slots, stages, replicas) == given_order
        assert list_schedule(slots, stages, replicas, lambda i: (i,)) == given_order


def test_an_adapter_with_batches_to_go_runs_first_when_both_wait() -> None:
    """a0+b0, then b1 (b's last) and a1 (a2 to come) both wait for round S: a1 first saves a no-op."""
    slots: list[Slot] = [{0: (0, [0]), 1: (0, [0])}, {1: (1, [1])}, {0: (1, [1])}, {0: (2, [2])}]
    assert len(insert_noops(slots, 4, 1)) == 10
    order = fewest_noops(slots, 4, 1)
    assert order == [0, None, None, None, 2, 1, None, None, 3]
    assert len(order) == shortest_by_search(slots, 4, 1)


def test_a_slot_that_fits_now_goes_before_one_that_waits() -> None:
    """The given order waits three rounds for a1; b's slots fill them instead."""
    slots: list[Slot] = [{0: (0, [0])}, {0: (1, [1])}, {1: (0, [0])}, {1: (0, [1])}, {1: (0, [2])}]
    assert len(insert_noops(slots, 4, 1)) == 8
    assert fewest_noops(slots, 4, 1) == [0, 2, 3, 4, 1]


def test_rounds_of_replicas_are_filled_before_waiting() -> None:
    slots: list[Slot] = [{0: (0, [0])}, {0: (1, [1])}, {1: (0, [0])}, {1: (1, [1])}]
    order = fewest_noops(slots, 2, 2)
    assert order == [0, 2, None, None, 1, 3]
    assert len(order) == shortest_by_search(slots, 2, 2)


def test_slots_in_no_valid_order_are_refused_not_dropped() -> None:
    """Each slot holds one adapter's batch 0 and the other's batch 1: no order keeps both in order."""
    slots: list[Slot] = [{0: (0, [0]), 1: (1, [0])}, {0: (1, [1]), 1: (0, [1])}]
    with pytest.raises(ValueError, match="cannot all be kept in order"):
        fewest_noops(slots, 3, 1)


def test_an_empty_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="no empty slots"):
        fewest_noops([{0: (0, [0])}, {}, {0: (1, [1])}], 3, 1)
    with pytest.raises(ValueError, match="no empty slots"):
        list_schedule([{}], 1, 1, lambda i: (i,))
