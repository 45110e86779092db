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

A run refused or failed before it wrote anything (a bad dataset line, ``--resume`` without a
checkpoint, a job folder in use) deletes the folders it created for itself on the way out, while it
still holds its locks (:func:`new_run_folders`, ``run_locks(tidy=...)``): they would hold nothing
but the lock file and an empty ``adapters/``. ``export`` takes the locks a run could take on its
``--output`` while it replaces that folder (:func:`export_locks`), so no run starts into it meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_layout import LOCK_FILE

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig

__all__ = [
    "absent_folders",
    "export_locks",
    "new_run_folders",
    "remove_unused_folders",
    "removed_if_unused_on_error",
    "run_lock",
    "run_locks",
]

_log = logging.getLogger(__name__)

# flock's errors on a file system that does not lock files (not a lock held by someone else).
_LOCKS_UNSUPPORTED = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


def absent_folders(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist, deepest first (what creating ``path`` creates)."""
    absent = []
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        absent.append(folder)
    return absent


def new_run_folders(config: TrainerConfig) -> list[Path]:
    """The folders a run of ``config`` would create for itself, deepest first: those that do not exist yet.

    Its ``output_dir``, each job's folder's parent (``adapters/``; the lock file of a job folder
    outside the run folder goes there too), TensorBoard's folder, and their missing ancestors.
    """
    paths = [Path(config.output_dir), *(config.job_output_dir(job).parent for job in config.jobs)]
    if config.logging.tensorboard_dir is not None:
        paths.append(Path(config.logging.tensorboard_dir))
    absent = {folder.absolute() for path in paths for folder in absent_folders(path.absolute())}
    return sorted(absent, key=lambda folder: (-len(folder.parts), str(folder)))


def remove_unused_folders(folders: Sequence[Path]) -> None:
    """Delete each of ``folders`` (new ones: :func:`new_run_folders`) that holds nothing but run lock files.

    Deepest first, so a run folder whose empty ``adapters/`` went first goes too; a folder holding
    anything else (a plan, a checkpoint, another process's files) is left as it is. Never raises.
    """
    for folder in sorted(folders, key=lambda folder: -len(folder.parts)):
        try:
            entries = list(folder.iterdir())
            if not all(entry.name.endswith(LOCK_FILE) and entry.is_file() for entry in entries):
                continue
            for entry in entries:
                entry.unlink(missing_ok=True)
            folder.rmdir()
        except OSError:  # gone, or not ours to delete after all: nothing to tidy
            continue


@contextmanager
def removed_if_unused_on_error(
    folders: Sequence[Path], *, unless: type[BaseException] | tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """When the block raises (``unless`` excepted), delete those of ``folders`` that hold only lock files.

    For the folders a run (or an export) created for itself: one that fails before it wrote
    anything leaves none behind (:func:`remove_unused_folders`).
    """
    try:
        yield
    except unless:
        raise
    except BaseException:
        remove_unused_folders(folders)
        raise


@contextmanager
def run_locks(config: TrainerConfig, *, tidy: Sequence[Path] = ()) -> Iterator[None]:
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

    Args:
        config: The run.
        tidy: Folders this run created (:func:`new_run_folders`, listed before any was): when the
            block raises, each that holds nothing but lock files is deleted, under the locks.

    Raises:
        TrainerError: Another process holds one of them (naming the folder, its process id and the
            key to change).
    """
    run_dir = Path(config.output_dir).resolve()
    folders = {config.job_output_dir(job).resolve(): (index, job.name) for index, job in enumerate(config.jobs)}
    with ExitStack() as held:
        # A TrainerError here is another run's lock: nothing in its folder is this run's to tidy.
        with removed_if_unused_on_error(tidy, unless=TrainerError):
            held.enter_context(run_lock(Path(config.output_dir)))
        # Under the locks from here: no run starting now can have written in the folders tidied.
        with removed_if_unused_on_error(tidy):
            for folder in sorted(folders):
                index, name = folders[folder]
                what = f"{folder}, job {name}'s output folder,"
                remedy = f"wait for it to end, or give job {name} another folder (jobs.{index}.output_dir)"
                create = not folder.is_relative_to(run_dir)
                held.enter_context(
                    _locked(folder.parent, f".{folder.name}{LOCK_FILE}", what, create=create, remedy=remedy)
                )
            # Only now, with those held, look for the run folders around them: a run starting meanwhile
            # into such a folder either left its lock file to be found here, or finds this run's.
            others: dict[Path, tuple[str, str]] = {}
            for folder in sorted(f for f in folders if not f.is_relative_to(run_dir)):
                other_run = next((parent for parent in folder.parents if (parent / LOCK_FILE).is_file()), None)
                if other_run is not None:
                    index, name = folders[folder]
                    others.setdefault(
                        other_run,
                        (
                            f"{other_run}, the run folder holding job {name}'s output folder,",
                            f"wait for it to end, or give job {name} a folder outside it (jobs.{index}.output_dir)",
                        ),
                    )
            for other_run in sorted(others):
                what, remedy = others[other_run]
                held.enter_context(_locked(other_run, LOCK_FILE, what, remedy=remedy))
            yield


@contextmanager
def export_locks(output: Path) -> Iterator[None]:
    """Hold, inside the block, every lock a run could take on ``output``, which ``export`` replaces whole.

    A run into ``output`` as its ``output_dir`` takes the run lock in it, and a run whose job writes
    its adapter there the lock file beside it; a run folder around ``output`` is locked by its run.
    The run lock is taken (its file created, with ``output`` if needed); the others only where their
    files exist (a run that never started holds none). When ``output`` is replaced, the old folder
    and the lock file in it go; when the block raises before that, the lock file goes, and so does
    ``output`` if this created it and it holds nothing else.

    Raises:
        TrainerError: A run holds one of them (naming it and its process id).
    """
    created = absent_folders(output.absolute())
    remedy = "wait for it to end, or choose another --output"
    with ExitStack() as held:
        with removed_if_unused_on_error(created, unless=TrainerError):  # a TrainerError: a run's lock file
            held.enter_context(_locked(output, LOCK_FILE, f"--output {output}", remedy=remedy))
        try:
            what = f"--output {output}, a job's output folder,"
            held.enter_context(_locked(output.parent, f".{output.name}{LOCK_FILE}", what, create=False, remedy=remedy))
            for parent in output.resolve().parents:
                if (parent / LOCK_FILE).is_file():
                    what = f"{parent}, the run folder holding --output {output},"
                    held.enter_context(_locked(parent, LOCK_FILE, what, create=False, remedy=remedy))
            yield
        except BaseException:
            (output / LOCK_FILE).unlink(missing_ok=True)  # still held: a run meanwhile was refused by it
            remove_unused_folders(created)
            raise


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
def _locked(
    folder: Path,
    name: str,
    what: str,
    *,
    create: bool = True,
    remedy: str = "wait for it to end, or choose another output_dir",
) -> Iterator[None]:
    """Hold an ``flock`` on ``folder / name``; ``what`` names the locked thing, ``remedy`` what to do when it is held.

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
            raise TrainerError(f"{what} is in use by another run (process {holder}): {remedy}") from None
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
