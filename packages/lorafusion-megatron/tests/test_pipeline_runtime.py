"""The pipeline runtime end to end: adapters equal to the single-process trainer's, for every schedule.

One in-process run per schedule on a single-rank gloo group (cheap), and one real 2-process
pipeline over gloo running the demo (``lorafusion-megatron demo --pipeline-stages 2``).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lorafusion_megatron.config import TrainerConfig, load_config, parse_config
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.testing import assert_same_adapters, saved_adapters, two_job_config, write_profile
from lorafusion_megatron.trainer import Trainer


def _assert_same_adapters(got: Path, want: Path) -> None:
    want_tensors = saved_adapters(want)
    assert_same_adapters(saved_adapters(got), want_tensors, rtol=1e-4, atol=2e-5)
    for job in want_tensors:
        configs = [json.loads((root / job / "adapter_config.json").read_text()) for root in (got, want)]
        for config in configs:
            config.pop("base_model_name_or_path")
            config["target_modules"] = sorted(config["target_modules"])
        assert configs[0] == configs[1]


def _config(tiny_base: Path, output: Path) -> TrainerConfig:
    return parse_config(two_job_config(tiny_base, output, max_grad_norm=0.05))


@pytest.mark.parametrize("schedule", ["lorafusion", "megatron-1f1b", "mlora"])
def test_every_schedule_ends_with_the_trainers_adapters(tiny_base: Path, tmp_path: Path, schedule: str) -> None:
    from lorafusion_megatron.pipeline.worker import run_rank

    reference = _config(tiny_base, tmp_path / "trainer")
    Trainer(reference).train()
    config = _config(tiny_base, tmp_path / "pipeline")
    parallel = ParallelConfig.model_validate({"schedule": schedule, "baseline_microbatch_samples": 2})
    summary = run_rank(
        config, parallel, backend="gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1
    )
    assert summary is not None
    assert summary["schedule"] == schedule
    assert summary["tokens"] > 0
    assert len(summary["bubble_ratio_per_stage"]) == 1
    (idle,) = summary["idle_shares_per_stage"]
    assert set(idle) == {"exchange", "norm_wait", "optimizer", "pack", "other"}
    assert idle["norm_wait"] == 0  # one stage waits for no other stage's norm
    assert all(share >= 0 for share in idle.values())
    assert sum(idle.values()) >= summary["bubble_ratio"] - 1e-9  # the parts cover the idle time
    assert idle["optimizer"] > 0  # 8 steps
    assert idle["pack"] > 0  # every microbatch packed
    assert summary["first_forward_seconds_per_stage"][0] > 0
    assert set(summary["rank0_phase_seconds"]) >= {"data", "plan", "base weights", "adapters", "training", "outputs"}
    steps = summary["steps"]
    assert sorted((s["adapter"], s["step"]) for s in steps) == sorted(
        [("first", k) for k in range(1, 5)] + [("second", k) for k in range(1, 5)]
    )
    assert (Path(config.output_dir) / "pipeline_summary.json").is_file()
    assert summary["replayed_bubble_ratio_per_stage"] == [0.0]  # one stage waits for no neighbour
    trace = json.loads((Path(config.output_dir) / "pipeline_trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 2 * summary["num_microbatches"]
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")


def test_a_preset_is_one_model_in_both_runtimes(tmp_path: Path) -> None:
    """Regression: the single-process trainer drew a preset's weights in one sequence from the seed, the
    pipeline each tensor from its name, so one config trained two different models (first loss 6.256 and 6.186)."""
    from lorafusion_megatron.pipeline.worker import run_rank

    reference = _config(Path("tiny"), tmp_path / "trainer")
    Trainer(reference).train()
    config = _config(Path("tiny"), tmp_path / "pipeline")
    run_rank(config, ParallelConfig(), backend="gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")


def test_the_summary_lists_the_steps_job_by_job_in_the_configs_order() -> None:
    """They came in the order the steps ran, so the jobs (and the printed table's rows) in no order of the config's."""
    from lorafusion_megatron.pipeline.engine import EngineStats, StepRecord
    from lorafusion_megatron.pipeline.worker import summarise

    last = EngineStats(stage=0, replica=0, wall_seconds=1.0)
    for adapter, step in (("alpha", 1), ("zeta", 1), ("alpha", 2), ("zeta", 2)):
        last.steps.append(StepRecord(adapter=adapter, step=step, learning_rate=1e-3, grad_norm=1.0, loss=2.0))
    summary = summarise([last], "lorafusion", ["zeta", "alpha"])
    assert [(s["adapter"], s["step"]) for s in summary["steps"]] == [
        ("zeta", 1),
        ("zeta", 2),
        ("alpha", 1),
        ("alpha", 2),
    ]


def test_demo_on_two_pipeline_stages_ends_with_the_single_process_adapters(tmp_path: Path) -> None:
    """Two processes over gloo, the plan made for S = 2 (with its no-ops), against the trainer."""
    from rich.console import Console

    from lorafusion_megatron.demo import build_demo
    from lorafusion_megatron.pipeline import commands

    console = Console(record=True, width=120)
    parallel = ParallelConfig(pipeline_stages=2)
    assert commands.demo(tmp_path / "pipeline", parallel, console, samples_per_job=12, epochs=1) == 0
    assert "bubble ratio, stage 1" in console.export_text()
    summary = json.loads((tmp_path / "pipeline" / "pipeline_summary.json").read_text())
    assert summary["pipeline_stages"] == 2
    assert len(summary["bubble_ratio_per_stage"]) == 2
    # `train DIR/demo.yaml --resume` resumes it as it ran: without the flag it was told to train afresh.
    assert load_config(tmp_path / "pipeline" / "demo.yaml").parallel.pipeline_stages == 2
    # The durations alone imply at most the measured bubble (the rest is the runtime's own), up to
    # the skew of the stages' clocks, which start at a barrier.
    assert all(shares["norm_wait"] >= 0 for shares in summary["idle_shares_per_stage"])
    replayed = summary["replayed_bubble_ratio_per_stage"]
    assert all(0 < r <= m + 0.02 for r, m in zip(replayed, summary["bubble_ratio_per_stage"], strict=True))
    config = build_demo(tmp_path / "single", samples_per_job=12, epochs=1)
    Trainer(config.model_copy(update={"logging": config.logging.model_copy(update={"progress_bar": False})})).train()
    _assert_same_adapters(tmp_path / "pipeline" / "adapters", tmp_path / "single" / "adapters")


def test_two_data_parallel_replicas_end_with_the_trainers_adapters(tiny_base: Path, tmp_path: Path) -> None:
    """Two processes over gloo, one stage each: gradients summed over replicas before every step."""
    from lorafusion_megatron.pipeline.launch import launch

    reference = _config(tiny_base, tmp_path / "trainer")
    Trainer(reference).train()
    config = _config(tiny_base, tmp_path / "pipeline")
    summary = launch(config, ParallelConfig(data_parallel=2), backend="gloo")
    assert summary is not None
    assert summary["data_parallel"] == 2
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["lorafusion", "megatron-1f1b", "mlora"])
def test_two_stages_times_two_replicas(tiny_base: Path, tmp_path: Path, schedule: str) -> None:
    """Four processes over gloo (slow on two cores: about 20 s each)."""
    from lorafusion_megatron.pipeline.launch import launch

    reference = _config(tiny_base, tmp_path / "trainer")
    Trainer(reference).train()
    config = _config(tiny_base, tmp_path / "pipeline")
    parallel = ParallelConfig(pipeline_stages=2, data_parallel=2, schedule=schedule, baseline_microbatch_samples=2)
    summary = launch(config, parallel, backend="gloo")
    assert summary is not None
    assert len(summary["bubble_ratio_per_stage"]) == 2
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")


def _with_checkpoints(config: TrainerConfig) -> TrainerConfig:
    """Checkpoints every 3 steps; capacity 64, so the first one falls inside a global batch."""
    scheduler = config.scheduler.model_copy(update={"capacity": 64})
    return config.model_copy(update={"save_steps": 3, "save_total_limit": None, "scheduler": scheduler})


def _resume_from_first_checkpoint(config: TrainerConfig, run: Any) -> None:
    """Train straight through with checkpoints, then resume from the first one; the adapters must be identical."""
    import shutil

    run(resume=False)
    adapters = Path(config.output_dir) / "adapters"
    straight = {job: dict(tensors) for job, tensors in saved_adapters(adapters).items()}
    checkpoints = sorted(config.checkpoint_dir.iterdir(), key=lambda p: int(p.name.split("-")[1]))
    assert len(checkpoints) >= 2
    # The first checkpoint falls inside a global batch: its accumulated gradients are saved too.
    assert torch.load(checkpoints[0] / "rank-00000.pt", weights_only=True)["grads"]
    for later in checkpoints[1:]:
        shutil.rmtree(later)
    shutil.rmtree(adapters)
    run(resume=True)
    for job, tensors in saved_adapters(adapters).items():
        for key, tensor in tensors.items():
            assert torch.equal(tensor, straight[job][key]), f"{job}: {key}"


def test_a_resumed_run_ends_with_the_same_adapters(tiny_base: Path, tmp_path: Path) -> None:
    from lorafusion_megatron.pipeline.worker import run_rank

    config = _with_checkpoints(_config(tiny_base, tmp_path / "run"))

    def run(*, resume: bool) -> None:
        store = (tmp_path / f"store-{resume}").as_uri()
        run_rank(config, ParallelConfig(), resume=resume, backend="gloo", init_method=store, rank=0, world_size=1)

    _resume_from_first_checkpoint(config, run)


@pytest.mark.slow
def test_a_resumed_two_stage_run_ends_with_the_same_adapters(tiny_base: Path, tmp_path: Path) -> None:
    """Two processes over gloo, twice (slow on two loaded cores: about 20 s)."""
    from lorafusion_megatron.pipeline.launch import launch

    config = _with_checkpoints(_config(tiny_base, tmp_path / "run"))

    def run(*, resume: bool) -> None:
        launch(config, ParallelConfig(pipeline_stages=2), backend="gloo", resume=resume)

    _resume_from_first_checkpoint(config, run)


def test_resume_refuses_another_layout(tiny_base: Path, tmp_path: Path) -> None:
    from lorafusion_megatron.errors import TrainerError
    from lorafusion_megatron.pipeline.worker import run_rank

    config = _config(tiny_base, tmp_path / "run").model_copy(update={"save_steps": 3})
    store = (tmp_path / "store").as_uri()
    run_rank(config, ParallelConfig(), backend="gloo", init_method=store, rank=0, world_size=1)
    with pytest.raises(TrainerError, match="parallel settings"):
        run_rank(
            config,
            ParallelConfig(schedule="mlora"),
            resume=True,
            backend="gloo",
            init_method=(tmp_path / "again").as_uri(),
            rank=0,
            world_size=1,
        )


def test_launch_refuses_a_mismatching_resume_before_any_rank_starts(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other parallel settings or another config: refused from the checkpoint's files, no process spawned."""
    import importlib

    from lorafusion_megatron.errors import TrainerError
    from lorafusion_megatron.pipeline.launch import launch
    from lorafusion_megatron.pipeline.worker import run_rank

    config = _config(tiny_base, tmp_path / "run").model_copy(update={"save_steps": 3})
    run_rank(config, ParallelConfig(), backend="gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    # As if killed at its end: --resume reads the checkpoint, not the finished run's summary.
    (Path(config.output_dir) / "pipeline_summary.json").unlink()

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was started")

    # The module, not the function torch.multiprocessing exports under the same name.
    monkeypatch.setattr(importlib.import_module("torch.multiprocessing.spawn"), "spawn", no_spawn)
    with pytest.raises(TrainerError, match=r"written with parallel settings .*'data_parallel': 1.*'data_parallel': 2"):
        launch(config, ParallelConfig(data_parallel=2), backend="gloo", resume=True)
    other = config.model_copy(update={"runtime": config.runtime.model_copy(update={"seed": 7})})
    with pytest.raises(TrainerError, match=r"different config \(changed: runtime.seed: 0 -> 7\)"):
        launch(other, ParallelConfig(), backend="gloo", resume=True)


def test_resume_on_other_replicas_is_refused_for_its_parallel_settings(tiny_base: Path, tmp_path: Path) -> None:
    """Not with the plan's "plan again with data_parallel = 2", which a resume cannot do."""
    from lorafusion_megatron.errors import TrainerError
    from lorafusion_megatron.pipeline.checkpoint import check_resumable
    from lorafusion_megatron.pipeline.groups import parallel_layout
    from lorafusion_megatron.pipeline.worker import run_rank, shared_plan
    from lorafusion_megatron.trainer import prepare_data

    config = _config(tiny_base, tmp_path / "run").model_copy(update={"save_steps": 3})
    run_rank(config, ParallelConfig(), backend="gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    data = prepare_data(config).jobs
    with (
        parallel_layout(1, backend="gloo", init_method=(tmp_path / "again").as_uri(), rank=0, world_size=1) as layout,
        pytest.raises(TrainerError, match=r"written with parallel settings .*'data_parallel': 1.*'data_parallel': 2"),
    ):
        shared_plan(config, data, ParallelConfig(data_parallel=2), layout, resume=True)
    check_resumable(config, ParallelConfig(collective_timeout_minutes=90))  # how long ranks wait: not a layout setting


def test_every_process_group_waits_the_configured_collective_timeout(tmp_path: Path) -> None:
    """The world's, megatron-core's pipeline and data-parallel groups and the gloo control groups."""
    import torch.distributed as dist

    from lorafusion_megatron.pipeline.groups import parallel_layout

    with parallel_layout(
        1, backend="gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1, timeout_minutes=7
    ) as layout:
        groups = [dist.group.WORLD, layout.pipeline_group, layout.data_group]
        groups += [g for g in (layout.control_group, layout.world_control_group) if g is not None]
        timeouts = {group._get_backend(torch.device("cpu")).options._timeout for group in groups}
    assert timeouts == {datetime.timedelta(minutes=7)}


def test_under_torchrun_rank_zero_holds_the_run_lock(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second run into the folder is refused on every rank; a finished run lets go of the lock."""
    from lorafusion_megatron.errors import TrainerError
    from lorafusion_megatron.pipeline.worker import run_rank
    from lorafusion_megatron.run_lock import run_lock

    monkeypatch.setenv("RANK", "0")  # what torchrun sets; the process group still meets through a file here
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = _config(tiny_base, tmp_path / "run")
    output = Path(config.output_dir)
    with run_lock(output), pytest.raises(TrainerError, match="is in use by another run"):
        run_rank(config, ParallelConfig(), backend="gloo", init_method=(tmp_path / "a").as_uri(), rank=0, world_size=1)
    assert not (output / "plan.json").exists()
    stale = config.checkpoint_dir / ".checkpoint-3.tmp-killed"
    stale.mkdir(parents=True)
    run_rank(config, ParallelConfig(), backend="gloo", init_method=(tmp_path / "b").as_uri(), rank=0, world_size=1)
    assert not stale.exists()
    with run_lock(output):
        pass


def test_resume_of_a_pipeline_checkpoint_names_the_changed_keys(tiny_base: Path, tmp_path: Path) -> None:
    from lorafusion_megatron.errors import TrainerError
    from lorafusion_megatron.pipeline.worker import run_rank

    config = _config(tiny_base, tmp_path / "run").model_copy(update={"save_steps": 3})
    run_rank(config, ParallelConfig(), backend="gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    first = config.jobs[0]
    changed = config.model_copy(update={"jobs": [first.model_copy(update={"r": first.r * 2}), *config.jobs[1:]]})
    with pytest.raises(
        TrainerError, match=rf"different config \(changed: jobs\[{first.name}\]\.r: {first.r} -> {first.r * 2}\)"
    ):
        run_rank(
            changed,
            ParallelConfig(),
            resume=True,
            backend="gloo",
            init_method=(tmp_path / "again").as_uri(),
            rank=0,
            world_size=1,
        )


@pytest.fixture(scope="module")
def four_layer_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaMA with 4 decoder layers, saved as a local folder (enough for 4 stages)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafusion_megatron.presets import PRESETS

    folder = tmp_path_factory.mktemp("four-layer")
    preset = PRESETS["tiny"]
    config = AutoConfig.for_model(preset.model_type, **{**preset.config, "num_hidden_layers": 4})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["lorafusion", "mlora"])
def test_four_stages(four_layer_base: Path, tmp_path: Path, schedule: str) -> None:
    """Four processes over gloo, one layer each (slow on two cores: about 20 s each)."""
    from lorafusion_megatron.pipeline.launch import launch

    reference = _config(four_layer_base, tmp_path / "trainer")
    Trainer(reference).train()
    config = _config(four_layer_base, tmp_path / "pipeline")
    parallel = ParallelConfig(pipeline_stages=4, schedule=schedule, baseline_microbatch_samples=1)
    summary = launch(config, parallel, backend="gloo")
    assert summary is not None
    assert len(summary["bubble_ratio_per_stage"]) == 4
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")


@pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")  # the lone tail, on purpose
def test_split_lone_global_batches_end_with_the_trainers_adapters(tiny_base: Path, tmp_path: Path) -> None:
    """Two processes over gloo; the profile's cost model splits the long job's lone global batches.

    A split changes only which microbatches hold a global batch's samples, so the adapters are the
    single-process trainer's (which plans for one stage: nothing to split). Without dropout: its
    masks are drawn per microbatch (:mod:`lorafusion_megatron.dropout_seeds`), so any other packing,
    the two-stage plan's without a split included, draws others.
    """
    from lorafusion_megatron.pipeline.launch import launch
    from lorafusion_megatron.planning import plan_from_json

    def lopsided(output: Path) -> TrainerConfig:
        mapping = two_job_config(tiny_base, output, max_grad_norm=0.05)
        mapping["jobs"][0]["dataset"]["num_samples"] = 24  # 8 global batches against 4: 'first' ends alone
        return parse_config(mapping)

    reference = lopsided(tmp_path / "trainer")
    Trainer(reference).train()
    config = lopsided(tmp_path / "pipeline")
    write_profile(config.output_dir, stages=2, fixed_s=1e-4)
    assert launch(config, ParallelConfig(pipeline_stages=2), backend="gloo") is not None
    plan = plan_from_json((Path(config.output_dir) / "plan.json").read_text(encoding="utf-8"))
    assert plan.stats.split_batches > 0
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")


@pytest.mark.multigpu(gpus=2)
def test_two_gpu_pipeline_over_nccl_ends_with_the_single_gpu_adapters(tiny_base: Path, tmp_path: Path) -> None:
    from lorafusion_megatron.pipeline.launch import launch

    def on_gpu(output: Path) -> TrainerConfig:
        config = _config(tiny_base, output)
        return config.model_copy(update={"runtime": config.runtime.model_copy(update={"device": "cuda"})})

    reference = on_gpu(tmp_path / "trainer")
    Trainer(reference).train()
    config = on_gpu(tmp_path / "pipeline")
    summary = launch(config, ParallelConfig(pipeline_stages=2), backend="nccl")
    assert summary is not None
    assert summary["pipeline_stages"] == 2
    _assert_same_adapters(Path(config.output_dir) / "adapters", Path(reference.output_dir) / "adapters")
