"""One run per output folder: an exclusive lock on ``<output_dir>/.lorafusion-run.lock`` while a run writes.

Two runs into one folder would interleave their adapters, ``summary.json``, checkpoints and
checkpoint pruning. The lock is an ``flock`` on the file: the operating system releases it when the
process ends in any way (a crash or ``kill -9`` included), so a stale lock never blocks a later run.
The file itself stays; it holds the last holder's process id, for the message.

On a file system that does not lock files (Lustre mounted without ``flock``, NFS without a lock
daemon: ``flock`` fails with ``ENOSYS``, ``ENOLCK`` or ``EOPNOTSUPP``) the run goes on without the
lock, after a warning: refusing would leave such a cluster no way to train.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_layout import LOCK_FILE

__all__ = ["run_lock"]

_log = logging.getLogger(__name__)

# flock's errors on a file system that does not lock files (not a lock held by someone else).
_LOCKS_UNSUPPORTED = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


@contextmanager
def run_lock(output_dir: Path) -> Iterator[None]:
    """Hold the run lock of ``output_dir`` (created if needed) inside the block.

    Where the file system does not lock files, warns and holds nothing.

    Raises:
        TrainerError: Another process holds it (naming its process id).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            raise TrainerError(
                f"{output_dir} is in use by another run (process {holder}): wait for it to end, or choose "
                "another output_dir"
            ) from None
        except OSError as error:
            if error.errno not in _LOCKS_UNSUPPORTED:
                raise
            _log.warning(
                "%s is on a file system that does not lock files (%s): the run goes on without its run lock, so "
                "nothing refuses a second run into this folder meanwhile (on Lustre, mount with -o flock)",
                output_dir,
                error.strerror,
            )
            locked = False
        if locked:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
