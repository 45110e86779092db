"""Progress of a run: where in the plan it is and what each job has done (saved in checkpoints)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["JobProgress", "RunState"]


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
    def from_json(cls, data: dict[str, Any]) -> RunState:
        """Inverse of :meth:`to_json`."""
        jobs = {}
        for raw in data["jobs"]:
            job = JobProgress(**raw)
            job.pending_loss = {int(k): float(v) for k, v in raw["pending_loss"].items()}
            job.pending_targets = {int(k): int(v) for k, v in raw["pending_targets"].items()}
            jobs[job.name] = job
        return cls(
            position=int(data["position"]),
            jobs=jobs,
            total_optimizer_steps=int(data["total_optimizer_steps"]),
            seconds=float(data["seconds"]),
        )
