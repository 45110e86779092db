"""SIGTERM taken like Ctrl-C, and the exit status that names the signal (128 + its number).

Python turns SIGINT into ``KeyboardInterrupt``, so a Ctrl-C unwinds a command: ``with`` blocks and
``finally`` clauses delete staging folders and temporary files on the way out. SIGTERM (``kill``,
a job scheduler's preemption) ends a process at once by default and leaves them behind. Inside
:func:`sigterm_interrupts` it raises :class:`Interrupted` instead, a ``KeyboardInterrupt`` that
names its signal, so a command cleans up alike after either and exits with the conventional
status: 130 after SIGINT, 143 after SIGTERM. Training takes either signal as a request to stop at
a checkpoint first (:class:`~lorafusion_megatron.executor.StopSignal`); a second one raises
:class:`Interrupted` too.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Interrupted", "repeat_hint", "signal_of", "sigterm_interrupts"]


class Interrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` raised by this package's signal handlers, naming the signal.

    Args:
        signum: The signal that arrived.
    """

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum)
        super().__init__(self.signal.name)


def signal_of(interrupt: KeyboardInterrupt) -> signal.Signals:
    """The signal behind ``interrupt``: its own for :class:`Interrupted`, SIGINT for Python's (a Ctrl-C)."""
    return interrupt.signal if isinstance(interrupt, Interrupted) else signal.SIGINT


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM raises :class:`Interrupted` (in the main thread; elsewhere handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def repeat_hint(received: signal.Signals) -> str:
    """How to send the second signal that aborts: as the first came (``press Ctrl-C again``, ``send SIGTERM again``)."""
    return "press Ctrl-C again" if received == signal.SIGINT else f"send {received.name} again (or press Ctrl-C)"
