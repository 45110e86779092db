"""Folders replaced whole or not at all: a finished folder next to the target, then a swap.

A checkpoint, an adapter or an export is written in full into a hidden folder next to where it
goes, its files flushed to disk, and only then takes the target's place:

- On Linux, ``renameat2(RENAME_EXCHANGE)`` swaps the two folders in one atomic step: at every
  moment the target is the old complete folder or the new one, even across a power loss.
- Where the file system cannot swap (macOS, some network file systems), two renames do it: the old
  folder to ``.<name>.replaced`` beside it, then the new one into place. A crash between the two
  leaves the target absent and the old folder kept; :func:`restore_interrupted_replace` puts it
  back (the next :func:`replace_dir` calls it, and so does a run's start, under its locks).

Nothing but the target and the two hidden names that this module owns is ever renamed or deleted
(a user's ``<name>.old`` stays untouched). The folder's files and folders get the permissions a
file or folder the user creates gets (the umask's): ``safetensors`` creates its files readable by
their owner only, and a temporary folder is its owner's only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path

__all__ = ["replace_dir", "replaced_name", "restore_interrupted_replace"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_CANNOT_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}
"""``renameat2`` errors that mean this kernel or file system cannot swap: fall back to two renames."""


def replaced_name(target: Path) -> Path:
    """Where the two-rename fallback keeps ``target``'s old folder between its renames."""
    return target.with_name(f".{target.name}.replaced")


def restore_interrupted_replace(target: Path) -> None:
    """Finish what a crash inside the two-rename fallback of :func:`replace_dir` left.

    ``target`` absent with ``.<name>.replaced`` beside it: the crash came between the renames, and
    the old folder is renamed back. Both present: it came after them, and the old copy is deleted.
    """
    replaced = replaced_name(target)
    if not replaced.is_dir():
        return
    if target.exists():
        shutil.rmtree(replaced)
    else:
        os.replace(replaced, target)


def replace_dir(source: Path, target: Path) -> None:
    """Move the finished folder ``source`` to ``target``, replacing an older ``target`` atomically.

    ``source`` must sit next to ``target`` (same file system, so that renames are atomic). Its
    files are flushed to disk first. Afterwards ``source`` no longer exists.
    """
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a file is where the folder goes", str(target))
    _give_default_permissions(source)
    _sync_tree(source)
    restore_interrupted_replace(target)
    if target.is_dir() and _exchange(source, target):
        shutil.rmtree(source)  # now the old folder
    else:
        _replace_in_two_renames(source, target)
    _sync_dir(target.parent)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step with Linux's ``renameat2``; ``False`` where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    status = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if status == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(second))


def _replace_in_two_renames(source: Path, target: Path) -> None:
    replaced = replaced_name(target)
    if target.exists():
        os.replace(target, replaced)
    try:
        os.replace(source, target)
    except BaseException:
        restore_interrupted_replace(target)
        raise
    if replaced.exists():
        shutil.rmtree(replaced)


def _umask() -> int:
    """The process's umask: read from ``/proc`` where Linux offers it, else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_default_permissions(folder: Path) -> None:
    """``chmod`` ``folder`` and everything under it to ``0o777`` (folders) or ``0o666`` (files) less the umask."""
    mask = _umask()
    for parent, _, files in os.walk(folder):
        os.chmod(parent, 0o777 & ~mask)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):  # a link's own mode means nothing; its target is not ours
                os.chmod(path, 0o666 & ~mask)


def _sync_tree(folder: Path) -> None:
    """``fsync`` every file and folder under ``folder``: their data is on disk before the rename."""
    for parent, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(parent, name), "rb") as handle:
                os.fsync(handle.fileno())
        _sync_dir(Path(parent))


def _sync_dir(folder: Path) -> None:
    """``fsync`` a folder's entries (its renames), where the platform allows opening a folder."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder; its renames are durable on their own
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
