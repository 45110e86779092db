"""The one exception type for errors a user can cause (bad jobs, options, files)."""

from __future__ import annotations

__all__ = ["SchedError"]


class SchedError(ValueError):
    """A problem with the scheduler's input: the message names the field, the value and the fix.

    Subclasses ``ValueError`` so that callers who already catch ``ValueError`` keep working.
    """
