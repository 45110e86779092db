"""How far two tuning runs agree: the same winners, and the same times, shape by shape.

``lorafusion-tune --compare A.json B.json`` prints one line per kernel tuned in both files. Two
runs on one GPU with the same search space should pick the same config wherever one config is
clearly faster; where they pick different configs, or time the same one differently, their
measurements cannot rank configs that close. Needs no GPU.
"""

from __future__ import annotations

import dataclasses
import statistics

from lorafusion_kernels.tuning.config import ConfigFile

__all__ = ["KernelAgreement", "agreement", "format_agreement"]


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


def format_agreement(rows: list[KernelAgreement]) -> str:
    """A plain-text table of :func:`agreement`'s rows."""
    header = f"{'kernel':14s} {'shapes':>6s} {'same winner':>11s} {'same-winner time moved':>22s} {'max':>6s}"
    lines = [
        f"{row.kernel:14s} {row.shapes:6d} {row.same_config:11d} "
        f"{row.same_config_time_spread:22.1%} {row.max_time_spread:6.1%}"
        for row in rows
    ]
    return "\n".join([header, *lines])
