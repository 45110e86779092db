"""When a pipeline run fails: which rank failed first, and stopping the others in bounded time.

A rank that raises tears down its process groups on the way out, and its peers, blocked in a
transfer or a collective with it, fail in turn ("Connection closed by peer" over gloo). Which of
those processes *exits* first is a race (measured on 2 CPU ranks: the peer's error was the one
reported in 2 of 7 runs), so the first exit does not name the cause. Each rank that the local
launcher starts therefore writes its error down, with the time, while its process groups still
stand (:func:`note_failure`, called by :func:`~lorafusion_megatron.pipeline.groups.parallel_layout`):
no peer can fail because of it before that. The launcher (:func:`supervise`) waits for the ranks;
at the first failure (a rank's exit, or an error written down by a rank that has not exited: over
NCCL the failed rank itself can block in its teardown) it gives the ranks
:data:`FAILURE_GRACE_SECONDS` to end on their own, kills those left (over NCCL a rank blocked on a
dead peer would wait for the collective timeout, ``parallel.collective_timeout_minutes``; a rank
takes SIGTERM as a stop request, which a rank blocked in a transfer never reads), and names the
cause (:func:`first_failure`).

Under ``torchrun`` nothing is written down: ``torchrun`` stops the other ranks itself, and every
rank prints its own error.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.errors import TrainerError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

__all__ = [
    "FAILURE_GRACE_SECONDS",
    "RankExit",
    "RankFailure",
    "first_failure",
    "note_failure",
    "read_failures",
    "record_failures_in",
    "supervise",
]

_log = logging.getLogger(__name__)

FAILURE_GRACE_SECONDS = 5.0
"""After a rank fails, how long the others may take to end on their own before they are killed.

Over gloo a rank blocked on the failed one ends within about a second (measured on 2 CPU ranks);
a rank that is not blocked ends at its next transfer."""

_POLL_SECONDS = 1.0
"""How often the launcher looks for a written-down failure while no rank has exited."""

_folder: Path | None = None


def record_failures_in(folder: Path | None) -> None:
    """Make :func:`note_failure` write to ``folder`` in this process (the local launcher's ranks); ``None``: not."""
    global _folder  # one rank per process: where this process's rank writes its failure
    _folder = folder


@dataclass(frozen=True)
class RankFailure:
    """An error a rank raised, as written down before its process groups were torn down.

    Attributes:
        rank: Global rank.
        stage: Its pipeline stage.
        replica: Its data-parallel replica.
        seconds: ``time.time()`` when it was written down.
        error: ``"<type>: <message>"``.
        message: The exception's message alone.
        traceback: The formatted traceback.
        user_error: A :class:`~lorafusion_megatron.errors.TrainerError` (bad config, data, checkpoint).
    """

    rank: int
    stage: int
    replica: int
    seconds: float
    error: str
    message: str
    traceback: str
    user_error: bool


def _failure_file(folder: Path, rank: int) -> Path:
    return folder / f"failure-rank-{rank:05d}.json"


def note_failure(error: BaseException, *, rank: int, stage: int, replica: int) -> None:
    """Write ``error`` down for the launcher, if it asked (:func:`record_failures_in`); never raises."""
    if _folder is None:
        return
    failure = RankFailure(
        rank=rank,
        stage=stage,
        replica=replica,
        seconds=time.time(),
        error=f"{type(error).__name__}: {error}",
        message=str(error),
        traceback="".join(traceback.format_exception(error)),
        user_error=isinstance(error, TrainerError),
    )
    try:
        write_json_atomically(_failure_file(_folder, rank), asdict(failure))
    except OSError as exc:  # a full disk: the launcher then names the rank by its exit alone
        _log.warning("could not write rank %d's error down for the launcher: %s", rank, exc)


def read_failures(folder: Path) -> dict[int, RankFailure]:
    """The failures the ranks wrote to ``folder``, by rank (unreadable ones are left out)."""
    failures: dict[int, RankFailure] = {}
    for path in sorted(folder.glob("failure-rank-*.json")):
        try:
            failure = RankFailure(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue
        failures[failure.rank] = failure
    return failures


@dataclass(frozen=True)
class RankExit:
    """A rank's process that ended with a non-zero status before the launcher killed anything.

    Attributes:
        rank: Global rank.
        exitcode: ``multiprocessing``'s: the status, or minus the signal that ended it.
        error: What torch's spawn wrapper recorded of an exception the rank raised outside its
            process groups (``""`` when none).
    """

    rank: int
    exitcode: int
    error: str = ""


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().partition("\n")[0]
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


def _exit_cause(exit_: RankExit, *, signalled: bool) -> str:
    """Why a rank ended without writing an error down, and what is left of the run."""
    if exit_.exitcode >= 0:
        cause = f"pipeline rank {exit_.rank} exited with status {exit_.exitcode}"
        return f"{cause}:\n{exit_.error.rstrip()}" if exit_.error else cause
    try:
        name = signal.Signals(-exit_.exitcode).name
    except ValueError:
        name = f"signal {-exit_.exitcode}"
    if signalled and -exit_.exitcode in (signal.SIGTERM, signal.SIGINT):
        return (
            f"pipeline rank {exit_.rank} ended at the {name} passed on to it, before it could take it as a stop "
            "request (it was still starting): no checkpoint was written at this stop"
        )
    who = " (the kernel's out-of-memory killer, a job scheduler or kill -9)" if name == "SIGKILL" else ""
    return (
        f"pipeline rank {exit_.rank} was killed by {name}{who} and the run stopped; checkpoints are written "
        "whole or not at all, so `train ... --resume` continues from the newest one, if any"
    )


def first_failure(
    exits: Sequence[RankExit],
    failures: dict[int, RankFailure],
    killed: Sequence[int] = (),
    *,
    signalled: bool = False,
    grace_seconds: float = FAILURE_GRACE_SECONDS,
) -> str:
    """The message naming the rank whose failure stopped the run, and what the others did.

    The cause is, in this order: a rank that a signal ended (the OOM killer, ``kill -9``: a peer's
    failure never ends a rank that way); the error written down first (every peer's error came
    after the failing rank wrote its own down); the first rank seen to exit. A user error
    (:class:`~lorafusion_megatron.errors.TrainerError`) is its message alone, without the rank when
    every failed rank raised the same one (a refused resume: all ranks refuse it).

    Args:
        exits: Ranks that ended with a non-zero status, in the order the launcher saw them, before
            it killed any.
        failures: The errors the ranks wrote down, by rank.
        killed: Ranks the launcher killed, still running after the grace period.
        signalled: Whether a Ctrl-C (or SIGTERM) was passed on to the ranks.
        grace_seconds: How long the killed ranks were given to end on their own.
    """
    signal_deaths = [e for e in exits if e.exitcode < 0 and e.rank not in failures]
    if signal_deaths:
        rank, text = signal_deaths[0].rank, _exit_cause(signal_deaths[0], signalled=signalled)
    elif failures:
        first = min(failures.values(), key=lambda f: (f.seconds, f.rank))
        rank = first.rank
        where = f"pipeline rank {rank} (stage {first.stage}, replica {first.replica})"
        if first.user_error:
            if all(f.user_error and f.message == first.message for f in failures.values()):
                return first.message
            text = f"{where}: {first.message}"
        else:
            text = f"{where} failed, and the run stopped:\n{first.traceback.rstrip()}"
    elif exits:
        rank, text = exits[0].rank, _exit_cause(exits[0], signalled=signalled)
    else:
        return "the pipeline ranks failed without saying why"
    killed_text = f"killed, still running {grace_seconds:g} s later"
    by_rank = sorted(failures.values(), key=lambda f: f.rank)
    others = [(f.rank, _first_line(f.error), "raised an error") for f in by_rank]
    others += [(e.rank, f"exited with {e.exitcode}", "exited with an error") for e in exits if e.rank not in failures]
    others += [(r, killed_text, killed_text) for r in killed]
    others = [other for other in others if other[0] != rank]
    if others:
        text += f"\nthe other ranks stopped after it ({_summarised(others)})"
    return text


_OTHERS_SHOWN = 3
"""How many of the other ranks a failure message names one by one; the rest are counted."""


def _summarised(others: Sequence[tuple[int, str, str]]) -> str:
    """``rank 0: ...; rank 2: ...; rank 3: ...; and 60 other ranks: 59 killed, ..., 1 raised an error``.

    Each entry is a rank, what it did, and the kind of thing it did (how the rest are counted): with
    64 CPU ranks killed by the kernel, listing all 63 others made one line of 6 kB.
    """
    shown = [f"rank {rank}: {what}" for rank, what, _ in others[:_OTHERS_SHOWN]]
    rest = others[_OTHERS_SHOWN:]
    if rest:
        counts = Counter(kind for _, _, kind in rest)
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items(), key=lambda item: -item[1]))
        shown.append(f"and {len(rest)} other ranks: {kinds}")
    return "; ".join(shown)


def supervise(
    processes: Sequence[BaseProcess],
    folder: Path,
    *,
    errors: Callable[[int], str] = lambda rank: "",
    signalled: Callable[[], bool] = lambda: False,
    grace_seconds: float = FAILURE_GRACE_SECONDS,
) -> None:
    """Wait for the ranks; when one fails, stop the others and raise naming the rank that failed first.

    The grace period starts at the first non-zero exit or the first error a rank wrote down,
    whichever comes first: over NCCL a failed rank can block in tearing its process groups down
    while its peer waits on it, so neither would exit (measured on 2 H100s: no exit in 90 s).

    Args:
        processes: The ranks' processes, by global rank.
        folder: Where the ranks write their failures (:func:`record_failures_in`).
        errors: What torch's spawn wrapper recorded of a rank's exception (``""`` if nothing).
        signalled: Whether a Ctrl-C was passed on to the ranks (says why a rank ended at a SIGTERM).
        grace_seconds: How long the others may take to end after the first failure.

    Raises:
        TrainerError: A rank failed (:func:`first_failure` says which and how).
    """
    pending = {process.sentinel: rank for rank, process in enumerate(processes)}
    exits: list[RankExit] = []
    deadline: float | None = None
    while pending:
        timeout = _POLL_SECONDS if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(list(pending), timeout=timeout)
        for sentinel in ready:
            rank = pending.pop(sentinel)  # type: ignore[arg-type]  # wait() returns the int sentinels it was given
            processes[rank].join()
            exitcode = processes[rank].exitcode
            if exitcode:
                exits.append(RankExit(rank, exitcode, errors(rank) if exitcode > 0 else ""))
                if deadline is None:
                    deadline = time.monotonic() + grace_seconds
        if deadline is None and any(folder.glob("failure-rank-*.json")):
            # A rank wrote its error down but has not exited: over NCCL, tearing its process groups
            # down can block while a peer waits on it, so the failure, not an exit, starts the clock.
            deadline = time.monotonic() + grace_seconds
        if deadline is not None and time.monotonic() >= deadline:
            break  # the grace period is over
    failures = read_failures(folder)
    if not exits and not failures:
        return
    killed = sorted(pending.values())
    for rank in killed:
        processes[rank].kill()
    for process in processes:
        process.join()
    raise TrainerError(first_failure(exits, failures, killed, signalled=signalled(), grace_seconds=grace_seconds))
