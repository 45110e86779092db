"""Files written whole or not at all: a temporary file in the same folder, then a rename.

A crash or Ctrl-C in the middle of a write leaves the previous file (or none), never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomically", "write_text_atomically"]


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` (UTF-8) in one rename."""
    # open() (unlike tempfile's 0600 files) gives the file the usual permissions of the user's umask.
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_json_atomically(path: Path, data: Any) -> None:
    """Replace ``path`` by ``data`` as indented JSON with sorted keys, in one rename."""
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True))
