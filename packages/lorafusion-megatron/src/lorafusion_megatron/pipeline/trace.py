"""What the stages' timelines say: a trace to look at, and the bubble the measured durations imply.

Every stage records each forward and backward it ran in a :class:`Timeline` (flat arrays, not one
Python object per action: a long run records millions, which the garbage collector would have to
walk, see :mod:`lorafusion_megatron.gc_tuning`).
:func:`chrome_trace` lays them out in the Chrome trace event format (open the file in
https://ui.perfetto.dev or chrome://tracing): one process per data-parallel replica, one row per
stage, one box per action.

:func:`replay` splits a measured bubble in two. It re-runs the recorded actions with their measured
durations and nothing between them but the waits the pipeline imposes: on each stage the actions
keep their recorded order; the forward of microbatch ``k`` on stage ``s`` starts once it ended on
stage ``s - 1``, its backward on stage ``s`` once it ended on stage ``s + 1``. The replayed bubble
is what the schedule costs given these durations (stage imbalance, microbatches of unequal cost,
a slow first call); the rest of the measured bubble is the runtime's own (transfers, optimizer
steps, packing, host work between actions).
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorafusion_megatron.pipeline.engine import EngineStats

__all__ = ["ActionTiming", "Replay", "Timeline", "chrome_trace", "replay"]


@dataclass(frozen=True)
class ActionTiming:
    """One forward or backward of one microbatch on a stage (host clock, compute stream synchronised).

    Attributes:
        key: The microbatch's index in the whole program (the same on every stage).
        backward: Backward (else forward).
        tokens: The microbatch's real tokens.
        start: Seconds since the stage's engine first began to execute.
        end: As ``start``, when the action's compute had finished.
    """

    key: int
    backward: bool
    tokens: int
    start: float
    end: float


class Timeline:
    """A stage's actions in the order they ran, as flat arrays (iterate for :class:`ActionTiming`)."""

    def __init__(self) -> None:
        self._keys = array("q")
        self._tokens = array("q")
        self._backward = array("b")
        self._starts = array("d")
        self._ends = array("d")

    def append(self, key: int, *, backward: bool, tokens: int, start: float, end: float) -> None:
        """Record one action."""
        self._keys.append(key)
        self._tokens.append(tokens)
        self._backward.append(backward)
        self._starts.append(start)
        self._ends.append(end)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[ActionTiming]:
        columns = zip(self._keys, self._backward, self._tokens, self._starts, self._ends, strict=True)
        for key, backward, tokens, start, end in columns:
            yield ActionTiming(key, bool(backward), tokens, start, end)


def chrome_trace(stats: Sequence[EngineStats]) -> dict[str, Any]:
    """Every rank's timeline as a Chrome trace (times in microseconds)."""
    events: list[dict[str, Any]] = []
    for rank_stats in sorted(stats, key=lambda s: (s.replica, s.stage)):
        pid, tid = rank_stats.replica, rank_stats.stage
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"replica {pid}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"stage {tid}"}})
        events.extend(
            {
                "ph": "X",
                "name": f"{'B' if action.backward else 'F'} {action.key}",
                "cat": "backward" if action.backward else "forward",
                "pid": pid,
                "tid": tid,
                "ts": action.start * 1e6,
                "dur": (action.end - action.start) * 1e6,
                "args": {"microbatch": action.key, "tokens": action.tokens},
            }
            for action in rank_stats.timeline
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@dataclass(frozen=True)
class Replay:
    """The measured actions replayed with no overhead between them.

    Attributes:
        wall_seconds: The replay's makespan (the slowest replica's).
        bubble_ratio_per_stage: ``1 - busy / makespan`` per stage, the makespan being its
            replica's (the largest ratio over the replicas), as the simulator counts it and as the
            engine measures it (a stage's clock runs until the run's last optimizer steps, which
            wait for stage 0's last backward, so the drain at the end counts on every stage).
    """

    wall_seconds: float
    bubble_ratio_per_stage: list[float]

    @property
    def bubble_ratio(self) -> float:
        """Mean over the stages, as the measured bubble ratio."""
        return sum(self.bubble_ratio_per_stage) / len(self.bubble_ratio_per_stage)


def replay(stats: Sequence[EngineStats]) -> Replay:
    """Replay every replica's recorded actions (see the module docstring).

    Raises:
        ValueError: The timelines of a replica do not form a pipeline (an action waits for one
            that never ran, or the stages are missing one).
    """
    by_replica: dict[int, dict[int, list[ActionTiming]]] = defaultdict(dict)
    for rank_stats in stats:
        by_replica[rank_stats.replica][rank_stats.stage] = list(rank_stats.timeline)
    wall = 0.0
    bubbles: dict[int, float] = defaultdict(float)
    for replica, timelines in sorted(by_replica.items()):
        if sorted(timelines) != list(range(len(timelines))):
            raise ValueError(f"replica {replica} has the timelines of stages {sorted(timelines)}: one is missing")
        ends = _replay_replica([timelines[s] for s in range(len(timelines))])
        makespan = max((max(stage_ends.values(), default=0.0) for stage_ends in ends), default=0.0)
        wall = max(wall, makespan)
        for stage in range(len(ends)):
            busy = sum(a.end - a.start for a in timelines[stage])
            bubbles[stage] = max(bubbles[stage], 1.0 - busy / makespan if makespan > 0 else 0.0)
    return Replay(wall_seconds=wall, bubble_ratio_per_stage=[bubbles[s] for s in sorted(bubbles)])


def _replay_replica(timelines: list[list[ActionTiming]]) -> list[dict[tuple[int, bool], float]]:
    """Replayed end time of every ``(key, backward)`` action, per stage."""
    stages = len(timelines)
    ends: list[dict[tuple[int, bool], float]] = [{} for _ in range(stages)]
    position = [0] * stages
    clock = [0.0] * stages
    remaining = sum(len(t) for t in timelines)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(timelines[s]):
                action = timelines[s][position[s]]
                neighbour = s + 1 if action.backward else s - 1
                ready = clock[s]
                if 0 <= neighbour < stages:
                    dependency = ends[neighbour].get((action.key, action.backward))
                    if dependency is None:
                        break
                    ready = max(ready, dependency)
                clock[s] = ready + (action.end - action.start)
                ends[s][(action.key, action.backward)] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {s: timelines[s][position[s]] for s in range(stages) if position[s] < len(timelines[s])}
            raise ValueError(f"the stages' timelines deadlock: stage -> next action {waiting}")
    return ends
