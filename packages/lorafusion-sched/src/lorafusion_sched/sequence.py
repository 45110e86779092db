"""The microbatch sequence inside the planner: slots, rounds, no-op insertion and optimizer steps.

A slot maps an adapter index to ``(global batch, sample ids)``; an empty slot is a no-op. With
``d`` data-parallel replicas, slot ``i`` runs on replica ``i % d`` at round ``i // d`` (round =
position in that replica's pipeline; ``d = 1`` gives round = index).

The rule for data parallelism: an adapter's gradients are all-reduced over replicas before its
optimizer steps, so every replica must have finished global batch ``g`` before any replica starts
``g + 1``. The bubble lemma is therefore checked on rounds across replicas: the first round of
``g + 1`` is at least ``S`` rounds after the last round of ``g``. Every replica steps the adapter
after its microbatch of that last round (``step_after`` is set on all ``d`` slots of the round),
and the sequence is padded with no-ops to a whole number of rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Slot", "insert_noops", "step_rounds"]

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
