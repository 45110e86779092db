"""``train --resume`` beyond the plain case: a finished run (one process or a pipeline), changed settings,
evaluation removed or added."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file

from lorafusion_megatron.checkpoint import RunFingerprint, checkpoint_run_id, latest_checkpoint, read_checkpoint_meta
from lorafusion_megatron.cli import main
from lorafusion_megatron.config import TrainerConfig, fingerprinted_config, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.testing import StopAfter, assert_same_adapters, saved_adapters
from lorafusion_megatron.trainer import Trainer

_EVAL_SET = {"synthetic": "xsum", "num_samples": 3, "length_scale": 0.05}


def _jobs(*, evaluate: tuple[str, ...] = (), second_steps: int = 3) -> list[dict]:
    """``first``: 10 samples, 2 epochs in batches of 4 (5 steps); ``second``: ``second_steps`` steps; dropout on."""
    jobs = [
        {
            "name": "first",
            "dataset": {"synthetic": "xsum", "num_samples": 10, "length_scale": 0.05},
            "r": 4,
            "lora_alpha": 8,
            "lora_dropout": 0.1,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "learning_rate": 1e-2,
            "warmup_ratio": 0.25,
            "global_batch_size": 4,
            "num_train_epochs": 2,
        },
        {
            "name": "second",
            "dataset": {"synthetic": "wikisum", "num_samples": 10, "length_scale": 0.02},
            "r": 2,
            "lora_alpha": 4,
            "lora_dropout": 0.1,
            "target_modules": "all-linear",
            "learning_rate": 5e-3,
            "lr_scheduler_type": "linear",
            "global_batch_size": 3,
            "max_steps": second_steps,
        },
    ]
    for job in jobs:
        if job["name"] in evaluate:
            job.update(eval_dataset=_EVAL_SET, eval_steps=1)
    return jobs


@pytest.fixture
def make_config(config_dict, tmp_path: Path):
    """A two-job run on the tiny preset (8 optimizer steps in all) in ``tmp_path / name``."""

    def make(name: str = "run", *, jobs: list[dict] | None = None, **top) -> TrainerConfig:
        data = config_dict(jobs=jobs or _jobs(), output_dir=str(tmp_path / name), **top)
        data["scheduler"]["milp_time_limit"] = None  # the same plan on every run of the config
        return parse_config(data)

    return make


def _console() -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(file=text, width=300), text


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (the run lock aside): its bytes and modification time."""
    return {
        str(path.relative_to(folder)): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ".lorafusion-run.lock"
    }


def _fails(*args, **kwargs):
    raise AssertionError("a finished run read its data again")


@pytest.mark.parametrize("save_steps", [2, None], ids=["with-checkpoints", "without-checkpoints"])
def test_resume_of_a_finished_run_says_it_is_complete_and_writes_nothing(
    make_config, monkeypatch: pytest.MonkeyPatch, save_steps: int | None
) -> None:
    """It resumed from the newest periodic checkpoint and trained its last steps again, rewriting the
    adapters, summary.json and eval_history.json (and logging those steps to TensorBoard twice); without
    a checkpoint it said "no checkpoint; train without --resume", which then refused the earlier results."""
    import lorafusion_megatron.trainer as trainer_module

    config = make_config(jobs=_jobs(evaluate=("first",)), save_steps=save_steps)
    Trainer(config).train()
    before = _files(Path(config.output_dir))
    monkeypatch.setattr(trainer_module, "prepare_data", _fails)
    console, text = _console()
    result = Trainer(config, console=console).train(resume=True)
    assert not result.interrupted
    assert result.adapters == {job.name: config.job_output_dir(job) for job in config.jobs}
    assert result.state.total_optimizer_steps == 8
    said = " ".join(text.getvalue().split())
    assert "the run is complete at step 8 (first 5/5, second 3/3 optimizer steps); nothing to resume" in said
    assert _files(Path(config.output_dir)) == before


def test_a_run_resumed_from_an_earlier_versions_checkpoint_is_complete_once_finished(
    make_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a checkpoint holds no run id; the resumed run drew a random one, which its summary recorded and
    the checkpoint never matched, so every later --resume trained the run's tail again."""
    import lorafusion_megatron.trainer as trainer_module

    config = make_config(save_steps=None)
    assert Trainer(config, stop=StopAfter(2)).train().interrupted
    checkpoint = latest_checkpoint(config.checkpoint_dir)
    assert checkpoint is not None
    state = checkpoint / "trainer_state.json"
    meta = json.loads(state.read_text())
    del meta["run_id"]  # as an earlier version wrote it
    state.write_text(json.dumps(meta))
    Trainer(config).train(resume=True)
    assert json.loads((Path(config.output_dir) / "summary.json").read_text())["run_id"] == checkpoint_run_id(checkpoint)
    before = _files(Path(config.output_dir))
    monkeypatch.setattr(trainer_module, "prepare_data", _fails)
    console, text = _console()
    Trainer(config, console=console).train(resume=True)
    assert "nothing to resume" in text.getvalue()
    assert _files(Path(config.output_dir)) == before


def _delete_folder(folder: Path) -> None:
    shutil.rmtree(folder)


def _delete_weights(folder: Path) -> None:
    (folder / "adapter_model.safetensors").unlink()


def _truncate_weights(folder: Path) -> None:
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])


_ADAPTER_DAMAGE = {
    "folder-gone": (_delete_folder, "is not in its folder (gone, or the job's output_dir changed)"),
    "weights-gone": (_delete_weights, "has no weights (adapter_model.safetensors is missing)"),
    "weights-cut-short": (
        _truncate_weights,
        "has weights that cannot be read (adapter_model.safetensors: Error while deserializing header",
    ),
}


@pytest.mark.parametrize("damage", list(_ADAPTER_DAMAGE))
def test_a_finished_run_whose_adapter_is_gone_or_damaged_resumes_from_its_checkpoint(
    make_config, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Not reported complete: the newest checkpoint writes the adapter again, the same bits. With its weights
    file deleted or cut short (adapter_config.json kept), the run was reported complete, its adapter unusable."""
    config = make_config(save_steps=2)
    Trainer(config).train()
    folder = config.job_output_dir(config.jobs[1])
    # Copied: the loaded tensors may map the file, which cutting it short in place would change.
    before = {key: tensor.clone() for key, tensor in load_file(folder / "adapter_model.safetensors").items()}
    spoil, problem = _ADAPTER_DAMAGE[damage]
    spoil(folder)
    with caplog.at_level("WARNING"):
        Trainer(config).train(resume=True)
    said = " ".join(caplog.text.split())
    assert f"records a finished run, but the adapter of job second {problem}" in said
    assert "resuming from the newest checkpoint, which writes the adapters there" in said
    assert_same_adapters({"second": load_file(folder / "adapter_model.safetensors")}, {"second": before})


def test_a_finished_runs_damaged_adapter_without_a_checkpoint_says_what_to_do(make_config) -> None:
    """With no checkpoint to write it again, --resume said the run was complete (or "no checkpoint")."""
    config = make_config(save_steps=None)
    Trainer(config).train()
    _delete_weights(config.job_output_dir(config.jobs[0]))
    with pytest.raises(
        TrainerError,
        match=r"records a finished run, but the adapter of job first has no weights \(adapter_model\.safetensors is "
        r"missing\), and no checkpoint is left to write it again .*: restore the adapter, or train again with "
        r"--overwrite",
    ):
        Trainer(config).train(resume=True)


def test_a_hand_edited_summary_resumes_from_the_newest_checkpoint(
    make_config, caplog: pytest.LogCaptureFixture
) -> None:
    """Counters that are still JSON but no run writes gave a traceback; now the newest checkpoint writes it again."""
    config = make_config(save_steps=2)
    Trainer(config).train()
    summary = Path(config.output_dir) / "summary.json"
    record = json.loads(summary.read_text())
    record["jobs"][0]["steps_done"] = "all"
    summary.write_text(json.dumps(record))
    with caplog.at_level("WARNING"):
        result = Trainer(config).train(resume=True)
    assert "summary.json holds what no run writes (jobs[first].steps_done: 'all' is not a whole number" in caplog.text
    assert result.state.total_optimizer_steps == 8
    assert json.loads(summary.read_text())["jobs"][0]["steps_done"] == 5


def test_a_finished_run_is_judged_by_the_folders_its_config_names(
    make_config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The summary's recorded folders were trusted: a job given another output_dir was reported complete."""
    config = make_config(save_steps=2)
    Trainer(config).train()
    jobs = _jobs()
    jobs[1]["output_dir"] = str(tmp_path / "elsewhere")
    moved = make_config(jobs=jobs, save_steps=2)
    with caplog.at_level("WARNING"):
        result = Trainer(moved).train(resume=True)
    assert "the adapter of job second is not in its folder (gone, or the job's output_dir changed)" in caplog.text
    assert result.adapters["second"] == tmp_path / "elsewhere"
    assert (tmp_path / "elsewhere" / "adapter_model.safetensors").is_file()


def test_the_cli_exits_0_on_a_finished_run(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_dict(save_steps=2)))
    assert main(["train", str(path)]) == 0
    capsys.readouterr()
    assert main(["train", str(path), "--resume"]) == 0
    assert "the run is complete at step 6" in " ".join(capsys.readouterr().err.split())


def test_a_longer_run_is_refused_with_what_to_do_instead(make_config) -> None:
    """max_steps sets the plan and the learning-rate schedule: 3 steps then 2 more are not a 5-step run."""
    config = make_config()
    assert Trainer(config, stop=StopAfter(2)).train().interrupted
    longer = make_config(jobs=_jobs(second_steps=5))
    what_to_do = (
        r"the length of job 'second' \(max_steps, num_train_epochs\) cannot change on --resume: .* Train the new "
        r"length from the start, without --resume, into a new output_dir; or restore the old length"
    )
    changed = r"a different config \(changed: jobs\[second\]\.max_steps: 3 -> 5\): "
    with pytest.raises(TrainerError, match=rf"checkpoint .* was written by a run with {changed}{what_to_do}"):
        Trainer(longer).train(resume=True)
    Trainer(config).train(resume=True)
    with pytest.raises(TrainerError, match=rf"holds a finished run \(complete at step 8 .*\), trained with {changed}"):
        Trainer(longer).train(resume=True)
    other = make_config(runtime={"device": "cpu", "seed": 3})
    with pytest.raises(TrainerError, match=r"changed: runtime\.seed: 0 -> 3\): nothing to resume; to train this"):
        Trainer(other).train(resume=True)


def test_a_resume_onto_other_base_weights_is_refused(make_config, tiny_base: Path, tmp_path: Path) -> None:
    """The base model's folder holds other weights at the resume (same path, same config): refused."""
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    config = make_config(
        base_model={"model_name_or_path": str(base), "dtype": "float32", "attn_implementation": "sdpa"}
    )
    assert Trainer(config, stop=StopAfter(2)).train().interrupted
    original = (base / "model.safetensors").read_bytes()
    other = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.01)  # another fine-tune of the same model: same shapes and files
    other.save_pretrained(base)
    with pytest.raises(
        TrainerError, match=rf"checkpoint .* was trained on other base weights: the weight files in {base}"
    ):
        Trainer(config).train(resume=True)
    (base / "model.safetensors").write_bytes(original)
    assert not Trainer(config).train(resume=True).interrupted


def test_a_single_process_preset_checkpoint_of_an_earlier_version_is_refused(make_config) -> None:
    """Earlier versions drew a preset's weights otherwise in the single-process trainer: resuming would
    continue the adapters on another base model."""
    config = make_config()
    assert Trainer(config, stop=StopAfter(2)).train().interrupted
    checkpoint = latest_checkpoint(config.checkpoint_dir)
    assert checkpoint is not None
    state = checkpoint / "trainer_state.json"
    meta = json.loads(state.read_text())
    assert meta["base_weights"] == "preset-drawn-per-tensor-name"
    del meta["base_weights"]  # as an earlier version wrote it
    state.write_text(json.dumps(meta))
    with pytest.raises(TrainerError, match=r"written by an earlier version, whose single-process trainer drew preset"):
        Trainer(config).train(resume=True)


def test_a_run_started_afresh_after_a_finished_one_is_resumed(make_config) -> None:
    """--overwrite keeps the finished run's summary.json until it ends: its checkpoint, not that summary, counts."""
    config = make_config()
    Trainer(config).train()
    earlier = json.loads((Path(config.output_dir) / "summary.json").read_text())["run_id"]
    assert Trainer(config, stop=StopAfter(2)).train(overwrite=True).interrupted
    console, text = _console()
    result = Trainer(config, console=console).train(resume=True)
    assert result.state.total_optimizer_steps == 8
    assert "nothing to resume" not in text.getvalue()
    assert json.loads((Path(config.output_dir) / "summary.json").read_text())["run_id"] != earlier


def test_resume_accepts_settings_that_cannot_change_the_result(make_config) -> None:
    """Jobs reordered, another MILP time limit, epochs of a job with max_steps, device auto for cpu, every layer
    recomputed: the same adapters, bit for bit, as a run never interrupted (dropout on)."""
    straight = make_config("straight")
    Trainer(straight).train()
    resumed = make_config("resumed")
    assert Trainer(resumed, stop=StopAfter(3)).train().interrupted
    jobs = _jobs()[::-1]
    jobs[0]["num_train_epochs"] = 4  # second: max_steps overrides it
    device = "cpu" if torch.cuda.is_available() else "auto"  # auto is cpu here only without a GPU
    changed = make_config("resumed", jobs=jobs, runtime={"device": device, "seed": 0, "activation_checkpointing": True})
    changed = changed.model_copy(update={"scheduler": changed.scheduler.model_copy(update={"milp_time_limit": 2.0})})
    result = Trainer(changed).train(resume=True)
    assert list(result.state.jobs) == ["second", "first"]
    assert_same_adapters(saved_adapters(changed), saved_adapters(straight))


def test_the_config_check_ignores_what_a_resume_cannot_change(tmp_path: Path, config_dict) -> None:
    """And names only the changes that matter when it refuses."""
    jobs = config_dict()["jobs"]
    jobs[1]["max_steps"] = 2
    folder = tmp_path / "checkpoint-8"
    folder.mkdir()
    stored = fingerprinted_config(parse_config(config_dict(jobs=jobs)))
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "old/data", "config": stored}))

    def check(**changes) -> None:
        data = config_dict(jobs=jobs)
        for section, values in changes.items():
            data[section] = values if section == "jobs" else {**data[section], **values}
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data", fingerprinted_config(parse_config(data))))

    check(jobs=jobs[::-1], scheduler={"milp_time_limit": None})
    check(jobs=[jobs[0], {**jobs[1], "num_train_epochs": 7}])  # max_steps overrides it
    check(runtime={"activation_checkpointing": "balanced"})
    with pytest.raises(TrainerError) as refused:
        check(jobs=[{**jobs[1], "r": 8}, jobs[0]], scheduler={"milp_time_limit": 9.0})
    assert "(changed: jobs[second].r: 4 -> 8): restore that config" in str(refused.value)
    with pytest.raises(TrainerError, match=r"\(changed: jobs\[first\]\.num_train_epochs: 1 -> 2\)"):
        check(jobs=[{**jobs[0], "num_train_epochs": 2}, jobs[1]])
    if not torch.cuda.is_available():  # auto is cpu, and sdpa, on this host
        check(runtime={"device": "auto"}, base_model={"attn_implementation": "auto"})
        with pytest.raises(TrainerError, match=r"changed: runtime\.device: cpu -> cuda\)"):
            check(runtime={"device": "cuda"})


@pytest.mark.parametrize("kept", [("first",), ()], ids=["one-job-stops", "all-stop"])
def test_evaluation_removed_at_a_resume_keeps_its_history_and_says_so(
    make_config, caplog: pytest.LogCaptureFixture, kept: tuple[str, ...]
) -> None:
    """Removed from one job, its records vanished from eval_history.json and summary.json; removed from all,
    eval_history.json kept them while summary.json said there were none."""
    config = make_config(jobs=_jobs(evaluate=("first", "second")))
    stopped = Trainer(config, stop=StopAfter(3)).train()
    steps = {name: job.steps_done for name, job in stopped.state.jobs.items()}
    before = json.loads((Path(config.output_dir) / "eval_history.json").read_text())
    assert before["second"], "the test needs an evaluation of second before the stop"
    console, text = _console()
    with caplog.at_level("INFO"):
        Trainer(make_config(jobs=_jobs(evaluate=kept)), console=console).train(resume=True)
    summary = json.loads((Path(config.output_dir) / "summary.json").read_text())
    history = json.loads((Path(config.output_dir) / "eval_history.json").read_text())
    assert history == summary["eval"]
    assert set(history) == {"first", "second"}
    for name in ("first", "second"):
        expected = [1, 2, 3, 4, 5] if name in kept else list(range(1, steps[name] + 1))
        assert [record["step"] for record in history[name]] == expected
    assert history["second"] == before["second"]
    losses = {job["name"]: job["eval_loss"] for job in summary["jobs"]}
    assert losses == {name: records[-1]["loss"] for name, records in history.items()}
    assert (
        f"second no longer evaluates (its eval_dataset was removed): its evaluations up to step {steps['second']}"
        in (caplog.text)
    )
    stopped_jobs = "second" if kept else "first, second"
    assert f"removed its eval_dataset: {stopped_jobs}" in " ".join(text.getvalue().split())


def test_a_pipeline_run_resumes_with_its_jobs_reordered(tiny_base: Path, tmp_path: Path) -> None:
    """The pipeline runtime's checkpoints name jobs too (rank files, engine counters, progress): one rank over
    gloo, resumed from its first checkpoint with the jobs listed the other way round and every layer
    recomputed: the same adapters."""
    from lorafusion_megatron.pipeline.options import ParallelConfig
    from lorafusion_megatron.pipeline.worker import run_rank
    from lorafusion_megatron.testing import two_job_config

    raw = {**two_job_config(tiny_base, tmp_path / "run", lora_dropout=0.1, capacity=64), "save_steps": 3}
    raw["save_total_limit"] = None
    raw["scheduler"]["milp_time_limit"] = None

    def run(data: dict, store: str, *, resume: bool) -> None:
        config = parse_config(data)
        run_rank(
            config,
            ParallelConfig(),
            resume=resume,
            backend="gloo",
            init_method=(tmp_path / store).as_uri(),
            rank=0,
            world_size=1,
        )

    run(raw, "straight", resume=False)
    adapters = tmp_path / "run" / "adapters"
    straight = saved_adapters(adapters)
    assert list(straight) == ["first", "second"]
    checkpoints = sorted((tmp_path / "run" / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))
    for later in checkpoints[1:]:
        shutil.rmtree(later)
    shutil.rmtree(adapters)
    runtime = {**raw["runtime"], "activation_checkpointing": True}
    run({**raw, "jobs": raw["jobs"][::-1], "runtime": runtime}, "resumed", resume=True)
    assert_same_adapters(saved_adapters(adapters), straight)


def _pipeline_config(tiny_base: Path, output: Path) -> dict:
    """Two jobs of 4 steps each on the pipeline runtime, a checkpoint every 3 steps, the same plan on every run."""
    from lorafusion_megatron.testing import two_job_config

    raw = {**two_job_config(tiny_base, output, lora_dropout=0.1, capacity=64), "save_steps": 3}
    raw["scheduler"]["milp_time_limit"] = None
    return raw


@pytest.mark.slow
def test_resume_of_a_finished_two_stage_run_says_it_is_complete_and_starts_nothing(
    tiny_base: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It started two ranks that resumed from the newest checkpoint and trained the last steps again,
    rewriting the adapters, pipeline_summary.json and the trace. The CLI on 2 processes over gloo, once (slow on
    two loaded cores: about 30 s); the resumes start none."""
    import importlib

    raw = _pipeline_config(tiny_base, tmp_path / "run")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    two_stages = ["--pipeline-stages", "2"]
    assert main(["train", str(path), *two_stages]) == 0
    output = Path(raw["output_dir"])
    summary = json.loads((output / "pipeline_summary.json").read_text())
    assert checkpoint_run_id(latest_checkpoint(output / "checkpoints")) == summary["run_id"]
    before = _files(output)

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was started")

    # The module, not the function torch.multiprocessing exports under the same name.
    monkeypatch.setattr(importlib.import_module("torch.multiprocessing.spawn"), "spawn", no_spawn)
    capsys.readouterr()
    with caplog.at_level("INFO", logger="lorafusion_megatron"):
        assert main(["train", str(path), *two_stages, "--resume"]) == 0
    said = " ".join(caplog.text.split())
    assert (
        "the run is complete at step 8 (first 4/4, second 4/4 optimizer steps); nothing to resume, its adapters "
        "and pipeline_summary.json are left as they are" in said
    )
    assert "LoRAFusion training summary" in capsys.readouterr().err

    unchanged = {**raw, "scheduler": {**raw["scheduler"], "milp_time_limit": 5.0}, "save_steps": 2}
    path.write_text(yaml.safe_dump(unchanged))
    assert main(["train", str(path), *two_stages, "--resume"]) == 0, "settings that cannot change the weights"
    capsys.readouterr()
    first = raw["jobs"][0]
    path.write_text(yaml.safe_dump({**raw, "jobs": [{**first, "r": 8}, *raw["jobs"][1:]]}))
    assert main(["train", str(path), *two_stages, "--resume"]) == 2
    refused = " ".join(capsys.readouterr().err.split())
    assert (
        "holds a finished run (complete at step 8 (first 4/4, second 4/4 optimizer steps)), trained with a "
        "different config (changed: jobs[first].r: 4 -> 8): nothing to resume" in refused
    )
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), *two_stages, "--schedule", "mlora", "--resume"]) == 2
    refused = " ".join(capsys.readouterr().err.split())
    assert "trained with parallel settings" in refused
    assert "'schedule': 'lorafusion'" in refused
    assert "'schedule': 'mlora'" in refused
    assert _files(output) == before


def test_a_finished_pipeline_run_resumes_from_its_checkpoint_unless_its_summary_shows_it_complete(
    tiny_base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Adapters gone, a summary of an earlier version (no id) or of a run stopped early: the launcher lets the
    ranks resume from the newest checkpoint. One rank in this process; its resume keeps the run's id."""
    from lorafusion_megatron.pipeline.checkpoint import check_resumable
    from lorafusion_megatron.pipeline.launch import launch
    from lorafusion_megatron.pipeline.options import ParallelConfig
    from lorafusion_megatron.pipeline.worker import run_rank
    from lorafusion_megatron.run_lock import run_lock

    config = parse_config(_pipeline_config(tiny_base, tmp_path / "run"))
    parallel = ParallelConfig()

    def run(store: str, *, resume: bool) -> None:
        uri = (tmp_path / store).as_uri()
        run_rank(config, parallel, resume=resume, backend="gloo", init_method=uri, rank=0, world_size=1)

    run("first", resume=False)
    path = Path(config.output_dir) / "pipeline_summary.json"
    written = path.read_text()
    summary = json.loads(written)
    finished = check_resumable(config, parallel)
    assert finished is not None
    assert finished.adapters == {job.name: config.job_output_dir(job) for job in config.jobs}
    for edit in ({"run_id": None}, {"checkpoint": str(latest_checkpoint(config.checkpoint_dir))}):
        path.write_text(json.dumps({**summary, **edit}))
        assert check_resumable(config, parallel) is None, edit
    state_file = latest_checkpoint(config.checkpoint_dir) / "trainer_state.json"
    saved_state = state_file.read_text()
    state_file.write_text(json.dumps({**json.loads(saved_state), "position": -1}))  # a hand edit
    with pytest.raises(TrainerError, match=r"is damaged: trainer_state.json holds what no run writes \(position: -1"):
        check_resumable(config, parallel)
    state_file.write_text(saved_state)
    path.write_text(written)
    expected = saved_adapters(config)
    shutil.rmtree(config.job_output_dir(config.jobs[1]))
    with caplog.at_level("WARNING"):
        assert check_resumable(config, parallel) is None
    assert "records a finished run, but the adapter of job second is not in its folder" in caplog.text
    run("resumed", resume=True)
    assert_same_adapters(saved_adapters(config), expected)
    assert json.loads(path.read_text())["run_id"] == summary["run_id"]
    assert check_resumable(config, parallel) is not None
    # Checked under the run's lock: a run training in the folder is refused as such, not reported complete.
    with run_lock(Path(config.output_dir)), pytest.raises(TrainerError, match="is in use by another run"):
        launch(config, parallel, resume=True)
