"""Files written whole or not at all: a temporary file in the same folder, then a rename.

A crash or Ctrl-C in the middle of a write leaves the previous file (or none), never half of one;
the data reaches the disk before the rename, so a power loss does not leave an empty file either.
The mechanism is the scheduler's (:func:`lorafusion_sched.io.write_atomically`): a temporary per
thread and process (the stall watchdog's thread may write while the main thread does; the last
rename wins), links followed, permissions kept. What cannot be written (a folder in the way, a
full disk) raises :class:`~lorafusion_megatron.errors.TrainerError`, the launcher's clear error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafusion_megatron.errors import TrainerError
from lorafusion_sched.errors import SchedError
from lorafusion_sched.io import write_atomically

__all__ = ["write_json_atomically", "write_text_atomically"]


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` (UTF-8) in one rename, the data flushed to disk before it.

    Raises:
        TrainerError: ``path`` cannot be written: a folder in the way (the scheduler's message), a
            full disk or a read-only file system.
    """
    try:
        write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
    except SchedError as error:
        raise TrainerError(str(error)) from error
    except OSError as error:  # a full disk, a read-only file system: the file keeps its previous content
        raise TrainerError(f"cannot write {path}: {error.strerror or error}; it keeps its previous content") from error


def write_json_atomically(path: Path, data: Any) -> None:
    """Replace ``path`` by ``data`` as indented JSON with sorted keys, in one rename."""
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True))
