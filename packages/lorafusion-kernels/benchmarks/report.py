"""Render ``bench_lora.py`` result files as the Markdown tables of ``docs/kernels/benchmarks.md``.

Usage: ``python packages/lorafusion-kernels/benchmarks/report.py packages/lorafusion-kernels/benchmarks/results/*.json``
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def render(path: Path) -> str:
    """One section: device, versions, summary, then one row per (layer, m) with the providers' fwd+bwd times."""
    data = json.loads(path.read_text())
    v = data["versions"]
    lines = [
        f"### {data['device']} ({data['date']})",
        "",
        f"torch {v['torch']}, Triton {v['triton']}, CUDA {v['cuda']}, lorafusion-kernels {v['lorafusion_kernels']}; "
        f"bf16, r = 16, p = 0.1; `{data['command']}`.",
        "",
        "| geometric mean over the grid | fused / frozen | eager / fused | eager / frozen | compile / fused |",
        "|---|---|---|---|---|",
    ]
    for label, key in (("fwd+bwd, eager launches", "fwd_bwd"), ("fwd+bwd, CUDA graph", "fwd_bwd_graph"),
                       ("fwd, eager launches", "fwd")):  # fmt: skip
        s = data["summary"][key]
        lines.append(
            f"| {label} | {s['fused_over_frozen']:.3f} | {s['eager_over_fused']:.3f} | "
            f"{s['eager_over_frozen']:.3f} | {s['compile_over_fused']:.3f} |"
        )
    lines += [
        "",
        "| layer | M | N | K | frozen | eager | compile | fused | fused / frozen | eager / fused "
        "| saved MiB eager / fused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    table: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for row in data["rows"]:
        table.setdefault((row["layer"], row["m"]), {})[row["provider"]] = row
    for (layer, m), rows in table.items():

        def t(p: str, rows: dict[str, dict[str, float]] = rows) -> float:
            graph = rows[p]["fwd_bwd_graph_ms"]
            return graph if math.isfinite(graph) else rows[p]["fwd_bwd_ms"]

        any_row = next(iter(rows.values()))
        lines.append(
            f"| {layer} | {m} | {any_row['n']} | {any_row['k']} | {t('frozen'):.3f} | {t('eager'):.3f} | "
            f"{t('compile'):.3f} | {t('fused'):.3f} | {t('fused') / t('frozen'):.2f} | {t('eager') / t('fused'):.2f} | "
            f"{rows['eager']['saved_bytes'] / 2**20:.0f} / {rows['fused']['saved_bytes'] / 2**20:.0f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    """Print the sections of every file given."""
    print("\n".join(render(Path(p)) for p in sys.argv[1:]))


if __name__ == "__main__":
    main()
