"""The trainer's plans: made for the run's settings, and refused when made for others."""

from __future__ import annotations

import json

import pytest

import lorafusion_sched
from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.planning import check_plan, make_plan
from lorafusion_megatron.testing import write_profile
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
    first = dict(list(data.items())[:1])
    with pytest.raises(TrainerError, match=r"\[jobs\] the plan is for adapters \['first', 'second'\], the runtime's"):
        check_plan(plan, first, config, pipeline_stages=2, data_parallel=2)


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


def _lopsided(config_dict) -> TrainerConfig:
    """'long' has four times the samples of 'short': its last global batches run alone."""
    jobs = [
        {"name": name, "dataset": {"synthetic": "xsum", "num_samples": n, "length_scale": 0.05}, "global_batch_size": 4}
        for name, n in (("short", 8), ("long", 32))
    ]
    return parse_config(config_dict(jobs=jobs))


@pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")  # the lone tail, on purpose
def test_a_profile_of_the_pipeline_lets_the_planner_split_lone_global_batches(config_dict) -> None:
    from lorafusion_megatron.profiler.run import profiled_cost_model

    config = _lopsided(config_dict)
    data = prepare_data(config).jobs
    assert profiled_cost_model(config, 2) is None
    assert make_plan(config, data, pipeline_stages=2).stats.split_batches == 0, "no profile: no cost model"

    write_profile(config.output_dir, stages=2, fixed_s=1e-4)
    cost = profiled_cost_model(config, 2)
    assert cost is not None
    assert cost.forward_points is not None
    assert [n for n, _ in cost.forward_points] == [64, 128, 256, 512]
    assert [s for _, s in cost.forward_points] == pytest.approx([1e-4 + 1e-5 * n for n in (64, 128, 256, 512)])
    assert cost.forward_fixed_s == pytest.approx(1e-4), "the line through the measurements, not the report's"
    split = make_plan(config, data, pipeline_stages=2)
    assert split.stats.split_batches > 0
    check_plan(split, data, config, pipeline_stages=2)
    assert profiled_cost_model(config, 4) is None, "measured on 2 stages: another partition of the layers"
    assert make_plan(config, data, pipeline_stages=4).stats.split_batches == 0


@pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")  # the lone tail, on purpose
def test_a_profile_whose_small_microbatches_cost_as_much_splits_nothing(config_dict) -> None:
    """Host-bound small microbatches (a large fixed cost): smaller microbatches would only add it."""
    config = _lopsided(config_dict)
    write_profile(config.output_dir, stages=2, fixed_s=1.0)
    assert make_plan(config, prepare_data(config).jobs, pipeline_stages=2).stats.split_batches == 0


@pytest.mark.parametrize(
    "measurements",
    [
        [],
        [{"stage": 0, "tokens": 64}],
        [
            {"stage": 0, "tokens": 64, "forward_s": 0.1, "backward_s": 0.2, "peak_bytes": None},
            {"stage": 1, "tokens": 128, "forward_s": 0.1, "backward_s": 0.2, "peak_bytes": None},
        ],
    ],
    ids=["none", "fields missing", "no count on both stages"],
)
def test_a_profile_without_usable_measurements_says_what_to_do(config_dict, measurements) -> None:
    from pathlib import Path

    from lorafusion_megatron.profiler.run import profiled_cost_model

    config = _lopsided(config_dict)
    write_profile(config.output_dir, stages=2, fixed_s=1e-4)
    path = Path(config.output_dir) / "profile.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"measurements": measurements}))
    message = r"profile\.json holds no usable measurements .*: run `lorafusion-megatron profile` again, or remove"
    with pytest.raises(TrainerError, match=message):
        profiled_cost_model(config, 2)


@pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")  # the lone tail, on purpose
def test_a_profile_missing_a_stage_gives_a_model_without_stage_factors(config_dict) -> None:
    """Stage 2 of 3 ran out of memory at every count it tried: 2 stage factors for 3 stages are dropped."""
    from pathlib import Path

    from lorafusion_megatron.profiler.run import profiled_cost_model

    config = _lopsided(config_dict)
    write_profile(config.output_dir, stages=3, fixed_s=1e-4)
    path = Path(config.output_dir) / "profile.json"
    report = json.loads(path.read_text())
    report["measurements"] = [m for m in report["measurements"] if m["stage"] < 2]
    path.write_text(json.dumps(report))
    cost = profiled_cost_model(config, 3)
    assert cost is not None
    assert cost.stage_factors is None
    make_plan(config, prepare_data(config).jobs, pipeline_stages=3)  # PlanOptions accepts it
