"""Worker process for parallel MILP solves: ``python -m lorafusion_sched.packing.worker``.

It reads one pickled ``(tasks, settings, neighbourhood)`` from stdin and writes one
length-prefixed pickled ``(task_id, TaskResult)`` per task to stdout as soon as it is solved. The
pickles only travel between the planner and the workers it started itself. The results go through
a private copy of the stdout descriptor, and descriptor 1 itself is pointed at stderr, so nothing
else written to stdout (a C library's banner, a stray print) can break their framing.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys

from lorafusion_sched.packing.solve import pack_with_milp

__all__ = ["main"]


def main() -> None:
    """Solve the tasks sent on stdin, streaming results to stdout."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    tasks, settings, neighbourhood = pickle.load(sys.stdin.buffer)
    for task_id, problem, greedy in tasks:
        data = pickle.dumps((task_id, pack_with_milp(problem, greedy, settings, neighbourhood)))
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()


if __name__ == "__main__":
    main()
