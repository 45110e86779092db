from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorafusion_megatron.checkpoint import latest_checkpoint, read_checkpoint_file
from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.executor import StopSignal
from lorafusion_megatron.run_lock import run_lock, run_locks
from lorafusion_megatron.testing import StopAfter
from lorafusion_megatron.trainer import Trainer


def _jobs(data: Path, *, dropout: float = 0.0) -> list[dict]:
    return [
        {
            "name": "first",
            "dataset": {"path": str(data / "first.jsonl")},
            "r": 4,
            "lora_alpha": 8,
            "lora_dropout": dropout,
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
            "lora_dropout": dropout,
            "use_rslora": True,
            "target_modules": "all-linear",
            "learning_rate": 5e-3,
            "lr_scheduler_type": "linear",
            "global_batch_size": 3,
            "max_steps": 3,
        },
    ]


@pytest.fixture
def make_config(config_dict, tiny_base: Path, jsonl_factory, tmp_path: Path):
    jsonl_factory("first", 10, seed=1)

    def make(*, dropout: float = 0.0, **top):
        base = {"model_name_or_path": str(tiny_base), "dtype": "float32", "attn_implementation": "sdpa"}
        return parse_config(config_dict(jobs=_jobs(tmp_path / "data", dropout=dropout), base_model=base, **top))

    return make


def _adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


# PEFT (0.21) still calls transformers' deprecated `is_gradient_checkpointing` when loading an adapter.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_train_writes_peft_adapters_that_load_and_match(make_config, tiny_base: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = make_config()
    result = Trainer(config).train()
    assert not result.interrupted
    jobs = result.state.jobs
    assert (jobs["first"].steps_done, jobs["first"].total_steps) == (5, 5)  # 20 positions / 4
    assert (jobs["second"].steps_done, jobs["second"].total_steps) == (3, 3)
    assert jobs["first"].last_loss is not None
    assert jobs["first"].last_loss < jobs["first"].first_loss
    summary = json.loads((Path(config.output_dir) / "summary.json").read_text())
    assert summary["total_optimizer_steps"] == 8

    ids = torch.tensor([[1, 70, 80, 90, 100, 33, 2]])
    for name in ("first", "second"):
        folder = result.adapters[name]
        assert folder == Path(config.output_dir) / "adapters" / name
        assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == str(tiny_base)
        assert any("lora_B" in key and float(t.abs().sum()) > 0 for key, t in _adapter_tensors(folder).items())
        base = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
        plain = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, folder).eval()
        with torch.no_grad():
            tuned = loaded(input_ids=ids).logits
        assert not torch.allclose(tuned, plain, atol=1e-4)
        merged = loaded.merge_and_unload()
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids).logits, tuned, rtol=1e-4, atol=1e-4)


def test_resume_ends_with_the_same_weights_as_an_uninterrupted_run(make_config, tmp_path: Path) -> None:
    """Stopped mid-run (inside a global batch, dropout on), then resumed: bit-identical adapters."""
    straight = make_config(dropout=0.1, output_dir=str(tmp_path / "straight"))
    Trainer(straight).train()

    resumed = make_config(dropout=0.1, output_dir=str(tmp_path / "resumed"), save_total_limit=None)
    first = Trainer(resumed, stop=StopAfter(3)).train()
    assert first.interrupted
    assert first.state.position == 3
    assert first.checkpoint is not None
    assert (first.checkpoint / "adapters" / "first" / "adapter_config.json").is_file()
    assert not (Path(resumed.output_dir) / "adapters" / "first").exists()
    second = Trainer(resumed).train(resume=True)
    assert not second.interrupted
    assert second.state.total_optimizer_steps == 8
    for name in ("first", "second"):
        expected = _adapter_tensors(Path(straight.output_dir) / "adapters" / name)
        actual = _adapter_tensors(second.adapters[name])
        assert expected.keys() == actual.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=key)


class CtrlCAfter(StopSignal):
    """Sends the process a real SIGINT (as Ctrl-C does) when polled after ``count`` microbatches."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def __call__(self) -> bool:
        self.count -= 1
        if self.count == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().__call__()


def test_ctrl_c_writes_a_checkpoint_and_resume_finishes(make_config) -> None:
    config = make_config()
    stopped = Trainer(config, stop=CtrlCAfter(2)).train()
    assert stopped.interrupted
    assert stopped.state.position == 2
    assert stopped.checkpoint == latest_checkpoint(config.checkpoint_dir)
    finished = Trainer(config).train(resume=True)
    assert not finished.interrupted
    assert finished.state.total_optimizer_steps == 8


def test_periodic_checkpoints_keep_the_newest(make_config) -> None:
    config = make_config(save_steps=2, save_total_limit=2)
    Trainer(config).train()
    names = sorted(p.name for p in config.checkpoint_dir.iterdir())
    assert names == ["checkpoint-4", "checkpoint-6"]
    state = json.loads((config.checkpoint_dir / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["state"]["total_optimizer_steps"] == 6


def test_a_damaged_checkpoint_is_named_with_the_one_to_resume_from(make_config) -> None:
    """A file cut short gave a safetensors or pickle traceback (status 3) and pointed at the same checkpoint."""
    config = make_config(save_steps=2, save_total_limit=2)
    Trainer(config).train()
    (Path(config.output_dir) / "summary.json").unlink()  # as if killed at its end: --resume reads the checkpoint
    newest, before = config.checkpoint_dir / "checkpoint-6", "checkpoint-4"
    for name in ("lora.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "plan.json"):
        whole = (newest / name).read_bytes()
        (newest / name).write_bytes(whole[: len(whole) // 2])
        damaged = rf"checkpoint-6 is damaged: {name} cannot be read \(.+\); delete that folder, and --resume continues"
        with pytest.raises(TrainerError, match=rf"{damaged} from {before}"):
            Trainer(config).train(resume=True)
        (newest / name).write_bytes(whole)
    # Not damage, so no advice to delete: a plan of another version, a file this user may not read.
    plan = json.loads((newest / "plan.json").read_text())
    (newest / "plan.json").write_text(json.dumps({**plan, "schema_version": 2}))
    with pytest.raises(TrainerError, match=r"plan.json is not a document this version .* \(schema_version: Input"):
        Trainer(config).train(resume=True)
    (newest / "plan.json").write_text(json.dumps(plan))

    def forbidden(path: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    with pytest.raises(TrainerError, match=r"rng.pt cannot be read \(Permission denied\): fix its permissions"):
        read_checkpoint_file(newest, "rng.pt", forbidden)
    shutil.rmtree(config.checkpoint_dir / before)
    (newest / "rng.pt").unlink()
    with pytest.raises(TrainerError, match=r"rng.pt cannot be read .*; it is the only checkpoint: restore the file"):
        Trainer(config).train(resume=True)


def test_resume_refuses_a_checkpoint_of_another_config(make_config, tmp_path: Path) -> None:
    config = make_config(output_dir=str(tmp_path / "run"))
    Trainer(config, stop=StopAfter(2)).train()
    changed = config.model_copy(update={"runtime": config.runtime.model_copy(update={"seed": 7})})
    with pytest.raises(
        TrainerError, match=r"written by a run with a different config \(changed: runtime\.seed: 0 -> 7\)"
    ):
        Trainer(changed).train(resume=True)


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(make_config, tmp_path: Path) -> None:
    config = make_config(output_dir=str(tmp_path / "run"))
    Trainer(config, stop=StopAfter(2)).train()
    with pytest.raises(TrainerError, match="holds checkpoints of an earlier run: continue it with --resume"):
        Trainer(config).train()


def test_a_second_run_into_the_same_output_dir_is_refused(make_config, tmp_path: Path) -> None:
    """Two runs into one folder would interleave adapters, summaries and checkpoints; the lock is an flock."""
    config = make_config(output_dir=str(tmp_path / "run"))
    with run_lock(tmp_path / "run"), pytest.raises(TrainerError, match=r"run is in use by another run \(process \d+\)"):
        Trainer(config).train()
    Trainer(config).train()  # released: the run goes ahead
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_job_folder_is_locked_however_another_run_names_it(make_config, tmp_path: Path) -> None:
    """Two runs with run folders of their own but one job folder both wrote it, the last one winning:
    named alike, through a symbolic link, or as the other run's default folder (that run started
    first, or later)."""

    def run(name: str, folder: Path | None) -> TrainerConfig:
        config = make_config(output_dir=str(tmp_path / name))
        if folder is None:
            return config
        first = config.jobs[0].model_copy(update={"output_dir": str(folder)})
        return config.model_copy(update={"jobs": [first, *config.jobs[1:]]})

    shared = tmp_path / "shared" / "adapter"
    (tmp_path / "links").mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "links" / "mine").symlink_to(shared, target_is_directory=True)
    in_use = r"job first's output folder, is in use by another run \(process \d+\)"
    cases = [(shared, shared), (shared, tmp_path / "links" / "mine"), (None, tmp_path / "a" / "adapters" / "first")]
    for held, other in cases:
        with run_locks(run("a", held)), pytest.raises(TrainerError, match=in_use):
            Trainer(run("b", other)).train()
        assert not (tmp_path / "b" / "summary.json").exists()
    # A run folder that never ran has no run lock: its default job folder is locked on its own.
    with run_locks(run("b", tmp_path / "c" / "adapters" / "first")), pytest.raises(TrainerError, match=in_use):
        Trainer(run("c", None)).train()
    assert not (tmp_path / "c" / "summary.json").exists()
    Trainer(run("b", shared)).train()  # released: the run goes ahead
    assert (shared / "adapter_config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == [".adapter.lorafusion-run.lock", "adapter"]


def test_two_runs_starting_at_once_into_one_folder_do_not_both_start(
    make_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run A starts into its never-used folder while run B, whose job writes A's default job folder, takes
    its locks: B looks for other runs' locks only after its job folders', so it finds A's."""
    from contextlib import ExitStack

    from lorafusion_megatron import run_lock as module

    shared = tmp_path / "a" / "adapters" / "first"
    base = make_config(output_dir=str(tmp_path / "b"))
    config_b = base.model_copy(
        update={"jobs": [base.jobs[0].model_copy(update={"output_dir": str(shared)}), *base.jobs[1:]]}
    )
    real_locked = module._locked
    run_a = ExitStack()

    def locked_then_run_a_starts(folder: Path, name: str, what: str, **kwargs):
        lock = real_locked(folder, name, what, **kwargs)
        if name.startswith(".first"):
            run_a.enter_context(run_lock(tmp_path / "a"))  # A takes its run lock right then
        return lock

    monkeypatch.setattr(module, "_locked", locked_then_run_a_starts)
    in_use = r"the run folder holding job first's output folder, is in use"
    with run_a, pytest.raises(TrainerError, match=in_use), run_locks(config_b):
        pass


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_runs_unlocked_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """Lustre without ``-o flock`` answers ENOSYS, NFS without a lock daemon ENOLCK: train, and say so."""
    from lorafusion_megatron import run_lock as module

    def no_locks(descriptor: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(module.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING), run_lock(tmp_path / "run"):
        pass
    assert "does not lock files" in caplog.text
    assert os.strerror(code) in caplog.text


def test_other_lock_errors_are_not_taken_for_a_missing_lock_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error is a problem of its own, raised as it is."""
    from lorafusion_megatron import run_lock as module

    def failing(descriptor: int, operation: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(module.fcntl, "flock", failing)
    with pytest.raises(OSError, match="Input/output error"), run_lock(tmp_path / "run"):
        pass


def test_a_killed_runs_checkpoint_staging_is_removed_at_the_next_start(make_config, tmp_path: Path) -> None:
    """kill -9 while a checkpoint is written leaves its staging folder; the resumed run deletes it."""
    config = make_config(output_dir=str(tmp_path / "run"))
    Trainer(config, stop=StopAfter(2)).train()
    stale = config.checkpoint_dir / ".checkpoint-9.tmp-abc123"
    (stale / "adapters").mkdir(parents=True)
    Trainer(config).train(resume=True)
    assert not stale.exists()
    assert latest_checkpoint(config.checkpoint_dir) is not None


def test_resume_without_a_checkpoint(make_config) -> None:
    with pytest.raises(TrainerError, match="--resume: no checkpoint in"):
        Trainer(make_config()).train(resume=True)


def test_unwritable_output_folder(make_config, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(TrainerError, match=r"output_dir .*a-file/run cannot be written"):
        Trainer(make_config(output_dir=str(blocker / "run"))).train()


def test_unknown_target_module(make_config) -> None:
    config = make_config()
    jobs = [config.jobs[0].model_copy(update={"target_modules": ["q_proj", "qkv_proj"]}), config.jobs[1]]
    with pytest.raises(TrainerError, match=r"job first: target_modules \['qkv_proj'\] are not linear layers"):
        Trainer(config.model_copy(update={"jobs": jobs})).train()


def test_fused_and_plain_peft_runs_agree(make_config, tmp_path: Path) -> None:
    fused = make_config(output_dir=str(tmp_path / "fused"))
    plain = make_config(output_dir=str(tmp_path / "plain"), runtime={"device": "cpu", "fused_kernels": False})
    Trainer(fused).train()
    Trainer(plain).train()
    for name in ("first", "second"):
        a = _adapter_tensors(Path(fused.output_dir) / "adapters" / name)
        b = _adapter_tensors(Path(plain.output_dir) / "adapters" / name)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)


def test_fused_sibling_layers_agree_with_plain_peft(make_config, tmp_path: Path, caplog) -> None:
    """q/k/v and gate/up as one call per group (p = 0): the same adapters as plain PEFT."""
    targets = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    runs = {}
    for name, runtime in (
        ("siblings", {"device": "cpu", "fuse_sibling_layers": True}),
        ("plain", {"device": "cpu", "fused_kernels": False}),
    ):
        config = make_config(output_dir=str(tmp_path / name), runtime=runtime)
        jobs = [job.model_copy(update={"target_modules": targets}) for job in config.jobs]
        runs[name] = config.model_copy(update={"jobs": jobs})
    with caplog.at_level("INFO", logger="lorafusion_megatron.model"):
        Trainer(runs["siblings"]).train()
    assert any(
        "sibling LoRA layers fused: " in r.message and not r.message.endswith(" 0 groups") for r in caplog.records
    )
    Trainer(runs["plain"]).train()
    for job in ("first", "second"):
        a = _adapter_tensors(Path(runs["siblings"].output_dir) / "adapters" / job)
        b = _adapter_tensors(Path(runs["plain"].output_dir) / "adapters" / job)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.together
def test_tensorboard_scalars_per_job(make_config, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    config = make_config(logging={"tensorboard_dir": str(tmp_path / "tb"), "logging_steps": 1, "progress_bar": False})
    Trainer(config).train()
    for name in ("first", "second"):
        assert list((tmp_path / "tb" / name).glob("events.out.tfevents.*"))


@pytest.mark.together
def test_tensorboard_gets_each_jobs_last_step_whatever_the_interval(tmp_path: Path) -> None:
    """With logging_steps 3, a job of 4 steps got step 3 only; with 1000, none (the docs say: and its last step)."""
    pytest.importorskip("tensorboard")
    from lorafusion_megatron.optim import StepStats
    from lorafusion_megatron.reporting import TensorBoardLogger
    from lorafusion_megatron.state import JobProgress

    logger = TensorBoardLogger(str(tmp_path / "tb"), interval=3)
    written: list[int] = []

    class Recorder:
        def add_scalar(self, tag: str, value: float, step: int) -> None:
            if tag == "train/loss":
                written.append(step)

    logger._writer = lambda job: Recorder()  # type: ignore[method-assign]
    job = JobProgress(name="first", total_steps=4, last_loss=1.0)
    for step in range(1, 5):
        logger.log_step(job, StepStats(step=step, learning_rate=1e-3, grad_norm=1.0), seconds=1.0)
    assert written == [3, 4]


def test_the_host_reads_results_back_only_once_more_work_is_queued(make_config, monkeypatch, caplog) -> None:
    """Neither a microbatch's losses nor a step's gradient norm is read before the next microbatch is
    queued (on a GPU each read waits for the device), steps included; the last ones at the end."""
    from lorafusion_megatron import optim, runner

    queued = 0
    reads: list[tuple[str, int, int]] = []  # (what, microbatches queued once it was made, when it was read)
    forward_backward, get, step = (
        runner.MicrobatchRunner.forward_backward,
        runner.PendingResults.get,
        optim.AdapterOptimizer.step,
    )

    def counting_forward_backward(self, *args, **kwargs):
        nonlocal queued
        pending = forward_backward(self, *args, **kwargs)
        queued += 1
        pending.made_at = queued
        return pending

    def recording_get(self):
        reads.append(("losses", self.made_at, queued))
        return get(self)

    def recording_step(self):
        made_at = queued
        result = step(self)
        stats = result.stats

        def recording_stats():
            reads.append(("norm", made_at, queued))
            return stats()

        object.__setattr__(result, "stats", recording_stats)
        return result

    monkeypatch.setattr(runner.MicrobatchRunner, "forward_backward", counting_forward_backward)
    monkeypatch.setattr(runner.PendingResults, "get", recording_get)
    monkeypatch.setattr(optim.AdapterOptimizer, "step", recording_step)
    caplog.set_level("INFO", logger="lorafusion_megatron.trainer")
    result = Trainer(make_config(logging={"logging_steps": 1, "progress_bar": False})).train()

    total = result.state.position
    assert sum(1 for what, _, _ in reads if what == "norm") == result.state.total_optimizer_steps == 8
    assert sum(1 for what, _, _ in reads if what == "losses") == total
    early = [(what, made, read) for what, made, read in reads if read <= made and read < total]
    assert early == [], "read back before the next microbatch was queued"
    # Every step was logged, in order, with its global batch's loss.
    logged = [r.getMessage().split()[:2] for r in caplog.records if " loss " in r.getMessage()]
    assert [name for name, _ in logged].count("first") == 5
    assert [step for name, step in logged if name == "second"] == ["1/3", "2/3", "3/3"]


def test_the_run_clock_starts_after_the_start_up_collection(make_config, monkeypatch) -> None:
    """``seconds`` (and so the reported tokens/s) counts the plan's execution, not the full garbage
    collection that freezes the start-up objects (0.1-0.4 s: a tenth of a short benchmark run)."""
    import contextlib

    from lorafusion_megatron import trainer

    clock = {"now": 0.0}
    real_perf_counter = trainer.time.perf_counter
    frozen = trainer.start_up_objects_frozen

    @contextlib.contextmanager
    def slow_freeze():
        clock["now"] += 1000.0  # a collection that takes 1000 s of the fake clock
        with frozen():
            yield

    monkeypatch.setattr(trainer.time, "perf_counter", lambda: real_perf_counter() + clock["now"])
    monkeypatch.setattr(trainer, "start_up_objects_frozen", slow_freeze)
    result = Trainer(make_config()).train()
    assert 0.0 < result.state.seconds < 1000.0


def test_the_single_process_trainer_refuses_a_pipeline_checkpoint(tmp_path: Path) -> None:
    """Resuming a pipeline run without its --pipeline-stages: an error that says so, not a missing file."""
    from lorafusion_megatron.checkpoint import RunFingerprint, load_checkpoint

    folder = tmp_path / "checkpoint-8"
    folder.mkdir()
    state = {"fingerprint": "f", "format": "pipeline-1", "parallel": {"pipeline_stages": 2}}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(TrainerError, match=r"written by a pipeline run .* resume it with the same --pipeline-stages"):
        load_checkpoint(folder, fingerprint=RunFingerprint("f", {}), adapter_parameters={}, optimizers={})


def test_fingerprints_compare_config_then_data(tmp_path: Path) -> None:
    """Same config, other samples under the same path: named as data. A checkpoint of an older
    version (config part only) is checked on that part."""
    from lorafusion_megatron.checkpoint import RunFingerprint, read_checkpoint_meta

    folder = tmp_path / "checkpoint-8"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "cfg/data-a"}))
    with pytest.raises(TrainerError, match="was written for other data: a dataset of this config holds other"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("cfg/data-b", {}))
    with pytest.raises(TrainerError, match="different config"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("cfg2/data-a", {}))
    assert read_checkpoint_meta(folder, fingerprint=RunFingerprint("cfg/data-a", {}))
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "cfg"}))
    assert read_checkpoint_meta(folder, fingerprint=RunFingerprint("cfg/data-b", {}))


def test_a_moved_dataset_with_the_same_content_resumes_and_other_content_names_its_job(tmp_path: Path) -> None:
    """A project copied elsewhere changes the datasets' absolute paths only: the data's hash decides."""
    from lorafusion_megatron.checkpoint import RunFingerprint, read_checkpoint_meta

    folder = tmp_path / "checkpoint-8"
    folder.mkdir()

    def config(root: str, r: int = 8) -> dict:
        return {"jobs": [{"name": n, "r": r, "dataset": {"path": f"{root}/{n}.jsonl"}} for n in ("a", "b")]}

    stored = {"fingerprint": "old/data-1", "config": config("/x"), "data_by_job": {"a": "ha", "b": "hb"}}
    (folder / "trainer_state.json").write_text(json.dumps(stored))
    moved = {"a": "ha", "b": "hb"}
    assert read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data-1", config("/y"), moved))
    assert read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/", config("/y")))  # data read later
    with pytest.raises(TrainerError, match="other data: the dataset of job 'b' holds other samples"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data-2", config("/y"), {"a": "ha", "b": "hc"}))
    with pytest.raises(TrainerError, match=r"jobs\[a\]\.r: 8 -> 4"):  # more than the paths changed
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data-1", config("/y", r=4), moved))
    del stored["fingerprint"]
    (folder / "trainer_state.json").write_text(json.dumps({**stored, "fingerprint": "old"}))  # no data hash
    with pytest.raises(TrainerError, match=r"different config \(changed: jobs\[a\]\.dataset\.path"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data-1", config("/y"), moved))


def test_a_refused_resume_names_the_changed_keys_when_the_checkpoint_stores_its_config(tmp_path: Path) -> None:
    """Five changes are named, the rest counted; a checkpoint without its config gets the general message."""
    from lorafusion_megatron.checkpoint import RunFingerprint, read_checkpoint_meta

    folder = tmp_path / "checkpoint-8"
    folder.mkdir()
    old = {"scheduler": {"capacity": 4096}, "jobs": [{"name": "sum", "r": 16, "lora_alpha": 32}]}
    new = {"scheduler": {"capacity": 8192}, "jobs": [{"name": "sum", "r": 32, "lora_alpha": 32}]}
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "old/data", "config": old}))
    with pytest.raises(TrainerError) as refused:
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data", new))
    assert "different config (changed: scheduler.capacity: 4096 -> 8192; jobs[sum].r: 16 -> 32)" in str(refused.value)
    many = {"scheduler": {f"key{i}": i for i in range(7)}}
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "old/data", "config": {"scheduler": {}}}))
    with pytest.raises(TrainerError, match=r"scheduler\.key4: \(absent\) -> 4; and 2 more\)"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data", many))
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "old/data"}))
    with pytest.raises(TrainerError, match=r"different config \(model, jobs, data, scheduler or runtime settings"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new/data", new))


def test_a_resume_after_the_data_changed_is_refused(make_config, tmp_path: Path) -> None:
    """Same path, same lengths, other text: the config's fingerprint cannot see it, the data's does."""
    config = make_config(output_dir=str(tmp_path / "run"))
    Trainer(config, stop=StopAfter(2)).train()
    path = tmp_path / "data" / "first.jsonl"
    path.write_text(path.read_text().upper().replace('"PROMPT"', '"prompt"').replace('"RESPONSE"', '"response"'))
    with pytest.raises(TrainerError, match="was written for other data"):
        Trainer(config).train(resume=True)


def test_a_profile_written_after_the_checkpoint_is_named(tmp_path: Path) -> None:
    """``profile`` after a run changes an ``auto`` capacity: the refusal says so, not just "different config"."""
    from lorafusion_megatron.checkpoint import RunFingerprint, read_checkpoint_meta

    folder = tmp_path / "run" / "checkpoints" / "checkpoint-8"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": "old"}))
    with pytest.raises(TrainerError) as plain:
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new", {}))
    assert "profile.json" not in str(plain.value)
    profile = tmp_path / "run" / "profile.json"
    profile.write_text("{}")
    state_time = (folder / "trainer_state.json").stat().st_mtime
    os.utime(profile, (state_time + 10, state_time + 10))
    with pytest.raises(TrainerError, match=r"profile\.json was written after this checkpoint"):
        read_checkpoint_meta(folder, fingerprint=RunFingerprint("new", {}))
