"""A write that fails for a full disk or a read-only file system: one clear error, not a traceback.

The writers this package calls fail in three ways: Python's file functions raise an ``OSError``,
safetensors raises its own ``SafetensorError`` (not an ``OSError``) whose text carries the OS error
(``Error while serializing: I/O error: No space left on device (os error 28)``), and ``torch.save``
raises a ``RuntimeError`` of its zip writer that names no cause at all. :func:`clear_write_errors`
turns each into :class:`CannotWriteError`, a :class:`~lorafusion_megatron.errors.TrainerError` (the
CLI's status 2) that names the folder or file being written and the reason: ``cannot write
runs/x/adapters/a: No space left on device``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lorafusion_megatron.errors import TrainerError

__all__ = ["CannotWriteError", "clear_write_errors", "write_failure"]

_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")
"""How safetensors' message (Rust's ``io::Error``) carries the OS error number."""

_TORCH_WRITER = ("PytorchStreamWriter", "inline_container")
"""Words of ``torch.save``'s zip writer's errors (a full disk: ``unexpected pos 704 vs 598``)."""


class CannotWriteError(TrainerError):
    """``path`` could not be written (a full disk, a read-only file system); nothing half-written is left.

    Attributes:
        path: What was being written (the target, not a staging folder beside it).
        reason: Why, as the operating system says it (``No space left on device``).
    """

    def __init__(self, path: Path, reason: str, advice: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path}: {reason}{advice}")


def write_failure(error: BaseException, where: Path | None = None) -> str | None:
    """Why a write failed, as the OS says it; ``None`` for an error that is not a failed write.

    Args:
        error: What the writer raised.
        where: The folder written to: for ``torch.save``'s error, which names no cause, the free
            space of its file system is given instead.
    """
    if isinstance(error, OSError):
        return error.strerror or str(error)
    text = str(error)
    if type(error).__name__ == "SafetensorError":  # safetensors' Rust error, not an OSError
        found = _OS_ERROR_IN_TEXT.search(text)
        return os.strerror(int(found.group(1))) if found else text.strip().splitlines()[0][:200]
    if isinstance(error, RuntimeError) and any(word in text for word in _TORCH_WRITER):
        first = text.strip().splitlines()[0][:200] if text.strip() else "no reason given"
        return f"torch.save failed ({first}){_free_space(where)}"
    return None


def _free_space(where: Path | None) -> str:
    """``; 12.0 KiB free on its file system`` for the nearest existing folder of ``where`` (``""`` if unknown)."""
    if where is None:
        return ""
    for folder in (where, *where.parents):
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            continue
        return f"; {free / 1024:.1f} KiB free on its file system"
    return ""


@contextmanager
def clear_write_errors(path: Path, advice: str = "") -> Iterator[None]:
    """Raise :class:`CannotWriteError` for ``path`` when a write inside the block fails.

    Other errors pass unchanged, and so does a :class:`~lorafusion_megatron.errors.TrainerError`
    (one raised by an inner write names its own path).

    Args:
        path: What the block writes, as the message names it.
        advice: Appended to the message (``; free space, then ...``).
    """
    try:
        yield
    except TrainerError:
        raise
    except Exception as error:
        reason = write_failure(error, path.parent)
        if reason is None:
            raise
        raise CannotWriteError(path, reason, advice) from error
