"""``profile`` on one CPU rank: measurements, the fitted model and the choice land in readable files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.profiler.run import profile_due, profile_rank, profiled_capacity, with_profiled_choices


def _config(tmp_path: Path) -> TrainerConfig:
    return parse_config(
        {
            "output_dir": str(tmp_path / "run"),
            "base_model": {"model_name_or_path": "tiny", "dtype": "float32", "attn_implementation": "sdpa"},
            "jobs": [
                {"name": name, "dataset": {"synthetic": data, "num_samples": 16, "length_scale": 0.05}, "r": 4}
                for name, data in (("first", "xsum"), ("second", "cnndm"))
            ],
            "scheduler": {"capacity": "auto", "padding_multiple": 16},
            "runtime": {"device": "cpu"},
        }
    )


def test_profile_writes_the_report_and_the_chosen_capacity(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert profiled_capacity(config.output_dir) is None
    assert with_profiled_choices(config) is config
    report = _profile_on_one_rank(config, tmp_path, (64, 128, 256))
    assert report is not None
    assert [m["tokens"] for m in report["measurements"]] == [64, 128, 256]
    assert report["out_of_memory_at"] is None
    assert all(m["forward_s"] > 0 and m["backward_s"] > 0 for m in report["measurements"])
    assert report["chosen_capacity"] in (64, 128, 256)
    assert profiled_capacity(config.output_dir) == report["chosen_capacity"]
    assert with_profiled_choices(config).scheduler.capacity == report["chosen_capacity"]
    saved = json.loads((Path(config.output_dir) / "profile.json").read_text())
    assert saved["cost_model"]["forward_per_token_s"] >= 0
    table = (Path(config.output_dir) / "profile.md").read_text()
    assert "(chosen)" in table


@pytest.mark.parametrize("capacity", ["auto", 128])
def test_auto_checkpointing_measures_both_ways_and_resolves_to_counts(tmp_path: Path, capacity: int | str) -> None:
    """On the CPU nothing limits memory: the tiny preset's 2 layers keep their activations."""
    config = _config(tmp_path)
    config = config.model_copy(
        update={
            "runtime": config.runtime.model_copy(update={"activation_checkpointing": "auto"}),
            "scheduler": config.scheduler.model_copy(update={"capacity": capacity}),
        }
    )
    assert profile_due(config, device_type="cuda", resume=False)
    assert with_profiled_choices(config) is config  # nothing profiled yet: every layer recomputed
    report = _profile_on_one_rank(config, tmp_path, (64, 128))
    assert report is not None
    [model] = report["recompute_models"]
    assert model["layers"] == 2
    assert model["seconds_per_token"] >= 0
    # A fixed capacity is kept: only the recomputed layers are chosen for it.
    assert [c["capacity"] for c in report["candidates"]] == ([64, 128] if capacity == "auto" else [128])
    assert report["chosen_recomputed_layers"] == [0]
    resolved = with_profiled_choices(config)
    assert resolved.runtime.activation_checkpointing == [0]
    assert resolved.scheduler.capacity == report["chosen_capacity"]
    assert not profile_due(config, device_type="cuda", resume=False)
    assert "recomputed layers per stage" in (Path(config.output_dir) / "profile.md").read_text()


def _profile_on_one_rank(config: TrainerConfig, tmp_path: Path, candidates: tuple[int, ...]):
    return profile_rank(
        config,
        ParallelConfig(),
        candidates=candidates,
        sample_length=32,
        repeats=1,
        backend="gloo",
        init_method=(tmp_path / "store").as_uri(),
        rank=0,
        world_size=1,
    )


@pytest.fixture
def memory_for(monkeypatch):
    """``memory_for(n)``: a stage's forward runs out of device memory on microbatches over ``n`` tokens."""
    import torch

    from lorafusion_megatron.pipeline.stage_model import StageModel

    forward = StageModel.forward
    attempts: list[int] = []

    def limit(tokens: int) -> list[int]:
        def forward_within(self, batch, hidden):
            attempts.append(batch.num_tokens)
            if batch.num_tokens > tokens:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return forward(self, batch, hidden)

        monkeypatch.setattr(StageModel, "forward", forward_within)
        return attempts

    return limit


def test_a_capacity_that_runs_out_of_memory_is_reported_and_never_chosen(tmp_path: Path, memory_for) -> None:
    attempts = memory_for(128)
    config = _config(tmp_path)
    report = _profile_on_one_rank(config, tmp_path, (256, 64, 512, 128))
    assert report is not None
    assert [m["tokens"] for m in report["measurements"]] == [64, 128]
    assert report["out_of_memory_at"] == 256
    assert 512 not in attempts  # nothing larger than the first failure is tried
    fits = {c["capacity"]: c["fits"] for c in report["candidates"]}
    assert fits == {64: True, 128: True, 256: False, 512: False}
    assert report["chosen_capacity"] in (64, 128)
    table = (Path(config.output_dir) / "profile.md").read_text()
    assert "256 tokens ran out of device memory" in table
    # No predictions where the measurement ran out of memory.
    assert "| 256 | - | no (out of memory) |" in table
    assert "| 512 | - | no (out of memory) |" in table


def test_a_profile_of_one_token_count_says_it_cannot_compare_capacities(tmp_path: Path, memory_for) -> None:
    memory_for(64)
    config = _config(tmp_path)
    report = _profile_on_one_rank(config, tmp_path, (64, 128))
    assert report is not None
    assert [m["tokens"] for m in report["measurements"]] == [64]
    assert "One token count was measured" in (Path(config.output_dir) / "profile.md").read_text()


def test_a_profile_where_nothing_fits_says_what_to_change(tmp_path: Path, memory_for) -> None:
    memory_for(32)
    with pytest.raises(TrainerError, match=r"runs out of device memory.*--capacities"):
        _profile_on_one_rank(_config(tmp_path), tmp_path, (64, 128))


@pytest.mark.slow
def test_profile_on_two_stages_fits_one_factor_per_stage(tmp_path: Path) -> None:
    """Two processes over gloo (slow on two cores: about 15 s)."""
    from lorafusion_megatron.pipeline.launch import launch_profile

    config = _config(tmp_path)
    parallel = ParallelConfig(pipeline_stages=2)
    report = launch_profile(config, parallel, backend="gloo", candidates=(64, 128), sample_length=32, repeats=1)
    assert report is not None
    assert sorted({m["stage"] for m in report["measurements"]}) == [0, 1]
    assert len(report["cost_model"]["stage_factors"]) == 2


@pytest.mark.parametrize(
    ("capacity", "device_type", "resume", "profiled", "due"),
    [
        ("auto", "cuda", False, False, True),
        ("auto", "cpu", False, False, False),  # the CPU keeps 4096
        ("auto", "cuda", True, False, False),  # a resumed run keeps its plan
        ("auto", "cuda", False, True, False),  # profiled already
        (256, "cuda", False, False, False),  # a number is the user's choice
    ],
)
def test_train_profiles_first_only_when_auto_has_nothing_to_read(
    tmp_path: Path, capacity, device_type: str, resume: bool, profiled: bool, due: bool
) -> None:
    from lorafusion_megatron.profiler.run import profile_due

    config = _config(tmp_path)
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"capacity": capacity})})
    if profiled:
        Path(config.output_dir).mkdir(parents=True)
        (Path(config.output_dir) / "profile.json").write_text(json.dumps({"chosen_capacity": 128}))
    assert profile_due(config, device_type=device_type, resume=resume) is due
