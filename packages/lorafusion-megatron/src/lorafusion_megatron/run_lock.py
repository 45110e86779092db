"""One run per output folder: an exclusive lock on ``<output_dir>/.lorafusion-run.lock`` while a run writes.

Two runs into one folder would interleave their adapters, ``summary.json``, checkpoints and
checkpoint pruning. The lock is an ``flock`` on the file: the operating system releases it when the
process ends in any way (a crash or ``kill -9`` included), so a stale lock never blocks a later run.
The file itself stays; it holds the last holder's process id, for the message.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lorafusion_megatron.errors import TrainerError

__all__ = ["LOCK_FILE", "run_lock"]

LOCK_FILE = ".lorafusion-run.lock"


@contextmanager
def run_lock(output_dir: Path) -> Iterator[None]:
    """Hold the run lock of ``output_dir`` (created if needed) inside the block.

    Raises:
        TrainerError: Another process holds it (naming its process id).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            raise TrainerError(
                f"{output_dir} is in use by another run (process {holder}): wait for it to end, or choose "
                "another output_dir"
            ) from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
