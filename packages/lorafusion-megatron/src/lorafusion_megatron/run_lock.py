"""One run per output folder: an exclusive lock on ``<output_dir>/.lorafusion-run.lock`` while a run writes.

Two runs into one folder would interleave their adapters, ``summary.json``, checkpoints and
checkpoint pruning. A job's adapter folder outside the run folder gets a lock of its own, the file
``.<folder name>.lorafusion-run.lock`` beside it (not in it: the adapter folder is replaced whole),
so two runs with different run folders cannot write one adapter folder either (see :func:`run_locks`).

A lock is an ``flock`` on its file: the operating system releases it when the process ends in any
way (a crash or ``kill -9`` included), so a stale lock never blocks a later run. The file itself
stays; it holds the last holder's process id, for the message.

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
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_layout import LOCK_FILE

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig

__all__ = ["run_lock", "run_locks"]

_log = logging.getLogger(__name__)

# flock's errors on a file system that does not lock files (not a lock held by someone else).
_LOCKS_UNSUPPORTED = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


@contextmanager
def run_locks(config: TrainerConfig) -> Iterator[None]:
    """Hold the run lock of ``config.output_dir`` and the locks of its jobs' folders inside the block.

    A job folder outside the run folder is locked by a file beside it, named after its real path
    (symbolic links resolved), so two runs that reach one folder by different paths take one lock;
    when it lies inside another run's folder (one with a run lock file), that run's lock is taken
    too, since that run may write the folder as its own default. A job folder inside the run folder
    is covered by the run lock, and by the lock file beside it where one exists (none is created,
    so that the adapters' folder holds only adapters): another run that named it as its own job's
    folder, before this run ever took its run lock, holds that file. The run lock comes first, the
    job folders' locks next, the other runs' last (so that of two runs starting at once into one
    folder, one always finds the other's lock).

    Raises:
        TrainerError: Another process holds one of them (naming the folder and its process id).
    """
    run_dir = Path(config.output_dir).resolve()
    folders = {config.job_output_dir(job).resolve(): job.name for job in config.jobs}
    with ExitStack() as held:
        held.enter_context(run_lock(Path(config.output_dir)))
        for folder in sorted(folders):
            what = f"{folder}, job {folders[folder]}'s output folder,"
            create = not folder.is_relative_to(run_dir)
            held.enter_context(_locked(folder.parent, f".{folder.name}{LOCK_FILE}", what, create=create))
        # Only now, with those held, look for the run folders around them: a run starting meanwhile
        # into such a folder either left its lock file to be found here, or finds this run's.
        others: dict[Path, str] = {}
        for folder in sorted(f for f in folders if not f.is_relative_to(run_dir)):
            other_run = next((parent for parent in folder.parents if (parent / LOCK_FILE).is_file()), None)
            if other_run is not None:
                others.setdefault(
                    other_run, f"{other_run}, the run folder holding job {folders[folder]}'s output folder,"
                )
        for other_run in sorted(others):
            held.enter_context(_locked(other_run, LOCK_FILE, others[other_run]))
        yield


@contextmanager
def run_lock(output_dir: Path) -> Iterator[None]:
    """Hold the run lock of ``output_dir`` (created if needed) inside the block.

    Where the file system does not lock files, warns and holds nothing.

    Raises:
        TrainerError: Another process holds it (naming its process id).
    """
    with _locked(output_dir, LOCK_FILE, str(output_dir)):
        yield


@contextmanager
def _locked(folder: Path, name: str, what: str, *, create: bool = True) -> Iterator[None]:
    """Hold an ``flock`` on ``folder / name``; ``what`` names the locked thing.

    ``create``: make the folder and the file if needed; else a missing file is no lock to take.
    """
    if not create:
        try:
            descriptor = os.open(folder / name, os.O_RDWR)
        except FileNotFoundError:
            yield
            return
    else:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            raise TrainerError(
                f"{what} is in use by another run (process {holder}): wait for it to end, or choose another output_dir"
            ) from None
        except OSError as error:
            if error.errno not in _LOCKS_UNSUPPORTED:
                raise
            _log.warning(
                "%s is on a file system that does not lock files (%s): the run goes on without its run lock, so "
                "nothing refuses a second run into this folder meanwhile (on Lustre, mount with -o flock)",
                folder,
                error.strerror,
            )
            locked = False
        if locked:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
