"""Where evaluation results go besides TensorBoard: a history that survives a resume, the end-of-run table.

``<output_dir>/eval_history.json`` holds every evaluation of the run so far, by job, rewritten
atomically after each one::

    {"first": [{"step": 5, "loss": 2.31, "samples": 40, "targets": 812, "seconds": 0.4,
                "eval_set": "9f3c..."}, ...], ...}

A resumed run keeps each job's records up to the step its checkpoint holds and computes the later
ones again (a resumed run reaches the same weights, so they come out the same). Each record names
the hash of the eval set it measured (``eval_set``): a resume whose ``eval_dataset`` holds other
samples keeps the earlier records, says so, and the two sets' losses stay told apart. A job whose
``eval_dataset`` the resumed config removes keeps its records up to that step, and gets no more: its
evaluation stopped there (the log and the end-of-run table say so). ``val_size`` cannot be removed
on resume: it decides which samples are trained on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.evaluation import EvalLoss

__all__ = ["EvalHistory", "eval_table"]

_log = logging.getLogger(__name__)


class EvalHistory:
    """Every evaluation of the run, by job, kept in ``eval_history.json``.

    Args:
        path: The history file.
        adapters: The jobs that evaluate, in config order.
    """

    def __init__(self, path: Path, adapters: Sequence[str]) -> None:
        self.path = path
        self.evaluating = tuple(adapters)
        self.records: dict[str, list[EvalLoss]] = {name: [] for name in adapters}

    @classmethod
    def resumed(
        cls,
        path: Path,
        adapters: Sequence[str],
        steps_done: Mapping[str, int],
        *,
        written_by: Collection[str],
        eval_sets: Mapping[str, str] | None = None,
    ) -> EvalHistory:
        """The history of an interrupted run, up to each job's step in the checkpoint it resumes from.

        A missing, unreadable or damaged file starts an empty history: the earlier evaluations are
        then missing from the summary, the run itself is unaffected. That is warned about when the
        file should hold them: it is there but cannot be read, or damaged (then it is kept, renamed
        ``eval_history.json.damaged``, never deleted or overwritten), or missing although the
        interrupted run wrote it at its start, which ``written_by`` tells (a resume may add an
        ``eval_dataset``; a run that did not evaluate wrote no file, and then no warning is due).

        Args:
            path: The history file.
            adapters: The jobs that evaluate now, in config order.
            steps_done: Every job's optimizer steps in the checkpoint, in config order (a job that no
                longer evaluates keeps its records up to them).
            written_by: Jobs that certainly evaluated in the interrupted run too (``val_size``, which
                a resume cannot change), so that it wrote the file.
            eval_sets: Each evaluating job's eval-set hash now; a job whose records measured another
                set gets a warning (its history then holds the losses of two sets, each named).
                None checks nothing.
        """
        history = cls(path, adapters)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            if any(steps_done.get(name, 0) for name in written_by):
                _log.warning(
                    "%s is missing, though the interrupted run wrote it: evaluations before the resume are left "
                    "out of the summary",
                    path,
                )
            return history
        except OSError as exc:
            _log.warning("cannot read %s (%s): evaluations before the resume are left out of the summary", path, exc)
            return history
        try:
            history.records = _records_up_to(json.loads(text), steps_done, history.records)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            kept = path.with_name(path.name + ".damaged")
            path.replace(kept)  # never deleted or overwritten: the resumed run writes a new history beside it
            _log.warning(
                "%s is damaged (%s): kept as %s; evaluations before the resume are left out of the summary",
                path,
                exc,
                kept.name,
            )
        history._warn_of_other_eval_sets(eval_sets or {})
        return history

    def _warn_of_other_eval_sets(self, eval_sets: Mapping[str, str]) -> None:
        """Warn about each evaluating job whose kept records measured an eval set other than its current one."""
        for name, current in eval_sets.items():
            earlier = [r for r in self.records.get(name, []) if r.eval_set and r.eval_set != current]
            if earlier:
                _log.warning(
                    "%s's eval_dataset holds other samples than when it was evaluated up to step %d: its history "
                    "keeps those losses (eval_set %s) beside the new set's (eval_set %s), which are not comparable "
                    "with them",
                    name,
                    earlier[-1].step,
                    earlier[-1].eval_set,
                    current,
                )

    def stopped(self) -> list[str]:
        """The jobs with evaluations that no longer evaluate (their ``eval_dataset`` was removed at a resume)."""
        return [name for name in self.records if name not in self.evaluating]

    def add(self, result: EvalLoss) -> None:
        """Record ``result`` and rewrite the file."""
        self.records[result.adapter].append(result)
        self.save()

    def save(self) -> None:
        """Write the file (atomically)."""
        write_json_atomically(self.path, self.to_json())

    def latest(self, adapter: str) -> EvalLoss | None:
        """The newest evaluation of ``adapter``, if any."""
        records = self.records.get(adapter)
        return records[-1] if records else None

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        """``{job: [{step, loss, samples, targets, seconds, eval_set}, ...]}`` (``eval_set`` only where known)."""
        return {
            name: [
                {key: value for key, value in asdict(r).items() if key != "adapter" and (key != "eval_set" or value)}
                for r in records
            ]
            for name, records in self.records.items()
        }


def _records_up_to(
    saved: Any, steps_done: Mapping[str, int], evaluating: Mapping[str, list[EvalLoss]]
) -> dict[str, list[EvalLoss]]:
    """Each job's records in ``saved`` (the file's content) up to its step in ``steps_done``.

    A job that no longer evaluates keeps its earlier records; one that evaluates gets a list even
    when it has none yet.

    Raises:
        TypeError, KeyError, AttributeError: ``saved`` is not a history (a damaged file).
    """
    records = {}
    for name, steps in steps_done.items():
        kept = [EvalLoss(adapter=name, **record) for record in saved.get(name, []) if record["step"] <= steps]
        if kept or name in evaluating:
            records[name] = kept
    return records


def eval_table(history: EvalHistory) -> Table:
    """The end-of-run table: per job, its last evaluation (step, loss, samples, trained tokens)."""
    table = Table(title="Evaluation (mean loss per trained token of each job's eval set)")
    for header in ("job", "step", "eval loss", "samples", "trained tokens"):
        table.add_column(header, justify="left" if header == "job" else "right")
    for name in history.records:
        latest = history.latest(name)
        if latest is None:
            table.add_row(name, "-", "-", "-", "-")
        else:
            table.add_row(name, str(latest.step), f"{latest.loss:.4f}", f"{latest.samples:,}", f"{latest.targets:,}")
    if history.stopped():
        table.caption = f"no longer evaluated since a resume removed its eval_dataset: {', '.join(history.stopped())}"
    return table
