"""The trainer's plans: made for the run's settings, and refused when made for others."""

from __future__ import annotations

import pytest

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
