"""``train --resume`` of a run that already finished: it says so and leaves the run's outputs alone.

A run that reaches the end of its plan writes its summary (``summary.json`` from the single-process
trainer, ``pipeline_summary.json`` from the pipeline runtime) with its ``run_id`` (drawn when the run
starts afresh and carried by every checkpoint it writes, through any number of resumes) and the
config it was trained with; a pipeline run's also records its parallel settings. ``--resume`` takes
the run in ``output_dir`` as finished when its summary holds an id, says the run ended (a pipeline
summary is also written when Ctrl-C stopped the run: it then names the checkpoint it wrote), and the
newest checkpoint, if there is one, carries the same id: a run started afresh there later
(``train --overwrite`` once the checkpoints were deleted) carries another, and is resumed. A summary
written by an earlier version holds no id; its run is resumed from its newest checkpoint, as that
version did.

A run that starts afresh (``train --overwrite`` into a finished run's folder) deletes both summaries
first (:func:`forget_finished_run`), before it replaces any adapter: a crash or a full disk among its
final adapter writes then leaves a folder that ``--resume`` does not call complete (its adapters
would be a mix of the two runs'), and the message of such a failure says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.checkpoint import (
    RunFingerprint,
    checkpoint_run_id,
    config_match,
    config_refusal,
    latest_checkpoint,
)
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.run_layout import PIPELINE_SUMMARY, SUMMARY
from lorafusion_megatron.state import InvalidStateError, JobProgress, RunState

if TYPE_CHECKING:
    from lorafusion_megatron.config import TrainerConfig

__all__ = ["FinishedRun", "finished_run", "forget_finished_run", "new_run_id"]

_log = logging.getLogger(__name__)

_COUNTERS = {field.name for field in dataclasses.fields(JobProgress)}
"""The keys of a job's entry in ``summary.json`` that are its counters (``eval_loss`` is not)."""

_WEIGHTS = "adapter_model.safetensors"
"""A finished adapter's weights file, as PEFT names it (both runtimes write safetensors)."""

_REMEDY = "nothing to resume; to train this config, train without --resume into a new output_dir"


def new_run_id() -> str:
    """The id of a run that starts afresh (32 hex digits)."""
    return uuid.uuid4().hex


def forget_finished_run(output_dir: Path) -> None:
    """Delete the summaries that say a run in ``output_dir`` finished; a run starting afresh there calls it first.

    Either summary makes ``--resume`` take the run for complete when no newer checkpoint says
    otherwise (with ``save_steps: null`` there is none), so a fresh run that failed among its final
    adapter writes, with the earlier run's summary still there, was reported complete over a mix of
    both runs' adapters. The new run writes its own summary after all its adapters.
    """
    for name in (SUMMARY, PIPELINE_SUMMARY):
        (output_dir / name).unlink(missing_ok=True)


@dataclass(frozen=True)
class FinishedRun:
    """A run that reached the end of its plan, as its summary records it.

    Attributes:
        summary: The summary file (``summary.json``, or ``pipeline_summary.json`` of a pipeline run).
        record: Its content, with the ``fingerprint`` and ``config`` the run was trained with (and a
            pipeline run's ``parallel`` settings).
        state: The run's final position and per-job counters.
        adapters: Each job's adapter folder.
    """

    summary: Path
    record: dict[str, Any]
    state: RunState
    adapters: dict[str, Path]

    @property
    def progress(self) -> str:
        """``complete at step 8 (first 5/5, second 3/3 optimizer steps)``."""
        jobs = ", ".join(f"{name} {job.steps_done}/{job.total_steps}" for name, job in self.state.jobs.items())
        return f"complete at step {self.state.total_optimizer_steps} ({jobs} optimizer steps)"

    def check_config(self, fingerprint: RunFingerprint, *, parallel: Mapping[str, Any] | None = None) -> None:
        """Refuse a config that differs from the run's in what decides the trained weights.

        Only the config is compared (the data is not read again); settings that cannot change the
        result may differ, as for a resume (:mod:`~lorafusion_megatron.resume_config`).

        Args:
            fingerprint: This run's (:func:`~lorafusion_megatron.checkpoint.run_fingerprint`).
            parallel: A pipeline run's stages, replicas and schedule
                (:meth:`~lorafusion_megatron.pipeline.options.ParallelConfig.layout_settings`), which
                must be those the run was trained with, as for a resume from its checkpoints.

        Raises:
            TrainerError: Naming the changed keys (or both parallel settings) and what to do instead.
        """
        match = config_match(self.record, fingerprint)
        if match == "other":
            raise self._refused(config_refusal(self.record, fingerprint, remedy=_REMEDY, finished=True))
        if match == "moved":
            _log.warning(
                "the datasets' paths differ from those %s was trained on; nothing is read, so their content "
                "is not compared with the run's",
                self.summary.parent,
            )
        if parallel is not None and self.record.get("parallel") != dict(parallel):
            raise self._refused(
                f"parallel settings {self.record.get('parallel')}; this run has {dict(parallel)}: "
                "nothing to resume; to train with these, train without --resume into a new output_dir"
            )

    def _refused(self, difference: str) -> TrainerError:
        """``<output_dir> holds a finished run (complete at ...), trained with <difference>``."""
        return TrainerError(f"{self.summary.parent} holds a finished run ({self.progress}), trained with {difference}")

    def message(self) -> str:
        """What ``--resume`` says of the run."""
        return (
            f"{self.summary.parent}: the run is {self.progress}; nothing to resume, its adapters and "
            f"{self.summary.name} are left as they are. To train again, train without --resume into a new output_dir"
        )


def finished_run(config: TrainerConfig, *, pipeline: bool = False) -> FinishedRun | None:
    """The run in ``config.output_dir`` if it finished after its newest checkpoint was written, else ``None``.

    ``None`` also for a summary of an earlier version (no ``run_id``) or of a pipeline run stopped
    early, and, with a warning, for one that cannot be read (or holds counters no run writes) or
    whose adapters are not where ``config`` puts them (gone, or a job's ``output_dir`` changed
    since) or have weights that are missing or cannot be read: the run then resumes from its newest
    checkpoint and writes them there. The adapters are looked for where ``config`` puts them, not
    where the summary recorded them, so a project moved elsewhere reports its own folders.

    Args:
        config: The run.
        pipeline: Read the pipeline runtime's ``pipeline_summary.json`` instead of ``summary.json``.

    Raises:
        TrainerError: The newest checkpoint's ``trainer_state.json`` cannot be read, or an adapter
            is missing or damaged and no checkpoint is left to write it again.
    """
    path = Path(config.output_dir) / (PIPELINE_SUMMARY if pipeline else SUMMARY)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        _log.warning("cannot read %s (%s): resuming from the newest checkpoint, which writes it again", path, exc)
        return None
    run_id = record.get("run_id") if isinstance(record, dict) else None
    if not isinstance(run_id, str):
        return None
    try:
        state = _final_state(record, pipeline=pipeline)
    except InvalidStateError as exc:
        _log.warning(
            "%s holds what no run writes (%s): resuming from the newest checkpoint, which writes it again", path, exc
        )
        return None
    if state is None:
        return None
    newest = latest_checkpoint(config.checkpoint_dir)
    if newest is not None and checkpoint_run_id(newest) != run_id:
        return None
    adapters = {job.name: config.job_output_dir(job) for job in config.jobs}
    problems = "; ".join(
        f"the adapter of job {name} {problem}"
        for name, folder in adapters.items()
        if (problem := _adapter_problem(folder)) is not None
    )
    if not problems:
        return FinishedRun(summary=path, record=record, state=state, adapters=adapters)
    if newest is None:
        raise TrainerError(
            f"{path} records a finished run, but {problems}, and no checkpoint is left to write it again (none "
            "was due: see save_steps, or they were deleted): restore the adapter, or train again with --overwrite "
            "(instead of --resume), which replaces the run's results"
        )
    _log.warning(
        "%s records a finished run, but %s: resuming from the newest checkpoint, which writes the adapters there",
        path,
        problems,
    )
    return None


def _adapter_problem(folder: Path) -> str | None:
    """What is wrong with the finished adapter in ``folder`` (``None``: nothing found).

    The weights' safetensors header is read, which also finds a file cut short (its header says how
    long it is); the tensors are not.
    """
    if not (folder / "adapter_config.json").is_file():
        return "is not in its folder (gone, or the job's output_dir changed)"
    from safetensors import SafetensorError, safe_open

    weights = folder / _WEIGHTS
    if not weights.is_file():
        return f"has no weights ({_WEIGHTS} is missing)"
    try:
        with safe_open(str(weights), framework="numpy"):  # no tensor is made, so no need to import torch
            pass
    except (OSError, SafetensorError) as exc:
        return f"has weights that cannot be read ({_WEIGHTS}: {exc})"
    return None


def _final_state(record: Mapping[str, Any], *, pipeline: bool) -> RunState | None:
    """The position and per-job counters the summary ends with; ``None`` for a pipeline run stopped early.

    ``summary.json`` is written only when the run ends, its counters at the top level, each job's
    beside its eval loss. ``pipeline_summary.json`` is written also when Ctrl-C stopped the run (it
    then names the checkpoint written); the counters are under ``run_state``.

    Raises:
        InvalidStateError: The counters are not what a run writes (the summary was edited by hand).
    """
    if pipeline:
        return (
            None
            if record.get("checkpoint") is not None
            else RunState.from_json(record.get("run_state"), where="run_state")
        )
    jobs = record.get("jobs")
    if isinstance(jobs, list):  # else from_json says what is wrong
        jobs = [
            {key: value for key, value in job.items() if key in _COUNTERS} if isinstance(job, dict) else job
            for job in jobs
        ]
    return RunState.from_json({**record, "jobs": jobs}, where="")
