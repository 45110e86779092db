"""Progress of a run: where in the plan it is and what each job has done (saved in checkpoints)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["InvalidStateError", "JobProgress", "RunState", "whole_count"]


class InvalidStateError(ValueError):
    """A run state no run writes (edited by hand, say); the message names the entry and what is wrong with it."""


@dataclass
class JobProgress:
    """One job's counters.

    Attributes:
        name: Job name.
        total_steps: Optimizer steps the plan gives the job.
        steps_done: Optimizer steps taken.
        tokens: Tokens run through the model for the job (prompts included).
        targets: Trained tokens.
        pending_loss: Loss sums of global batches still being accumulated, by global batch index.
        pending_targets: Trained tokens seen so far of those global batches.
        first_loss: Mean loss of the first global batch.
        last_loss: Mean loss of the latest completed global batch.
        learning_rate: Learning rate of the latest step.
        grad_norm: Gradient norm (before clipping) of the latest step.
    """

    name: str
    total_steps: int
    steps_done: int = 0
    tokens: int = 0
    targets: int = 0
    pending_loss: dict[int, float] = field(default_factory=dict)
    pending_targets: dict[int, int] = field(default_factory=dict)
    first_loss: float | None = None
    last_loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None

    @property
    def finished(self) -> bool:
        """Whether every step of the job was taken."""
        return self.steps_done >= self.total_steps


@dataclass
class RunState:
    """Where the run is.

    Attributes:
        position: Index of the next plan microbatch to run.
        jobs: Per-job counters, in config order.
        total_optimizer_steps: Steps of all jobs together (what ``save_steps`` counts).
        seconds: Wall time spent executing the plan so far (start-up excluded), over all sessions.
    """

    position: int
    jobs: dict[str, JobProgress]
    total_optimizer_steps: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (dict keys become strings)."""
        return {
            "position": self.position,
            "total_optimizer_steps": self.total_optimizer_steps,
            "seconds": self.seconds,
            "jobs": [asdict(job) for job in self.jobs.values()],
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str = "state") -> RunState:
        """Inverse of :meth:`to_json`, checked to be what a run writes.

        A checkpoint's or summary's state may have been edited by hand since; an entry of the wrong
        type or out of range would otherwise surface much later, as a traceback or a run that
        claims to be complete, so it is refused here with the entry named.

        Args:
            data: The dict :meth:`to_json` returned, as read back from JSON.
            where: The entry's name in its file (``state`` in ``trainer_state.json``), for messages.

        Raises:
            InvalidStateError: An entry is missing, of the wrong type or out of range.
        """
        data = _object(data, where)
        jobs: dict[str, JobProgress] = {}
        listed = _at(where, "jobs")
        for index, raw in enumerate(_list(_required(data, "jobs", where), listed)):
            job = _job_from_json(raw, listed, index)
            if job.name in jobs:
                raise InvalidStateError(f"{listed}: job {job.name!r} appears twice")
            jobs[job.name] = job
        return cls(
            position=whole_count(_required(data, "position", where), _at(where, "position")),
            jobs=jobs,
            total_optimizer_steps=whole_count(
                _required(data, "total_optimizer_steps", where), _at(where, "total_optimizer_steps")
            ),
            seconds=_seconds(_required(data, "seconds", where), _at(where, "seconds")),
        )


_JOB_KEYS = frozenset(field.name for field in fields(JobProgress))
_COUNTS = ("steps_done", "tokens", "targets")
"""A job's counters besides ``total_steps`` (absent: 0)."""
_NUMBERS = ("first_loss", "last_loss", "learning_rate", "grad_norm")
"""A job's measurements (absent or ``null``: none yet)."""


def _job_from_json(raw: Any, listed: str, index: int) -> JobProgress:
    """Entry ``index`` of the job counters ``listed``, checked as :meth:`RunState.from_json` says."""
    where = f"{listed}[{index}]"
    raw = _object(raw, where)
    unknown = sorted(set(raw) - _JOB_KEYS)
    if unknown:
        raise InvalidStateError(f"{where}: unknown key {', '.join(map(repr, unknown))}")
    name = _required(raw, "name", where)
    if not isinstance(name, str) or not name:
        raise InvalidStateError(f"{_at(where, 'name')}: {name!r} is not a job name")
    where = f"{listed}[{name}]"  # as the config's differences name jobs
    job = JobProgress(
        name=name, total_steps=whole_count(_required(raw, "total_steps", where), _at(where, "total_steps"))
    )
    for key in _COUNTS:
        if key in raw:
            setattr(job, key, whole_count(raw[key], _at(where, key)))
    if job.steps_done > job.total_steps:
        raise InvalidStateError(
            f"{_at(where, 'steps_done')}: {job.steps_done} is more than the job's total_steps, {job.total_steps}"
        )
    for key in _NUMBERS:
        if raw.get(key) is not None:
            setattr(job, key, _number(raw[key], _at(where, key)))
    job.pending_loss = {
        _batch_index(key, _at(where, "pending_loss")): _number(value, _at(where, f"pending_loss[{key}]"))
        for key, value in _object(raw.get("pending_loss", {}), _at(where, "pending_loss")).items()
    }
    job.pending_targets = {
        _batch_index(key, _at(where, "pending_targets")): whole_count(value, _at(where, f"pending_targets[{key}]"))
        for key, value in _object(raw.get("pending_targets", {}), _at(where, "pending_targets")).items()
    }
    return job


def _at(where: str, key: str) -> str:
    """``where.key``, or ``key`` at the top level of a file."""
    return f"{where}.{key}" if where else key


def _required(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise InvalidStateError(f"{where or 'the top level'}: {key!r} is missing")
    return data[key]


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidStateError(f"{where or 'the top level'}: a {type(value).__name__}, not an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidStateError(f"{where}: a {type(value).__name__}, not a list")
    return value


def whole_count(value: Any, where: str) -> int:
    """A whole number of at least 0 (``bool`` is not one, though Python counts it as an ``int``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidStateError(f"{where}: {value!r} is not a whole number of at least 0")
    return value


def _number(value: Any, where: str) -> float:
    """A JSON number (a loss may be ``NaN`` or infinite: a run that diverged writes those too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidStateError(f"{where}: {value!r} is not a number")
    return float(value)


def _seconds(value: Any, where: str) -> float:
    seconds = _number(value, where)
    if not 0.0 <= seconds < math.inf:
        raise InvalidStateError(f"{where}: {value!r} is not a duration in seconds (0 or more)")
    return seconds


def _batch_index(key: Any, where: str) -> int:
    """A global batch's index, a key of ``pending_loss`` or ``pending_targets`` (a string once written as JSON)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:  # torch.save keeps int keys
        return key
    raise InvalidStateError(f"{where}: key {key!r} is not a global batch index")
