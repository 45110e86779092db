from __future__ import annotations

import os
import signal

import pytest

from lorafusion_megatron.executor import StopSignal, execute_plan
from lorafusion_megatron.testing import plan_microbatch as microbatch
from lorafusion_sched.models import Microbatch


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, str]] = []

    def run_microbatch(self, index: int, mb: Microbatch) -> None:
        self.events.append(("run", index, ",".join(s.adapter for s in mb.segments)))

    def step_adapter(self, index: int, adapter: str) -> None:
        self.events.append(("step", index, adapter))

    def after_microbatch(self, index: int) -> None:
        self.events.append(("done", index, ""))


PLAN = (
    microbatch(("a1", 0, (0,)), ("b1", 0, (0,))),
    microbatch(("a1", 0, (1,)), step_after=("a1",)),
    Microbatch(noop=True, step_after=("b1",)),
    microbatch(("a1", 1, (2,)), step_after=("a1",)),
)


def test_runs_in_order_skips_noops_and_steps_after_backward() -> None:
    hooks = Recorder()
    assert execute_plan(PLAN, hooks) == 4
    assert hooks.events == [
        ("run", 0, "a1,b1"),
        ("done", 0, ""),
        ("run", 1, "a1"),
        ("step", 1, "a1"),
        ("done", 1, ""),
        ("step", 2, "b1"),
        ("done", 2, ""),
        ("run", 3, "a1"),
        ("step", 3, "a1"),
        ("done", 3, ""),
    ]


def test_start_and_stop_positions() -> None:
    hooks = Recorder()
    polls = iter([False, True])
    assert execute_plan(PLAN, hooks, start=1, should_stop=lambda: next(polls)) == 3
    assert [e for e in hooks.events if e[0] == "done"] == [("done", 1, ""), ("done", 2, "")]


def test_sigterm_requests_a_stop_too(caplog: pytest.LogCaptureFixture) -> None:
    """What a scheduler sends before preempting a job: a checkpoint, as for the first Ctrl-C."""
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop()
    assert signal.getsignal(signal.SIGTERM) is before
    assert "SIGTERM: finishing this microbatch, then a checkpoint; send SIGTERM again (or press Ctrl-C)" in caplog.text


def test_first_ctrl_c_requests_a_stop_and_the_second_aborts() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopSignal() as stop:
        assert not stop()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_the_first_signal_is_remembered_and_a_repeated_sigterm_aborts_naming_it() -> None:
    """A second SIGTERM raised a plain KeyboardInterrupt, which the CLI took for a Ctrl-C (status 130, not 143)."""
    from lorafusion_megatron.interrupts import Interrupted

    with StopSignal() as stop:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received is signal.SIGTERM
        with pytest.raises(Interrupted) as aborted:
            os.kill(os.getpid(), signal.SIGTERM)
    assert aborted.value.signal is signal.SIGTERM
    with StopSignal() as stop:
        assert stop.received is None, "each use starts afresh"
