"""Files written whole or not at all: a temporary file in the same folder, then a rename.

A crash or Ctrl-C in the middle of a write leaves the previous file (or none), never half of one;
the data reaches the disk before the rename, so a power loss does not leave an empty file either.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomically", "write_text_atomically"]


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` (UTF-8) in one rename, the data flushed to disk before it.

    Each thread and process writes its own temporary file (the stall watchdog's thread may write
    while the main thread does); the last rename wins.
    """
    # open() (unlike tempfile's 0600 files) gives the file the usual permissions of the user's umask.
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with temporary.open("w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_json_atomically(path: Path, data: Any) -> None:
    """Replace ``path`` by ``data`` as indented JSON with sorted keys, in one rename."""
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True))
