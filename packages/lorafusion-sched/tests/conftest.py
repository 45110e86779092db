from __future__ import annotations

import pytest

from lorafusion_sched import PlanOptions


@pytest.fixture
def fast_options() -> PlanOptions:
    """Small MILP limits: tests assert validity, never optimality."""
    return PlanOptions(capacity=1024, pipeline_stages=4, padding_multiple=64, time_limit=0.02, workers=1)
