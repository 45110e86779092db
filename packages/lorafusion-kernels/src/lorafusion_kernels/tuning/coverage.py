"""Which tuned configs a config file gives the models' layers: an entry of the shape, or a fallback.

``lorafusion-tune --coverage GPU`` (no GPU needed) looks up every kernel on every layer shape of
``--models`` at each ``--m`` and ``--r``, as the op would, and counts where each config comes from
(:meth:`~lorafusion_kernels.tuning.config.ConfigFile.resolve`): an entry of the kernel at this
token count, an entry at another token count, the fallback kernel's entry (FusedLoRA's for a
``multi_*`` kernel), a rank default, the file's default, or the built-in heuristic (no table for the
kernel). Anything after the first two is an untuned shape: ``lorafusion-tune`` with the same
``--models``, ``--m`` and ``--r`` tunes it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from lorafusion_kernels.tuning.config import ConfigFile, Resolution, ShapeKey, fallback_kernel
from lorafusion_kernels.tuning.launches import shape_key

__all__ = ["SOURCES", "CoverageRow", "coverage", "format_coverage"]

SOURCES = ("entry", "entry at another m", "fallback's entry", "rank default", "default", "heuristic")
"""Where a lookup's config comes from, best first: the columns of :func:`format_coverage`."""


@dataclasses.dataclass(frozen=True)
class CoverageRow:
    """One kernel on one layer shape at one token count and rank: where its config comes from."""

    kernel: str
    key: ShapeKey
    layers: tuple[str, ...]
    """``model.layer`` names whose shape this is."""
    source: str
    """One of :data:`SOURCES`."""


def _source(kernel: str, key: ShapeKey, found: Resolution | None) -> str:
    if found is None:
        return "heuristic"
    if found.source == "entry":
        if found.kernel != kernel:
            return "fallback's entry"
        return "entry" if found.entry_m == key.m else "entry at another m"
    return found.source


def coverage(
    config_file: ConfigFile | None,
    *,
    layers: Sequence[tuple[str, int, int]],
    ms: Sequence[int],
    ranks: Sequence[int],
    kernels: Sequence[str],
    dtype: str = "bfloat16",
) -> list[CoverageRow]:
    """Every kernel's lookup on every ``(name, n, k)`` layer at each ``m`` and ``r``, keyed as the op keys it.

    Layers whose keys coincide for a kernel (the shrink of every layer with the same ``k``, say)
    make one row. ``multi_dsx_dx`` counts only on layers with ``k <= n``, the ones the op runs it on.
    ``config_file`` None (no file for the GPU): every row is the heuristic.
    """
    from lorafusion_kernels.multi_lora_core import dx_from_da_pass

    names: dict[tuple[str, ShapeKey], list[str]] = collections.defaultdict(list)
    for m in ms:
        for r in ranks:
            for name, n, k in layers:
                for kernel in kernels:
                    if kernel == "multi_dsx_dx" and not dx_from_da_pass(n, k):
                        continue
                    names[(kernel, shape_key(kernel, m=m, n=n, k=k, r=r, dtype=dtype))].append(name)
    rows = []
    for (kernel, key), layer_names in names.items():
        found = config_file.resolve(kernel, key, fallback_kernel(kernel)) if config_file is not None else None
        rows.append(CoverageRow(kernel, key, tuple(layer_names), _source(kernel, key, found)))
    return rows


def format_coverage(rows: Sequence[CoverageRow]) -> str:
    """A Markdown table: per kernel, rank and token count, how many keys take their config from each source."""
    counts: dict[tuple[str, int, int], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for row in rows:
        counts[(row.kernel, row.key.r, row.key.m)][row.source] += 1
    lines = [
        "| kernel | r | m | " + " | ".join(SOURCES) + " |",
        "|---|---:|---:|" + "---:|" * len(SOURCES),
    ]
    order = {kernel: i for i, kernel in enumerate(dict.fromkeys(row.kernel for row in rows))}
    for (kernel, r, m), counter in sorted(counts.items(), key=lambda item: (order[item[0][0]], *item[0][1:])):
        cells = " | ".join(str(counter[source]) if counter[source] else "" for source in SOURCES)
        lines.append(f"| {kernel} | {r} | {m} | {cells} |")
    return "\n".join(lines)
