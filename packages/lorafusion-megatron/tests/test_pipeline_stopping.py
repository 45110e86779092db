"""Ctrl-C in pipeline mode: the ranks agree where to stop, drain, write a checkpoint, and a resume ends the same.

One rank in this process, signalled at a chosen optimizer step (cheap, deterministic), and the
real thing: ``lorafusion-megatron train --pipeline-stages 2`` in its own process group, which
gets SIGINT as a terminal's Ctrl-C sends it (to the launcher and both ranks at once).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from lorafusion_megatron.config import TrainerConfig, parse_config
from lorafusion_megatron.pipeline.commands import report
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.testing import assert_same_adapters, saved_adapters, two_job_config


def _config_dict(tiny_base: Path, output: Path) -> dict[str, Any]:
    """Two jobs, capacity 64: a dozen microbatches and several steps per job."""
    return two_job_config(tiny_base, output, lora_dropout=0.1, capacity=64)


def _run_one_rank(config: TrainerConfig, store: Path, *, resume: bool = False) -> dict[str, Any]:
    from lorafusion_megatron.pipeline.worker import run_rank

    summary = run_rank(
        config, ParallelConfig(), resume=resume, backend="gloo", init_method=store.as_uri(), rank=0, world_size=1
    )
    assert summary is not None
    return summary


def _stop_at_step(monkeypatch: pytest.MonkeyPatch, signum: signal.Signals, when: int) -> None:
    """Send this process ``signum`` (a real signal, as Ctrl-C or a job scheduler sends) in optimizer step ``when``."""
    from lorafusion_megatron.pipeline.optim import StageOptimizer

    begin_step = StageOptimizer.begin_step
    taken = [0]

    def step_then_signal(self: StageOptimizer) -> Any:
        taken[0] += 1
        if taken[0] == when:
            os.kill(os.getpid(), signum)
        return begin_step(self)

    monkeypatch.setattr(StageOptimizer, "begin_step", step_then_signal)


def _check_stopped(summary: dict[str, Any], config: TrainerConfig, steps: int) -> None:
    assert summary["checkpoint"] is not None
    assert Path(summary["checkpoint"]).name == f"checkpoint-{steps}"
    assert 0 < summary["position"] < summary["num_microbatches"]
    assert summary["run_state"]["total_optimizer_steps"] == steps
    assert summary["adapters"] == {}
    assert not list(Path(config.output_dir).glob("adapters/*/adapter_model.safetensors"))


def test_ctrl_c_at_a_step_writes_a_checkpoint_and_resume_ends_bit_identical(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = parse_config(_config_dict(tiny_base, tmp_path / "straight"))
    finished = _run_one_rank(straight, tmp_path / "store-straight")
    assert finished["checkpoint"] is None
    assert finished["position"] == finished["num_microbatches"]

    config = parse_config(_config_dict(tiny_base, tmp_path / "stopped"))
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with monkeypatch.context() as patch:
        _stop_at_step(patch, signal.SIGINT, 3)
        _check_stopped(_run_one_rank(config, tmp_path / "store-stopped"), config, 3)
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # restored

    resumed = _run_one_rank(config, tmp_path / "store-resumed", resume=True)
    assert resumed["checkpoint"] is None
    assert resumed["run_state"]["total_optimizer_steps"] == finished["run_state"]["total_optimizer_steps"]
    assert resumed["run_state"]["jobs"][0]["first_loss"] == finished["run_state"]["jobs"][0]["first_loss"]
    assert_same_adapters(saved_adapters(config), saved_adapters(straight))


def test_a_fresh_run_refuses_the_checkpoints_of_a_stopped_one(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorafusion_megatron.errors import TrainerError

    config = parse_config(_config_dict(tiny_base, tmp_path / "stopped"))
    with monkeypatch.context() as patch:
        _stop_at_step(patch, signal.SIGINT, 1)
        _run_one_rank(config, tmp_path / "store-stopped")
    with pytest.raises(TrainerError, match="holds checkpoints of an earlier run: continue it with --resume"):
        _run_one_rank(config, tmp_path / "store-fresh")


def test_sigterm_stops_the_same_way(tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config(_config_dict(tiny_base, tmp_path / "stopped"))
    _stop_at_step(monkeypatch, signal.SIGTERM, 2)
    _check_stopped(_run_one_rank(config, tmp_path / "store"), config, 2)


def test_a_ctrl_c_while_the_adapters_are_written_lets_every_one_be_written(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank takes every signal as the one stop request, which comes too late here: no adapter is left out."""
    import lorafusion_megatron.pipeline.adapters as adapters_module

    write_adapter = adapters_module.write_adapter

    def ctrl_c_then_write(model: Any, adapter: str, tensors: Any, directory: Path) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # before each job's write: the first, and repeats
        write_adapter(model, adapter, tensors, directory)

    monkeypatch.setattr(adapters_module, "write_adapter", ctrl_c_then_write)
    config = parse_config(_config_dict(tiny_base, tmp_path / "run"))
    summary = _run_one_rank(config, tmp_path / "store")
    assert summary["checkpoint"] is None
    assert summary["position"] == summary["num_microbatches"]
    assert sorted(saved_adapters(config)) == ["first", "second"]
    # The local launcher adds the signal it passed on (stopped_by): the CLI says the run is complete
    # and exits as the single-process trainer does, 128 + the signal.
    console = Console(record=True, width=200)
    assert report(summary, Path(config.output_dir), console) == 0
    assert "came as the run ended" not in console.export_text()
    assert report({**summary, "stopped_by": "SIGINT"}, Path(config.output_dir), console) == 130
    assert (
        "SIGINT came as the run ended: every job's adapter and pipeline_summary.json were written first, so the "
        "run is complete (nothing to resume)" in console.export_text()
    )


def test_the_launcher_remembers_the_first_signal_it_passed_on() -> None:
    """The first SIGINT/SIGTERM goes on to the ranks and is remembered; a second aborts."""
    from lorafusion_megatron.interrupts import Interrupted
    from lorafusion_megatron.pipeline.launch import _SignalForwarder

    forwarder = _SignalForwarder([])
    forwarder._handle(signal.SIGTERM, None)
    assert forwarder.first == signal.SIGTERM
    with pytest.raises(Interrupted):
        forwarder._handle(signal.SIGINT, None)
    assert forwarder.first == signal.SIGTERM


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "replicas"), [(2, 1), (1, 2)], ids=["2-stages", "2-replicas"])
def test_ctrl_c_on_two_processes_checkpoints_and_resume_ends_bit_identical(
    tiny_base: Path, tmp_path: Path, stages: int, replicas: int
) -> None:
    """The CLI on 2 processes over gloo, interrupted by a terminal's Ctrl-C, then resumed (about 60 s each)."""
    from lorafusion_megatron.pipeline.launch import launch

    parallel = ParallelConfig(pipeline_stages=stages, data_parallel=replicas)
    straight = parse_config(_config_dict(tiny_base, tmp_path / "straight"))
    launch(straight, parallel, backend="gloo")

    raw = _config_dict(tiny_base, tmp_path / "stopped")
    config_file = tmp_path / "stopped.yaml"
    config_file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    output = Path(raw["output_dir"])
    command = [sys.executable, "-m", "lorafusion_megatron.cli", "train", str(config_file)]
    command += ["--pipeline-stages", str(stages), "--data-parallel", str(replicas)]
    env = {**os.environ, "COLUMNS": "200"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    # Rank 0 writes the plan once every rank runs (and has its handlers): then press Ctrl-C.
    deadline = time.monotonic() + 120
    while not (output / "plan.json").exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the run never wrote its plan"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal does: the launcher and both ranks get it
    log, _ = process.communicate(timeout=240)
    (tmp_path / "stopped.log").write_text(log, encoding="utf-8")
    assert process.returncode == 1, log
    assert "Stopped at microbatch" in log, log
    summary = json.loads((output / "pipeline_summary.json").read_text())
    assert 0 < summary["position"] < summary["num_microbatches"]
    assert not list(output.glob("adapters/*/adapter_model.safetensors"))
    checkpoint = Path(summary["checkpoint"])
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "plan.json",
        "rank-00000.pt",
        "rank-00001.pt",
        "trainer_state.json",
    ]

    launch(parse_config(raw), parallel, backend="gloo", resume=True)
    assert_same_adapters(saved_adapters(output / "adapters"), saved_adapters(straight))
