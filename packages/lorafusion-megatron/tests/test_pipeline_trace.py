"""The stages' timelines: the replay that splits a bubble, and the Chrome trace."""

from __future__ import annotations

import pytest

from lorafusion_megatron.pipeline.engine import EngineStats
from lorafusion_megatron.pipeline.trace import ActionTiming, Timeline, chrome_trace, replay


def _stats(stage: int, actions: list[tuple[str, int, float]], *, replica: int = 0, gap: float = 0.5) -> EngineStats:
    """A stage's stats whose actions (``("F" or "B", key, seconds)``) ran in order, ``gap`` seconds apart."""
    stats = EngineStats(stage=stage, replica=replica)
    clock = 0.0
    for kind, key, seconds in actions:
        clock += gap
        stats.timeline.append(key, backward=kind == "B", tokens=100 + key, start=clock, end=clock + seconds)
        clock += seconds
    return stats


def _two_stage_1f1b(*, replica: int = 0, gap: float = 0.5) -> list[EngineStats]:
    """Two microbatches on two stages in 1F1B order; forwards take 1 s, backwards 2 s."""
    first = [("F", 0, 1.0), ("F", 1, 1.0), ("B", 0, 2.0), ("B", 1, 2.0)]
    last = [("F", 0, 1.0), ("B", 0, 2.0), ("F", 1, 1.0), ("B", 1, 2.0)]
    return [_stats(0, first, replica=replica, gap=gap), _stats(1, last, replica=replica, gap=gap)]


def test_the_replay_keeps_only_the_waits_the_pipeline_imposes() -> None:
    # Stage 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7; stage 0: F0 0-1, F1 1-2, B0 4-6, B1 7-9.
    replayed = replay(_two_stage_1f1b(gap=0.5))
    assert replayed.wall_seconds == pytest.approx(9.0)
    # Every stage's bubble over the makespan, as simulated and measured: stage 1, done at 7 s,
    # idles through the drain too (busy 6 s of 9).
    assert replayed.bubble_ratio_per_stage == pytest.approx([1 / 3, 1 / 3])
    assert replayed.bubble_ratio == pytest.approx(1 / 3)
    # The measured gaps between actions do not matter, only the durations and the order.
    assert replay(_two_stage_1f1b(gap=0.0)) == replayed


def test_the_replay_takes_the_slowest_replica() -> None:
    slow = [
        _stats(s.stage, [("F" if not a.backward else "B", a.key, 2 * (a.end - a.start)) for a in s.timeline], replica=1)
        for s in _two_stage_1f1b()
    ]
    replayed = replay(_two_stage_1f1b() + slow)
    assert replayed.wall_seconds == pytest.approx(18.0)
    assert replayed.bubble_ratio_per_stage == pytest.approx([1 / 3, 1 / 3])


def test_one_stage_has_no_bubble_to_replay() -> None:
    replayed = replay([_stats(0, [("F", 0, 1.0), ("B", 0, 2.0), ("F", 1, 1.0), ("B", 1, 2.0)])])
    assert replayed.wall_seconds == pytest.approx(6.0)
    assert replayed.bubble_ratio_per_stage == [0.0]


def test_timelines_that_do_not_form_a_pipeline_are_refused() -> None:
    first, last = _two_stage_1f1b()
    kept = Timeline()  # stage 1 never ran microbatch 1
    for a in last.timeline:
        if a.key != 1:
            kept.append(a.key, backward=a.backward, tokens=a.tokens, start=a.start, end=a.end)
    last.timeline = kept
    with pytest.raises(ValueError, match="deadlock"):
        replay([first, last])
    with pytest.raises(ValueError, match="missing"):
        replay([last])


def test_a_timeline_gives_back_what_it_recorded() -> None:
    timeline = Timeline()
    timeline.append(7, backward=True, tokens=300, start=1.5, end=2.25)
    timeline.append(8, backward=False, tokens=12, start=2.5, end=2.75)
    assert len(timeline) == 2
    assert list(timeline) == [ActionTiming(7, True, 300, 1.5, 2.25), ActionTiming(8, False, 12, 2.5, 2.75)]


def test_the_chrome_trace_has_a_box_per_action_on_its_stages_row() -> None:
    trace = chrome_trace(_two_stage_1f1b())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == 8
    b0 = next(e for e in boxes if e["tid"] == 1 and e["name"] == "B 0")
    assert b0["cat"] == "backward"
    assert b0["ts"] == pytest.approx(2.0e6)  # after F0 (0.5 to 1.5 s) and a 0.5 s gap
    assert b0["dur"] == pytest.approx(2.0e6)
    assert b0["args"] == {"microbatch": 0, "tokens": 100}
    names = {(e["name"], e.get("tid"), e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {("process_name", None, "replica 0"), ("thread_name", 0, "stage 0"), ("thread_name", 1, "stage 1")}
