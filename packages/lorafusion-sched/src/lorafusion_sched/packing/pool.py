"""Solve packing tasks in parallel, one fresh Python process per worker.

The workers are started like multiprocessing's ``spawn`` (a new interpreter, never a fork of a
process that may already have run HiGHS, whose thread pool does not survive a fork), but as
``python -m lorafusion_sched.packing.worker``: unlike ``spawn`` and ``forkserver`` this never
re-imports the caller's ``__main__``, so a plain script without an ``if __name__ == "__main__"``
guard still works. Tasks are dealt round-robin so workers get similar loads; each task's result
streams back as soon as it is solved. A task whose worker fails keeps its greedy packing.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import IO, cast

from lorafusion_sched.packing.highs import SolverSettings
from lorafusion_sched.packing.problem import Packing, PackingProblem
from lorafusion_sched.packing.solve import TaskResult

__all__ = ["solve_in_workers"]

_DONE = object()


def _read(stream: IO[bytes], results: queue.Queue[object]) -> None:
    """Forward each complete result; a worker that dies mid-message just ends its stream."""
    try:
        with stream:
            while True:
                header = stream.read(8)
                if len(header) < 8:
                    break
                (size,) = struct.unpack("<Q", header)
                body = stream.read(size)
                if len(body) < size:
                    break
                results.put(pickle.loads(body))
    finally:
        results.put(_DONE)


def _start_worker(
    proc: subprocess.Popen[bytes], job: tuple[object, ...], results: queue.Queue[object]
) -> threading.Thread:
    """Send ``job`` to a started worker and forward its results from a reader thread."""
    assert proc.stdin is not None  # PIPE was requested
    assert proc.stdout is not None
    thread = threading.Thread(target=_read, args=(proc.stdout, results), daemon=True)
    thread.start()
    try:
        with proc.stdin:
            proc.stdin.write(pickle.dumps(job))
    except BrokenPipeError:
        pass  # the worker died at start-up; its exit code is reported by the caller
    return thread


def _collect(results: queue.Queue[object], streams: int, on_result: Callable[[int, TaskResult], None]) -> None:
    """Hand every result to ``on_result`` until each of the ``streams`` workers' readers is done."""
    finished = 0
    while finished < streams:
        item = results.get()
        if item is _DONE:
            finished += 1
            continue
        task_id, result = cast(tuple[int, TaskResult], item)
        on_result(task_id, result)


def solve_in_workers(
    work: Sequence[tuple[int, PackingProblem, Packing]],
    settings: SolverSettings,
    neighbourhood: int | None,
    workers: int,
    on_result: Callable[[int, TaskResult], None],
) -> str | None:
    """Solve ``work`` in ``workers`` processes, calling ``on_result(task_id, result)`` in this thread.

    Returns:
        ``None`` when every worker succeeded, else what went wrong (exit codes and the end of
        their stderr); tasks of a failed worker simply get no result.

    Raises:
        OSError: If no worker process can be started at all.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    results: queue.Queue[object] = queue.Queue()
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    not_started: list[str] = []
    with tempfile.TemporaryFile() as errors:
        try:
            for w in range(workers):
                part = list(work[w::workers])
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "lorafusion_sched.packing.worker"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=errors,
                        env=env,
                    )
                except OSError as err:
                    if not procs:
                        raise
                    not_started.append(f"{len(part)} tasks: {err}")
                    continue
                procs.append(proc)
                threads.append(_start_worker(proc, (part, settings, neighbourhood), results))
            _collect(results, len(procs), on_result)
        except BaseException:  # an interrupt, or on_result raising: no worker outlives the call
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        codes = []
        for proc, thread in zip(procs, threads, strict=True):
            thread.join()
            codes.append(proc.wait())
        if not any(codes) and not not_started:
            return None
        errors.seek(0)
        tail = errors.read().decode("utf-8", "replace").strip().splitlines()[-5:]
        return f"worker exit codes {codes}, not started {not_started}: " + " | ".join(tail)
