"""What a person sees while the run trains: a progress bar, TensorBoard scalars, a summary table."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from lorafusion_megatron.host_checks import tensorboard_missing

if TYPE_CHECKING:
    from lorafusion_megatron.optim import StepStats
    from lorafusion_megatron.state import JobProgress, RunState

__all__ = ["ProgressDisplay", "TensorBoardLogger", "summary_table"]

_log = logging.getLogger(__name__)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f}" if seconds > 0 else "-"


def _relative(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


class ProgressDisplay:
    """A rich progress bar over the plan's microbatches with one line per job.

    Args:
        total: Microbatches in the plan.
        completed: Microbatches already run (on resume).
        enabled: ``False`` shows nothing (logs stay).
        console: Where to draw (stderr by default).
    """

    def __init__(self, total: int, completed: int, *, enabled: bool, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            disable=not enabled,
        )
        self._run = self._progress.add_task("microbatches", total=total, completed=completed, info="")
        self._jobs: dict[str, Any] = {}

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, state: RunState) -> None:
        """Redraw from the run's counters."""
        tokens = sum(job.tokens for job in state.jobs.values())
        self._progress.update(self._run, completed=state.position, info=f"{_rate(tokens, state.seconds)} tok/s")
        for job in state.jobs.values():
            task = self._jobs.get(job.name)
            if task is None:
                task = self._progress.add_task(f"  {job.name}", total=job.total_steps, info="")
                self._jobs[job.name] = task
            self._progress.update(
                task,
                completed=job.steps_done,
                info=f"loss {_loss(job.last_loss)}  {_rate(job.tokens, state.seconds)} tok/s",
            )


class TensorBoardLogger:
    """Per-job scalars (loss, learning rate, gradient norm, tokens/s) under ``<dir>/<job>/``.

    Does nothing, after one message saying why, when TensorBoard is not installed.

    Args:
        directory: Event folder, or ``None`` for no TensorBoard.
        interval: Write a job's scalars every this many of its steps, and at its last step.
    """

    def __init__(self, directory: str | None, interval: int) -> None:
        self.interval = interval
        self._writers: dict[str, Any] = {}
        self._directory = Path(directory) if directory is not None else None
        missing = tensorboard_missing(directory)
        if missing is not None:
            _log.warning("%s", missing)
            self._directory = None

    def _writer(self, job: str) -> Any:
        """The event writer of ``job``'s folder (opened on first use)."""
        assert self._directory is not None
        writer = self._writers.get(job)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(self._directory / job))
            self._writers[job] = writer
        return writer

    def log_step(self, job: JobProgress, stats: StepStats, seconds: float) -> None:
        """Record one optimizer step of ``job``: every ``interval``-th, and its last."""
        if self._directory is None or (stats.step % self.interval and stats.step != job.total_steps):
            return
        writer = self._writer(job.name)
        writer.add_scalar("train/loss", job.last_loss, stats.step)
        writer.add_scalar("train/learning_rate", stats.learning_rate, stats.step)
        writer.add_scalar("train/grad_norm", stats.grad_norm, stats.step)
        if seconds > 0:
            writer.add_scalar("train/tokens_per_second", job.tokens / seconds, stats.step)

    def log_eval(self, job: str, step: int, loss: float) -> None:
        """Record ``job``'s eval loss after its optimizer step ``step`` (every evaluation, whatever the interval)."""
        if self._directory is not None:
            self._writer(job).add_scalar("eval/loss", loss, step)

    def close(self) -> None:
        """Flush and close every event file."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def summary_table(state: RunState, outputs: dict[str, Path], root: Path) -> Table:
    """The end-of-run table: per job steps, first/last loss, tokens, tokens/s and adapter folder.

    Args:
        state: The finished run's counters.
        outputs: Each job's adapter folder.
        root: The run's output folder; adapter folders inside it are shown relative to it.
    """
    table = Table(title=f"LoRAFusion training summary ({root})")
    for header, justify in (
        ("job", "left"),
        ("steps", "right"),
        ("first loss", "right"),
        ("last loss", "right"),
        ("tokens", "right"),
        ("tokens/s", "right"),
        ("adapter", "left"),
    ):
        table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for job in state.jobs.values():
        table.add_row(
            job.name,
            f"{job.steps_done}/{job.total_steps}",
            _loss(job.first_loss),
            _loss(job.last_loss),
            f"{job.tokens:,}",
            _rate(job.tokens, state.seconds),
            _relative(outputs[job.name], root) if job.name in outputs else "-",
        )
    total = sum(job.tokens for job in state.jobs.values())
    table.add_section()
    table.add_row("all", "", "", "", f"{total:,}", _rate(total, state.seconds), f"{state.seconds:.1f} s")
    return table
