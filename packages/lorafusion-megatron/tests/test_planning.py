"""The trainer's plans: made for the run's settings, and refused when made for others."""

from __future__ import annotations

import pytest

import lorafusion_sched
from lorafusion_megatron.config import parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.planning import check_plan, make_plan
from lorafusion_megatron.trainer import prepare_data


def test_a_plan_made_for_other_settings_is_refused(config_dict) -> None:
    """A plan's header must fit the runtime: capacity, stages, replicas and padding (lorafusion_sched.verify)."""
    config = parse_config(config_dict())
    data = prepare_data(config).jobs
    plan = make_plan(config, data, pipeline_stages=2, data_parallel=2)
    check_plan(plan, data, config, pipeline_stages=2, data_parallel=2)
    check_plan(plan, data, config, pipeline_stages=1, data_parallel=2)  # more stages apart than needed: fine
    with pytest.raises(TrainerError, match=r"\[settings\].*pipeline_stages = 2.*4 pipeline stages"):
        check_plan(plan, data, config, pipeline_stages=4, data_parallel=2)
    with pytest.raises(TrainerError, match=r"\[settings\].*data_parallel = 2.*the runtime has 1"):
        check_plan(plan, data, config, pipeline_stages=2)
    smaller = parse_config(config_dict(scheduler={"capacity": 128, "padding_multiple": 32}))
    with pytest.raises(TrainerError, match=r"capacity = 256.*capacity 128[\s\S]*padding_multiple = 16"):
        check_plan(plan, data, smaller, pipeline_stages=2, data_parallel=2)


def test_no_milp_time_limit_plans_alike_on_every_run(config_dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """``milp_time_limit: null``: the solves stop at the node limit alone, so load cannot change the plan."""
    seen = []
    real = lorafusion_sched.plan
    monkeypatch.setattr(lorafusion_sched, "plan", lambda jobs, options: seen.append(options) or real(jobs, options))
    config = parse_config(config_dict(scheduler={"capacity": 256, "padding_multiple": 16, "milp_time_limit": None}))
    data = prepare_data(config).jobs
    first, second = make_plan(config, data), make_plan(config, data)
    assert [o.time_limit for o in seen] == [None, None]
    assert first.microbatches == second.microbatches
