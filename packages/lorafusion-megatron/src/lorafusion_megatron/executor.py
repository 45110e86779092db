"""Run a plan's microbatches in order on one process and step optimizers where the plan says.

The executor knows nothing of models: it walks the plan and calls its hooks, so the same loop
drives the real trainer and tests. On one process a microbatch's forward and backward finish
before the next starts, so "after the backward of microbatch ``i`` finished on every stage" (the
plan's ``step_after``) is simply "after microbatch ``i``". The runtime never counts samples to
decide when to step (the authors' runtime counted at forward time and stepped before the last
backward of a global batch).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Protocol

from lorafusion_megatron.interrupts import Interrupted, repeat_hint

if TYPE_CHECKING:
    from lorafusion_sched.models import Microbatch

__all__ = ["ExecutorHooks", "StopSignal", "execute_plan"]

_log = logging.getLogger(__name__)


class ExecutorHooks(Protocol):
    """What the executor calls while walking the plan."""

    def run_microbatch(self, index: int, microbatch: Microbatch) -> None:
        """Forward and backward of a non-no-op microbatch."""

    def step_adapter(self, index: int, adapter: str) -> None:
        """Step ``adapter``'s optimizer: its global batch ended with microbatch ``index``."""

    def after_microbatch(self, index: int) -> None:
        """Microbatch ``index`` is done (bookkeeping, logging, checkpoints)."""


def execute_plan(
    microbatches: Sequence[Microbatch],
    hooks: ExecutorHooks,
    *,
    start: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Run ``microbatches[start:]`` in order; no-ops are skipped but still counted.

    Args:
        microbatches: The plan's microbatches.
        hooks: Model and bookkeeping callbacks.
        start: Index of the first microbatch to run (a resumed run's position).
        should_stop: Polled after every microbatch; ``True`` stops cleanly there.

    Returns:
        Index of the next microbatch to run (``len(microbatches)`` when finished).
    """
    for index in range(start, len(microbatches)):
        microbatch = microbatches[index]
        if not microbatch.noop:
            hooks.run_microbatch(index, microbatch)
        for adapter in microbatch.step_after:
            hooks.step_adapter(index, adapter)
        hooks.after_microbatch(index)
        if should_stop():
            return index + 1
    return len(microbatches)


class StopSignal:
    """Turns a signal (Ctrl-C or SIGTERM by default) into a clean stop request, checked after each microbatch.

    SIGTERM is what a scheduler (SLURM, Kubernetes) sends before it preempts a job, so by default it
    stops the run at a checkpoint like the first Ctrl-C.

    Outside the main thread (where signal handlers cannot be set) it only stops when
    :meth:`request` is called.

    Args:
        signals: The signals that ask for a stop.
        repeat_aborts: A repeated signal raises :class:`~lorafusion_megatron.interrupts.Interrupted`
            (a ``KeyboardInterrupt`` naming the signal) at once (the single-process trainer's second
            Ctrl-C); when ``False`` repeats are the same request (pipeline ranks, which get one
            Ctrl-C from the terminal and again from their launcher).
        message: Logged at the first request, ``{signal}`` replaced by the signal's name; ``None``
            logs nothing (e.g. on every rank but one).

    Attributes:
        received: The first signal that asked for a stop since the last ``__enter__`` (``None``
            when none did: :meth:`request` names no signal).
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
        *,
        repeat_aborts: bool = True,
        message: str | None = "{signal}: finishing this microbatch, then a checkpoint; {again} to abort",
    ) -> None:
        self.signals = tuple(signals)
        self.repeat_aborts = repeat_aborts
        self.message = message
        self._requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | None] = {}

    def request(self) -> None:
        """Ask the run to stop after the current microbatch."""
        self._requested = True

    @contextlib.contextmanager
    def saying(self, message: str | None) -> Iterator[None]:
        """Inside: a first request logs ``message`` instead (the handlers stay as they are)."""
        before, self.message = self.message, message
        try:
            yield
        finally:
            self.message = before

    def __call__(self) -> bool:
        """Whether a stop was requested."""
        return self._requested

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._requested:
            if self.repeat_aborts:
                raise Interrupted(signum)
            return
        self._requested = True
        self.received = signal.Signals(signum)
        if self.message is not None:
            _log.warning(self.message.format(signal=self.received.name, again=repeat_hint(self.received)))

    def __enter__(self) -> StopSignal:
        self._requested = False
        self.received = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
