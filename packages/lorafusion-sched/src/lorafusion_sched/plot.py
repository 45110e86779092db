"""PNG timelines of the simulated pipelines (needs the optional ``plot`` extra: matplotlib)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from lorafusion_sched.errors import SchedError
from lorafusion_sched.io import write_atomically
from lorafusion_sched.models import CostModel, Plan
from lorafusion_sched.simulate import timeline

__all__ = ["check_png_path", "plot_timeline"]

_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def plot_timeline(
    plan: Plan,
    path: str | Path,
    *,
    cost_model: CostModel | None = None,
    runs: Sequence[str] = ("lorafusion", "megatron", "mlora"),
    window_microbatches: int = 48,
) -> Path:
    """Draw each run's pipeline (stages as rows, forward light, backward dark) over one time window.

    Args:
        plan: The plan to simulate.
        path: Where to write the PNG (a ``.png`` name in an existing folder; written atomically).
        cost_model: Seconds per microbatch; default :class:`CostModel`.
        runs: Which runs to draw, one panel each.
        window_microbatches: The window lasts as long as the plan's first this-many microbatches
            (scaled from its makespan); every panel uses the same window.

    Returns:
        The path written.

    Raises:
        SchedError: If matplotlib is missing (install the package with its ``plot`` extra), or
            ``path`` does not end in ``.png``.
    """
    check_png_path(path)
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = {run: timeline(plan, run, cost_model) for run in runs}
    plan_end = max((e.end for e in events.get("lorafusion", [])), default=0.0) or max(
        e.end for evs in events.values() for e in evs
    )
    window = plan_end * min(1.0, window_microbatches / max(1, len(plan.microbatches)))
    names = [a.name for a in plan.adapters]
    colour = {name: _COLOURS[i % len(_COLOURS)] for i, name in enumerate(names)}
    stages = plan.pipeline_stages
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.2 + 0.45 * stages * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        for e in events[run]:
            if e.start >= window:
                continue
            first = e.label.split("+")[0]
            ax.barh(
                stages - 1 - e.stage,
                min(e.end, window) - e.start,
                left=e.start,
                height=0.8,
                color=colour.get(first, "#BBBBBB"),
                alpha=0.55 if e.kind == "F" else 1.0,
                edgecolor="white",
                linewidth=0.3,
                hatch="//" if "+" in e.label else None,
            )
        ax.set_yticks(range(stages), [f"stage {stages - 1 - s}" for s in range(stages)])
        ax.set_title(run, loc="left", fontsize=10)
        ax.set_xlim(0, window)
    axes[-1, 0].set_xlabel("simulated seconds (forward light, backward dark, hatched: several adapters)")
    fig.legend(
        handles=[Patch(color=colour[n], label=n) for n in names], loc="upper right", ncol=min(4, len(names)), fontsize=8
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    try:
        return write_atomically(path, lambda temporary: fig.savefig(temporary, dpi=120))
    finally:
        plt.close(fig)


def check_png_path(path: str | Path) -> None:
    """Refuse a PNG path that does not end in ``.png`` (matplotlib picks the format from it).

    Raises:
        SchedError: Naming the path.
    """
    if Path(path).suffix.lower() != ".png":
        raise SchedError(f"{str(path)!r}: the timeline is a PNG; name the file *.png")


def require_matplotlib() -> None:
    """Refuse to draw without matplotlib (callers check before their work, not after it).

    Raises:
        SchedError: Saying how to install it.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise SchedError(
            "drawing a PNG needs matplotlib: pip install matplotlib, or install this package with its "
            "plot extra (pip install './packages/lorafusion-sched[plot]' from the repository)"
        )
