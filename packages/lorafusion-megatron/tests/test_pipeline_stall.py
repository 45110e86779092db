"""The stall watchdog: an action that outlasts its share of the collective timeout ends the rank, named."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lorafusion_megatron.pipeline.failures import read_failures, record_failures_in
from lorafusion_megatron.pipeline.stall import StallWatchdog
from lorafusion_megatron.testing import cpu_stage_layout

LAYOUT = cpu_stage_layout(1)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def failures_folder(tmp_path: Path):
    record_failures_in(tmp_path)
    yield tmp_path
    record_failures_in(None)


def test_own_work_may_last_0_9_and_an_exchange_1_1_of_the_timeout(
    failures_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock, exits = _Clock(), []
    watchdog = StallWatchdog(100, LAYOUT, clock=clock, end_process=exits.append)
    watchdog.beat("an exchange with the neighbouring stages", waiting=True)
    clock.now = 109.0
    assert not watchdog.check(), "a wait may last 1.1 T"
    watchdog.beat("the forward of microbatch 3")
    clock.now += 90.0
    assert not watchdog.check()
    assert exits == []
    clock.now += 1.0
    assert watchdog.check(), "own work may last 0.9 T"
    assert exits == [1]
    failure = read_failures(failures_folder)[1]
    assert failure.error.startswith(
        "RankStalledError: rank 1 (stage 1, replica 0) spent 91 s on the forward of microbatch 3 without finishing "
        "it (the limit: 0.9 x parallel.collective_timeout_minutes = 90 s), so it was stopped. Its main thread was at:"
    ), failure.error
    assert "in test_own_work_may_last_0_9_and_an_exchange_1_1_of_the_timeout" in failure.message, failure.message
    # torchrun reads no failure file: the same line on stderr, marked as an error as the CLI's are.
    assert capsys.readouterr().err.startswith("lorafusion-megatron: error: rank 1 (stage 1, replica 0) spent 91 s")


def test_the_thread_ends_a_stalled_rank_and_leaves_a_beating_one(failures_folder: Path) -> None:
    stalled = threading.Event()

    def end_process(status: int) -> None:
        stalled.set()

    with StallWatchdog(2.0, LAYOUT, poll_seconds=0.01, end_process=end_process) as watchdog:
        for index in range(10):  # 0.1 s per forward: far under the 1.8 s limit
            watchdog.beat(f"the forward of microbatch {index}")
            time.sleep(0.1)
        assert not stalled.is_set()
        watchdog.beat("the backward of microbatch 9")
        started = time.monotonic()
        assert stalled.wait(20)
    assert 1.75 < time.monotonic() - started < 15
    assert "the backward of microbatch 9" in read_failures(failures_folder)[1].message


def test_time_the_process_spent_stopped_does_not_count(failures_folder: Path) -> None:
    """A job scheduler's suspension shows as a poll far later than due; the action is excused the gap."""
    stalled = threading.Event()
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    def end_process(status: int) -> None:
        stalled.set()

    with StallWatchdog(2.0, LAYOUT, poll_seconds=0.01, clock=clock, end_process=end_process) as watchdog:
        watchdog.beat("the forward of microbatch 0")
        offset[0] = 600.0  # as if stopped for 10 minutes
        started = time.monotonic()
        assert not stalled.wait(0.5)
        assert stalled.wait(20), "the action itself still counts"
    assert 1.75 < time.monotonic() - started < 15


def test_nothing_is_watched_outside_the_block(failures_folder: Path) -> None:
    exits: list[int] = []
    with StallWatchdog(0.05, LAYOUT, poll_seconds=0.01, end_process=exits.append):
        pass
    time.sleep(0.2)
    assert exits == []
