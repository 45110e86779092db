"""Progress of a pipeline run as one rank sees it: the bar, step logs and TensorBoard scalars.

The last stage of replica 0 computes the losses, so that rank alone reports, with the
single-process trainer's :mod:`~lorafusion_megatron.reporting` (rich progress bar with per-job
loss and tokens/s, TensorBoard scalars under ``<tensorboard_dir>/<job>/``) and its
:class:`~lorafusion_megatron.state.RunState` counters, which travel in that rank's checkpoint file
and in the run's summary (for the final table). Tokens are counted from the program, for every
replica at once: when replica 0 finishes the backward of its microbatch of a round, the whole
round (``d`` microbatches, one per replica) has been through the pipeline up to that point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rich.console import Console

from lorafusion_megatron.optim import StepStats
from lorafusion_megatron.reporting import ProgressDisplay, TensorBoardLogger
from lorafusion_megatron.state import JobProgress, RunState

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig
    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_megatron.pipeline.engine import StepRecord
    from lorafusion_megatron.pipeline.programs import Program

__all__ = ["PipelineProgress", "fresh_state"]

_log = logging.getLogger(__name__)


def fresh_state(data: Mapping[str, JobData], *, drop_last: bool) -> RunState:
    """Counters of a run that has not started: every job at step 0 of its optimizer steps."""
    return RunState(
        position=0,
        jobs={
            name: JobProgress(name=name, total_steps=job.num_global_batches(drop_last=drop_last))
            for name, job in data.items()
        },
    )


class PipelineProgress:
    """Keeps the run's counters and shows them; the engine's ``on_backward`` and ``on_step`` hooks.

    Args:
        config: The run (``logging`` section: progress bar, TensorBoard folder, interval).
        program: What the engine executes (tokens per round, the bar's length).
        data: Every job's data (trained tokens per sample).
        state: The counters to continue (restored from a checkpoint, or :func:`fresh_state`).
        console: Where the bar goes (stderr by default).
    """

    def __init__(
        self,
        config: TrainerConfig,
        program: Program,
        data: Mapping[str, JobData],
        state: RunState,
        *,
        console: Console | None = None,
    ) -> None:
        self.state = state
        self._data = data
        self._microbatches = [mb for run in program.runs for mb in run]
        self._replicas = program.data_parallel
        self._every = config.logging.logging_steps
        self._display = ProgressDisplay(
            program.num_microbatches,
            state.position,
            enabled=config.logging.progress_bar,
            console=console or Console(stderr=True),
        )
        self._tensorboard = TensorBoardLogger(config.logging.tensorboard_dir, config.logging.logging_steps)
        self._seconds_before = state.seconds
        self._clock = time.perf_counter()

    def __enter__(self) -> PipelineProgress:
        self._clock = time.perf_counter()
        self._display.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._display.__exit__(*exc)
        self._tensorboard.close()

    def _tick(self) -> None:
        self.state.seconds = self._seconds_before + time.perf_counter() - self._clock
        self._display.update(self.state)

    def microbatch_done(self, key: int) -> None:
        """Replica 0's microbatch ``key`` (program index) finished its backward: count its round."""
        for microbatch in self._microbatches[key : key + self._replicas]:
            for segment in microbatch.segments:
                job = self.state.jobs[segment.adapter]
                job.tokens += segment.tokens
                data = self._data[segment.adapter]
                job.targets += sum(data.sample(i).num_targets for i in segment.samples)
        self.state.position = key + self._replicas
        self._tick()

    def stepped(self, record: StepRecord) -> None:
        """An adapter stepped: its loss, learning rate and gradient norm to the bar, the log and TensorBoard."""
        job = self.state.jobs[record.adapter]
        job.steps_done = record.step
        job.last_loss = record.loss
        if job.first_loss is None:
            job.first_loss = record.loss
        job.learning_rate = record.learning_rate
        job.grad_norm = record.grad_norm
        self.state.total_optimizer_steps += 1
        self._tick()
        stats = StepStats(step=record.step, learning_rate=record.learning_rate, grad_norm=record.grad_norm)
        self._tensorboard.log_step(job, stats, self.state.seconds)
        if record.step % self._every == 0 or job.finished:
            _log.info(
                "%s step %d/%d  loss %.4f  lr %.3g  grad norm %.3g",
                record.adapter,
                record.step,
                job.total_steps,
                job.last_loss,
                record.learning_rate,
                record.grad_norm,
            )

    def finish(self, position: int) -> None:
        """The engine stopped before program index ``position`` (its end, or a stop's cut)."""
        self.state.position = position
        self._tick()
