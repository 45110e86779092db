"""The one exception type for problems a user can cause and fix (config, data, files, resume)."""

from __future__ import annotations

__all__ = ["TrainerError"]


class TrainerError(ValueError):
    """Bad input to the trainer; the message names the key or file and says what to change.

    Subclasses ``ValueError`` so that callers who already catch ``ValueError`` keep working.
    """
