"""The pipeline benchmark's results: per-run records merged from files and summarised per cell (torch-free).

A *run* is one launch of ``lorafusion-megatron train`` for one *cell*, a number of adapters and a
schedule. :func:`summarise_cells` takes the medians over a cell's repeats; :func:`merge_results`
joins the runs of several result files (e.g. two device calls with the same settings) so their
repeats count together.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SCHEDULES", "merge_results", "summarise_cells"]

SCHEDULES = ("lorafusion", "megatron-1f1b", "mlora")
"""The pipeline runtime's schedules, in the order tables and plots show them."""


def _median_per_stage(per_run: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.median(values) for values in zip(*per_run, strict=True)]


def expected_rate(rates: Sequence[tuple[str, float]], schedule: str) -> float | None:
    """Tokens/s to expect of ``schedule`` from ``(schedule, tokens/s)`` of timed runs; ``None`` before any.

    The median of ``schedule``'s own runs, or, for a schedule not run yet, half the slowest rate seen.
    """
    if not rates:
        return None
    own = [rate for name, rate in rates if name == schedule]
    return statistics.median(own) if own else 0.5 * min(rate for _, rate in rates)


def _median_or_none(values: Iterable[float | None]) -> float | None:
    """The median of the values given (``None`` for runs of a one-launch call, which has no per-cell launch)."""
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def summarise_cells(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per ``(adapters, schedule)`` over its successful, timed (not warm-up) runs.

    Each summary holds the median, min and max tokens/s over the repeats, the median bubble ratio
    (mean over stages) and the median per stage, the median launch overhead, and ``speedup``: the
    median tokens/s of ``lorafusion`` with as many adapters over this cell's (``None`` where
    ``lorafusion`` has no run at that count).

    Args:
        runs: Run records as :mod:`bench_pipeline` writes them.

    Returns:
        Summaries sorted by adapters, then schedule in :data:`SCHEDULES` order.
    """
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        if run["status"] == "ok" and not run["warmup"]:
            groups.setdefault((run["adapters"], run["schedule"]), []).append(run)
    cells = []
    for (adapters, schedule), group in groups.items():
        rates = [run["tokens_per_second"] for run in group]
        cells.append(
            {
                "adapters": adapters,
                "schedule": schedule,
                "fused_kernels": group[0]["fused_kernels"],
                "repeats": len(group),
                "tokens": group[0]["tokens"],
                "tokens_per_second": statistics.median(rates),
                "tokens_per_second_min": min(rates),
                "tokens_per_second_max": max(rates),
                "bubble_ratio": statistics.median(run["bubble_ratio"] for run in group),
                "bubble_ratio_per_stage": _median_per_stage([run["bubble_ratio_per_stage"] for run in group]),
                "launch_overhead_seconds": _median_or_none(run["launch_overhead_seconds"] for run in group),
            }
        )
    fused_rate = {cell["adapters"]: cell["tokens_per_second"] for cell in cells if cell["schedule"] == "lorafusion"}
    for cell in cells:
        reference = fused_rate.get(cell["adapters"])
        cell["speedup"] = None if reference is None else reference / cell["tokens_per_second"]
    return sorted(cells, key=lambda cell: (cell["adapters"], SCHEDULES.index(cell["schedule"])))


def merge_results(paths: Sequence[Path]) -> dict[str, Any]:
    """One document from result files measured with the same settings: their runs and provenance joined.

    Raises:
        SystemExit: No file given, or two files differ in a setting (the message names it).
    """
    if not paths:
        raise SystemExit("give at least one results file of bench_pipeline.py")
    documents = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    settings = documents[0]["settings"]
    for path, document in zip(paths[1:], documents[1:], strict=True):
        differing = sorted(
            key
            for key in settings.keys() | document["settings"].keys()
            if settings.get(key) != document["settings"].get(key)
        )
        if differing:
            raise SystemExit(
                f"{path.name} was measured with other settings than {paths[0].name} ({', '.join(differing)}): "
                "report them separately"
            )
    runs = [run for document in documents for run in document["runs"]]
    return {
        "settings": settings,
        "provenance": [document["provenance"] for document in documents],
        "simulated": documents[0].get("simulated", {}),
        "runs": runs,
        "cells": summarise_cells(runs),
    }
