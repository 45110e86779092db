"""A rank that makes no progress ends its own process, naming what it was doing and where.

The collective timeout (``parallel.collective_timeout_minutes``) is meant to end a run whose rank
hangs: its peers' transfers time out and fail. Over gloo they do (measured: 2 CPU ranks, 1 minute,
the run ended after 73 s). Over NCCL, one run on 2 H200s with rank 1 asleep in its first forward
had not ended 240 s after its start and no NCCL watchdog message appeared, so the transfers' own
timeout cannot be relied on there: torch's NCCL watchdog does not see a wait in the first
point-to-point operation between two ranks, and a timeout it sees ends the process about 70 s
later (``benchmarks/nccl_timeout_probe.py``, 2 H200s).

Each rank therefore runs a :class:`StallWatchdog` from the start of its process groups to its last
collective. The engine and the worker report every action to it (:meth:`StallWatchdog.beat`:
reading the data, planning, building the rank's stage, a forward, a backward, an exchange with the
neighbours, each phase of a checkpoint, the gathering of the adapters). When one action has lasted
longer than its limit, a thread writes the rank's error down for the launcher
(:func:`~lorafusion_megatron.pipeline.failures.note_failure`), with the main thread's stack,
prints it, and ends the process at once (``os._exit``: the main thread may be blocked in a
transfer or a CUDA call that no exception can interrupt). The launcher then stops the other ranks
and names this one. With it, the NCCL run above ends after the stalled
rank's 54 s and names rank 1 (2 H200s, the ``multigpu`` hanging-rank test).

The limit is a fraction of the collective timeout ``T``: ``0.9 T`` for the rank's own work and
``1.1 T`` while it waits on other ranks (an exchange, a checkpoint's barriers, a gather). A rank
stuck in its own work is caught before its waiting peers time out, so the run names the rank that
hung, not a neighbour that waited for it; a waiting rank is only a backstop for a transfer that
never times out.

Time the process spends stopped (``SIGSTOP``, a job scheduler suspending the job) does not count:
a poll that comes much later than it should moves the action's start on by the gap.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from lorafusion_megatron.pipeline.failures import note_failure

if TYPE_CHECKING:
    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["OWN_WORK_FRACTION", "WAITING_FRACTION", "Heartbeat", "RankStalledError", "StallWatchdog", "no_heartbeat"]

OWN_WORK_FRACTION = 0.9
"""The share of the collective timeout one action of the rank's own may last."""

WAITING_FRACTION = 1.1
"""The share of the collective timeout a wait on other ranks may last (an exchange, a barrier, a gather)."""


_SUSPENDED_POLLS = 20
"""A poll this many intervals late (and at least 30 s) means the process was stopped in between."""


class Heartbeat(Protocol):
    """Told of an action as it starts: what it is, and whether it waits on other ranks."""

    def __call__(self, doing: str, *, waiting: bool = False) -> None:
        """``doing`` starts now (e.g. ``"the forward of microbatch 7"``)."""


def no_heartbeat(doing: str, *, waiting: bool = False) -> None:
    """The heartbeat of work that nothing watches."""


class RankStalledError(RuntimeError):
    """One action of a rank lasted longer than its limit (the message holds the main thread's stack)."""


class StallWatchdog:
    """Ends this process when the action last reported by :meth:`beat` outlasts its limit.

    Use it as a context manager around the work it watches, in the thread that does the work
    (its stack goes into the message); outside the block nothing is watched.

    Args:
        timeout_seconds: The collective timeout ``T``; an action may last ``0.9 T`` (``1.1 T``
            while waiting on peers).
        layout: Whose rank this is (for the message and the launcher).
        poll_seconds: How often the thread looks; default ``T / 100``, at most 5 s.
        clock: Monotonic seconds (tests pass their own).
        end_process: Called with the exit status when the rank stalls (tests pass their own).
    """

    def __init__(
        self,
        timeout_seconds: float,
        layout: Layout,
        *,
        poll_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        end_process: Callable[[int], object] = os._exit,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.layout = layout
        self.poll_seconds = poll_seconds if poll_seconds is not None else min(5.0, timeout_seconds / 100)
        self._clock = clock
        self._end_process = end_process
        self._state = ("starting", False, clock())
        """What the rank does, whether it waits on other ranks, since when: one tuple, replaced whole."""
        self._watched_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, doing: str, *, waiting: bool = False) -> None:
        """The rank starts ``doing`` (e.g. ``"the forward of microbatch 7"``); ``waiting``: on other ranks."""
        self._state = (doing, waiting, self._clock())

    def _excuse(self, seconds: float) -> None:
        """Do not count the last ``seconds`` against the current action (the process was stopped)."""
        doing, waiting, since = self._state
        self._state = (doing, waiting, since + seconds)

    def check(self) -> bool:
        """Whether the current action outlasted its limit; if so, write the error down and end the process."""
        doing, waiting, since = self._state
        fraction = WAITING_FRACTION if waiting else OWN_WORK_FRACTION
        elapsed = self._clock() - since
        if elapsed <= fraction * self.timeout_seconds:
            return False
        error = RankStalledError(self._message(doing, elapsed, fraction))
        layout = self.layout
        note_failure(error, rank=layout.rank, stage=layout.stage, replica=layout.replica)
        sys.stderr.write(f"lorafusion-megatron: error: {error}\n")  # for torchrun, which reads no failure file
        sys.stderr.flush()
        self._end_process(1)
        return True

    def _message(self, doing: str, elapsed: float, fraction: float) -> str:
        layout = self.layout
        frame = sys._current_frames().get(self._watched_thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (not found)\n"
        return (
            f"rank {layout.rank} (stage {layout.stage}, replica {layout.replica}) spent {elapsed:.0f} s on "
            f"{doing} without finishing it (the limit: {fraction:g} x parallel.collective_timeout_minutes "
            f"= {fraction * self.timeout_seconds:.0f} s), so it was stopped. Its main thread was at:\n{stack.rstrip()}"
        )

    def _watch(self) -> None:
        late = max(30.0, _SUSPENDED_POLLS * self.poll_seconds)
        last = self._clock()
        while not self._stop.wait(self.poll_seconds):
            now = self._clock()
            if now - last > late:
                self._excuse(now - last - self.poll_seconds)
            last = now
            if self.check():
                return

    def __enter__(self) -> StallWatchdog:
        self.beat("starting")
        self._thread = threading.Thread(target=self._watch, name="lorafusion-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
