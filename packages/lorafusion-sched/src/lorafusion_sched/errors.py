"""The one exception type for errors a user can cause (bad jobs, options, files), and its warning."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafusion_sched.models import Violation

__all__ = ["InvalidPlanError", "SchedError", "SchedWarning", "UnknownNameError"]


class SchedError(ValueError):
    """A problem with the scheduler's input: the message names the field, the value and the fix.

    Subclasses ``ValueError`` so that callers who already catch ``ValueError`` keep working.
    """


class InvalidPlanError(SchedError):
    """A plan that ``verify`` finds violations in, refused by ``simulate``; ``violations`` holds them all.

    Attributes:
        violations: ``verify``'s list (``Violation`` objects), for a caller that shows them.
    """

    def __init__(self, message: str, violations: list[Violation]) -> None:
        super().__init__(message)
        self.violations = violations


class UnknownNameError(SchedError, KeyError):
    """A name looked up that does not exist; the message lists the names that do.

    Also a ``KeyError``, so that code written for a mapping's lookup (``except KeyError``) keeps
    working; unlike ``KeyError`` its text is the message itself, not its ``repr``.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SchedWarning(UserWarning):
    """A plan was made, but with something the user may want to change (the message says what).

    Filter it like any warning, e.g. ``warnings.simplefilter("ignore", SchedWarning)``.
    """
