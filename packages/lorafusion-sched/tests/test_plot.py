from __future__ import annotations

from pathlib import Path

import pytest

from lorafusion_sched import PlanOptions, plan
from lorafusion_sched.workloads import synthetic_jobs


@pytest.mark.together
def test_timeline_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lorafusion_sched.plot import plot_timeline

    jobs = synthetic_jobs("het", 128, num_adapters=4, global_batch_size=8)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=4, padding_multiple=64, use_milp=False))
    out = plot_timeline(p, tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
