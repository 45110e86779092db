"""Would the rank default have served a layer width the tuner never saw? Held-out widths of one sweep.

``lorafusion-tune --check-rank-defaults TIMINGS.json CONFIG.json`` takes a sweep's timings
(``--timings``: every candidate's time at every shape) and a config file (for each kernel's
``default``). For each shape it hides every shape of the same width ``(n, k)``, takes the rank default
the remaining winners give (:meth:`~lorafusion_kernels.tuning.config.KernelTable.rank_default`, the
lookup's own rule) and reads that config's time at the hidden shape. Per kernel and rank tile it
prints how much slower than the shape's winner that config is, next to the file's ``default``: the
config an untuned width got before rank defaults existed. Needs no GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Sequence

from lorafusion_kernels.tuning.agreement import ShapeTimings
from lorafusion_kernels.tuning.config import ConfigFile, KernelTable, TunedEntry, rank_tile

__all__ = ["RankDefaultCheck", "format_rank_default_check", "rank_default_check"]


@dataclasses.dataclass(frozen=True)
class RankDefaultCheck:
    """One kernel at one rank tile: the shapes timed, and two configs' times over the winner's.

    Attributes:
        kernel: The kernel's config name.
        rank_tile: The rank tile (16, 32, 64, 128) of the shapes.
        shapes: Shapes where both configs were timed.
        default_slowdown: Geometric mean over the shapes of ``t(file default) / t(winner)``.
        default_worst: The largest such ratio.
        held_out_slowdown: Geometric mean of ``t(rank default of the other widths) / t(winner)``.
        held_out_worst: The largest such ratio.
    """

    kernel: str
    rank_tile: int
    shapes: int
    default_slowdown: float
    default_worst: float
    held_out_slowdown: float
    held_out_worst: float


def rank_default_check(timings: Sequence[ShapeTimings], config_file: ConfigFile) -> list[RankDefaultCheck]:
    """Per kernel of ``config_file`` and rank tile (sorted), the held-out rank default against the default.

    A shape counts where its winner, its held-out rank default and the file's default were all timed
    (finite times); a group whose shapes share one width has nothing to hold out and is left out.
    """
    groups: dict[tuple[str, int, str], list[ShapeTimings]] = collections.defaultdict(list)
    for row in timings:
        groups[(row.kernel, rank_tile(row.key.r), row.key.dtype)].append(row)
    out = []
    for (kernel, tile, _), rows in sorted(groups.items()):
        table = config_file.kernels.get(kernel)
        if table is None:
            continue
        by_default, held_out = [], []
        for row in rows:
            width = (row.key.n, row.key.k)
            others = tuple(
                TunedEntry(key=o.key, config=o.winner, ms=o.times[o.winner])
                for o in rows
                if (o.key.n, o.key.k) != width
            )
            if not others:
                continue
            guess = KernelTable(default=table.default, entries=others).rank_default(row.key)
            best = row.times[row.winner]
            times = (row.times.get(table.default, math.inf), row.times.get(guess, math.inf) if guess else math.inf)
            if all(math.isfinite(t) for t in (best, *times)):
                by_default.append(times[0] / best)
                held_out.append(times[1] / best)
        if by_default:
            out.append(
                RankDefaultCheck(
                    kernel=kernel,
                    rank_tile=tile,
                    shapes=len(by_default),
                    default_slowdown=statistics.geometric_mean(by_default),
                    default_worst=max(by_default),
                    held_out_slowdown=statistics.geometric_mean(held_out),
                    held_out_worst=max(held_out),
                )
            )
    return out


def format_rank_default_check(rows: list[RankDefaultCheck]) -> str:
    """A plain-text table of :func:`rank_default_check`'s rows (times over the winner's, as ratios)."""
    header = (
        f"{'kernel':14s} {'rank tile':>9s} {'shapes':>6s} {'default':>8s} {'worst':>6s} {'held-out':>8s} {'worst':>6s}"
    )
    lines = [
        f"{r.kernel:14s} {r.rank_tile:9d} {r.shapes:6d} {r.default_slowdown:8.3f} {r.default_worst:6.3f} "
        f"{r.held_out_slowdown:8.3f} {r.held_out_worst:6.3f}"
        for r in rows
    ]
    return "\n".join([header, *lines])
