"""The 1F1B action lists: every forward and backward once, and the stages' exchanges pair up without deadlock."""

from __future__ import annotations

import random

import pytest

from lorafusion_megatron.pipeline.schedule import Compute, Exchange, one_f_one_b


def _simulate(num: int, stages: int, noops: set[int]) -> list[list[tuple[str, int]]]:
    """Run all stages' action lists with rendezvous transfers; returns each stage's compute order.

    A transfer completes once both ends have posted it; an exchange waits for all its transfers.
    Raises if the stages deadlock or a receive gets another microbatch than it expects.
    """
    programs = [one_f_one_b(num, stages, s) for s in range(stages)]
    position = [0] * stages
    posted: dict[tuple[int, int, str], list[int]] = {}  # (from, to, kind) -> sent microbatches
    wanted: dict[tuple[int, int, str], list[int]] = {}
    consumed: dict[tuple[int, int, str], int] = {}
    done: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
    pending: dict[int, list[tuple[tuple[int, int, str], int, int]]] = {}

    def ops(s: int, action: Exchange) -> list[tuple[tuple[int, int, str], int, bool]]:
        out = []
        if action.send_forward is not None and s < stages - 1 and action.send_forward not in noops:
            out.append(((s, s + 1, "F"), action.send_forward, True))
        if action.recv_backward is not None and s < stages - 1 and action.recv_backward not in noops:
            out.append(((s + 1, s, "B"), action.recv_backward, False))
        if action.send_backward is not None and s > 0 and action.send_backward not in noops:
            out.append(((s, s - 1, "B"), action.send_backward, True))
        if action.recv_forward is not None and s > 0 and action.recv_forward not in noops:
            out.append(((s - 1, s, "F"), action.recv_forward, False))
        return out

    while any(position[s] < len(programs[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] >= len(programs[s]):
                continue
            action = programs[s][position[s]]
            if isinstance(action, Compute):
                done[s].append(("B" if action.backward else "F", action.index))
                position[s] += 1
                progressed = True
                continue
            if s not in pending:
                pending[s] = []
                for channel, mb, is_send in ops(s, action):
                    queue = (posted if is_send else wanted).setdefault(channel, [])
                    pending[s].append((channel, len(queue), int(is_send)))
                    queue.append(mb)
            complete = all(
                len(posted.get(channel, [])) > slot and len(wanted.get(channel, [])) > slot
                for channel, slot, _ in pending[s]
            )
            if complete:
                for channel, slot, _ in pending[s]:
                    assert posted[channel][slot] == wanted[channel][slot], f"{channel} slot {slot}"
                    consumed[channel] = consumed.get(channel, 0) + 1
                del pending[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock at positions {position}")
    return done


@pytest.mark.parametrize(("num", "stages"), [(1, 1), (5, 1), (1, 3), (2, 4), (7, 2), (9, 4), (12, 3)])
def test_every_microbatch_runs_forward_then_backward_once_in_order(num: int, stages: int) -> None:
    for s in range(stages):
        computes = [a for a in one_f_one_b(num, stages, s) if isinstance(a, Compute)]
        forwards = [a.index for a in computes if not a.backward]
        backwards = [a.index for a in computes if a.backward]
        assert forwards == list(range(num))
        assert backwards == list(range(num))
        warmup = next(k for k, a in enumerate(computes) if a.backward)
        assert warmup == min(stages - 1 - s, num) + (1 if num > min(stages - 1 - s, num) else 0)


@pytest.mark.parametrize("seed", range(6))
def test_exchanges_pair_up_without_deadlock_with_noops(seed: int) -> None:
    rng = random.Random(seed)
    stages = rng.randint(1, 5)
    num = rng.randint(1, 14)
    noops = {i for i in range(num) if rng.random() < 0.3}
    done = _simulate(num, stages, noops)
    for order in done:
        assert sorted(order) == sorted([("F", i) for i in range(num)] + [("B", i) for i in range(num)])


def test_each_backward_is_followed_by_the_exchange_that_sends_its_gradient() -> None:
    # The engine steps optimizers after that exchange: it must exist for every backward, on every stage.
    for stages in (1, 2, 4):
        for s in range(stages):
            actions = one_f_one_b(6, stages, s)
            for k, action in enumerate(actions):
                if isinstance(action, Compute) and action.backward:
                    following = actions[k + 1]
                    assert isinstance(following, Exchange)
                    assert following.send_backward == action.index
