"""How far two tuning runs agree: the same winners, and the same times, shape by shape.

``lorafusion-tune --compare A.json B.json`` prints one line per kernel tuned in both files. Two
runs on one GPU with the same search space should pick the same config wherever one config is
clearly faster; where they pick different configs, or time the same one differently, their
measurements cannot rank configs that close. Needs no GPU.

Given two timings files (``lorafusion-tune --timings``: every candidate's time, not only the
winner's) it prints the *regret* instead: how much slower each run measured the other run's winner
than its own. A different winner with a regret of 1% is a tie; one of 10% means a run's ranking
is noise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning.config import ConfigFile, KernelConfig, ShapeKey

__all__ = [
    "KernelAgreement",
    "KernelRegret",
    "ShapeTimings",
    "agreement",
    "format_agreement",
    "format_regret",
    "regret",
    "timings_from_json",
    "timings_to_json",
]


@dataclasses.dataclass(frozen=True)
class KernelAgreement:
    """Two runs' tables of one kernel, over the shapes both tuned.

    Attributes:
        kernel: The kernel's config name.
        shapes: Shapes tuned in both runs.
        same_config: How many of them got the same winner.
        same_config_time_spread: Median of ``|ms_b / ms_a - 1|`` where the winner is the same: how far
            one config's time moved between the runs (nan if no shape had the same winner).
        max_time_spread: The largest ``|ms_b / ms_a - 1|`` over all shared shapes (winners' times).
    """

    kernel: str
    shapes: int
    same_config: int
    same_config_time_spread: float
    max_time_spread: float


def agreement(a: ConfigFile, b: ConfigFile) -> list[KernelAgreement]:
    """Per kernel with entries in both files (sorted by name), how their shared shapes compare."""
    out = []
    for kernel in sorted(set(a.kernels) & set(b.kernels)):
        first = {e.key: e for e in a.kernels[kernel].entries}
        second = {e.key: e for e in b.kernels[kernel].entries}
        shared = sorted(set(first) & set(second), key=lambda k: (k.n, k.k, k.r, k.dtype, k.m))
        if not shared:
            continue
        spreads = [abs(second[k].ms / first[k].ms - 1.0) for k in shared]
        same = [s for k, s in zip(shared, spreads, strict=True) if first[k].config == second[k].config]
        out.append(
            KernelAgreement(
                kernel=kernel,
                shapes=len(shared),
                same_config=len(same),
                same_config_time_spread=statistics.median(same) if same else float("nan"),
                max_time_spread=max(spreads),
            )
        )
    return out


def _table(measure: str, rows: Iterable[tuple[str, int, int, float, float]]) -> str:
    """Per kernel: shapes, same winners, then ``measure`` and the largest value, as percentages."""
    width = len(measure)
    header = f"{'kernel':14s} {'shapes':>6s} {'same winner':>11s} {measure:>{width}s} {'max':>6s}"
    lines = [f"{k:14s} {n:6d} {same:11d} {mid:{width}.1%} {top:6.1%}" for k, n, same, mid, top in rows]
    return "\n".join([header, *lines])


def format_agreement(rows: list[KernelAgreement]) -> str:
    """A plain-text table of :func:`agreement`'s rows."""
    return _table(
        "same-winner time moved",
        ((r.kernel, r.shapes, r.same_config, r.same_config_time_spread, r.max_time_spread) for r in rows),
    )


@dataclasses.dataclass(frozen=True)
class ShapeTimings:
    """What one sweep measured for one kernel at one shape.

    Attributes:
        kernel: The kernel's config name.
        key: The shape.
        times: Every candidate's mean time over the rounds, in ms (``inf``: failed to compile or launch).
        current_ms: The time of the config the kernel launched with before the sweep.
    """

    kernel: str
    key: ShapeKey
    times: Mapping[KernelConfig, float]
    current_ms: float

    @property
    def winner(self) -> KernelConfig:
        """The fastest candidate (ties: the first timed)."""
        return min(self.times, key=self.times.__getitem__)


def timings_to_json(timings: Sequence[ShapeTimings], provenance: Mapping[str, str]) -> dict[str, Any]:
    """A JSON-ready document of a sweep's timings (``null`` for a failed candidate)."""

    def ms(value: float) -> float | None:
        return None if math.isinf(value) else value

    return {
        "provenance": dict(provenance),
        "timings": [
            {
                "kernel": t.kernel,
                "shape": dataclasses.asdict(t.key),
                "current_ms": ms(t.current_ms),
                "candidates": [{"config": c.to_dict(), "ms": ms(v)} for c, v in t.times.items()],
            }
            for t in timings
        ],
    }


def timings_from_json(data: Mapping[str, Any], where: str = "<timings>") -> list[ShapeTimings]:
    """Parse :func:`timings_to_json`'s document.

    Raises:
        LoRAFusionKernelsError: if ``data`` is not such a document.
    """
    try:
        return [
            ShapeTimings(
                kernel=row["kernel"],
                key=ShapeKey(**row["shape"]),
                times={
                    KernelConfig.from_dict(c["config"], where=where): math.inf if c["ms"] is None else float(c["ms"])
                    for c in row["candidates"]
                },
                current_ms=math.inf if row["current_ms"] is None else float(row["current_ms"]),
            )
            for row in data["timings"]
        ]
    except (KeyError, TypeError) as exc:
        raise LoRAFusionKernelsError(f"{where}: not a lorafusion-tune --timings file ({exc!r})") from exc


@dataclasses.dataclass(frozen=True)
class KernelRegret:
    """Two runs' timings of one kernel, over the shapes both timed.

    Attributes:
        kernel: The kernel's config name.
        shapes: Shapes timed in both runs.
        same_winner: How many of them got the same winner.
        median_regret: Median over the shapes of the regret (0 where the winners agree).
        max_regret: The largest regret.
    """

    kernel: str
    shapes: int
    same_winner: int
    median_regret: float
    max_regret: float


def shape_regret(a: ShapeTimings, b: ShapeTimings) -> float:
    """How much slower one run timed the other run's winner than its own.

    ``max(a[w_b] / a[w_a], b[w_a] / b[w_b]) - 1`` for the winners ``w_a`` and ``w_b``: 0 where they agree,
    ``inf`` if a winner failed in the other run or was not timed there.
    """
    w_a, w_b = a.winner, b.winner
    if w_a == w_b:
        return 0.0
    if w_b not in a.times or w_a not in b.times:
        return math.inf
    return max(a.times[w_b] / a.times[w_a], b.times[w_a] / b.times[w_b]) - 1.0


def regret(a: Sequence[ShapeTimings], b: Sequence[ShapeTimings]) -> list[KernelRegret]:
    """Per kernel timed in both runs (sorted by name), the regret over their shared shapes."""
    first = {(t.kernel, t.key): t for t in a}
    second = {(t.kernel, t.key): t for t in b}
    shared = sorted(set(first) & set(second), key=lambda pair: (pair[0], pair[1].n, pair[1].k, pair[1].r, pair[1].m))
    out = []
    for kernel in sorted({name for name, _ in shared}):
        pairs = [(first[pair], second[pair]) for pair in shared if pair[0] == kernel]
        regrets = [shape_regret(x, y) for x, y in pairs]
        out.append(
            KernelRegret(
                kernel=kernel,
                shapes=len(pairs),
                same_winner=sum(x.winner == y.winner for x, y in pairs),
                median_regret=statistics.median(regrets),
                max_regret=max(regrets),
            )
        )
    return out


def format_regret(rows: list[KernelRegret]) -> str:
    """A plain-text table of :func:`regret`'s rows."""
    return _table("median regret", ((r.kernel, r.shapes, r.same_winner, r.median_regret, r.max_regret) for r in rows))
