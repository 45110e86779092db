"""The GPU-time analysis bins idle time by length and by the kernel that ended it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
gpu_time = pytest.importorskip("gpu_time")


def _kernel(start: float, end: float, name: str) -> SimpleNamespace:
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), name=name)


def test_idle_gaps_bins_and_attributes_each_gap() -> None:
    # Out of order on purpose; "b" overlaps "a" and the second "e" starts as the first ends (no
    # gaps), then gaps of 6, 60, 600 and 2,000 microseconds.
    events = [
        _kernel(1100, 1200, "e"),
        _kernel(0, 100, "a"),
        _kernel(50, 150, "b"),
        _kernel(156, 200, "c"),
        _kernel(260, 300, "d"),
        _kernel(900, 1100, "e"),
        _kernel(3200, 3300, "c"),
    ]
    gaps = gpu_time.idle_gaps(events, microbatches=1, top=10)
    assert gaps["by_length_ms"] == {"<10 us": 0.01, "<100 us": 0.06, "<1000 us": 0.6, ">=1000 us": 2.0}
    assert gaps["by_next_kernel_ms"] == {"c": 2.01, "e": 0.6, "d": 0.06}
    assert gpu_time.idle_gaps(events, microbatches=2, top=1)["by_next_kernel_ms"] == {"c": 1.0}
