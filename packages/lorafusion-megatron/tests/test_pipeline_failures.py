"""A failing pipeline rank: the launcher names the rank that failed first, not a peer that failed after it.

The choice of the cause from what the ranks wrote down and how their processes ended (cheap), and
one real 2-process run over gloo in which rank 1 fails in its first forward and its neighbour,
failing on losing it, exits first (about 10 s on 2 cores); a slow one in which rank 1 hangs and
the collective timeout ends the run.
"""

from __future__ import annotations

import multiprocessing
import re
import signal
import time
from pathlib import Path

import pytest

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.failures import (
    RankExit,
    RankFailure,
    first_failure,
    note_failure,
    record_failures_in,
    supervise,
)
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.testing import (
    INJECTED_FAILURE,
    run_rank_failing_in_first_forward,
    run_rank_hanging_in_first_forward,
    run_rank_hanging_while_reading_data,
    two_job_config,
)

_CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:949"


def _failure(rank: int, seconds: float, error: str, *, user_error: bool = False) -> RankFailure:
    message = error.partition(": ")[2]
    return RankFailure(
        rank=rank,
        stage=rank,
        replica=0,
        seconds=seconds,
        error=error,
        message=message,
        traceback=f"Traceback (most recent call last):\n  File 'engine.py', line 1, in _run\n{error}\n",
        user_error=user_error,
    )


def test_the_error_written_down_first_is_the_cause_when_a_peer_exited_first() -> None:
    exits = [RankExit(0, 1), RankExit(1, 1)]  # rank 0's process ended first
    failures = {0: _failure(0, 2.0, _CLOSED), 1: _failure(1, 1.0, "ValueError: a bad sample")}
    message = first_failure(exits, failures)
    assert message.startswith("pipeline rank 1 (stage 1, replica 0) failed, and the run stopped:\nTraceback")
    assert "\nValueError: a bad sample\n" in message
    assert message.endswith(f"the other ranks stopped after it (rank 0: {_CLOSED})")


def test_a_rank_killed_by_a_signal_is_the_cause_over_its_peers_errors() -> None:
    exits = [RankExit(0, 1), RankExit(1, -9)]
    message = first_failure(exits, {0: _failure(0, 1.0, _CLOSED)}, killed=[2], grace_seconds=5)
    assert message.startswith("pipeline rank 1 was killed by SIGKILL (the kernel's out-of-memory killer")
    assert "`train ... --resume` continues from the newest one, if any" in message
    assert message.endswith(f"(rank 0: {_CLOSED}; rank 2: killed, still running 5 s later)")


def test_a_user_error_that_every_rank_raised_is_its_message_alone() -> None:
    refusal = "TrainerError: checkpoint c was written with parallel settings {}: resume with the same stages"
    failures = {rank: _failure(rank, 1.0 + rank, refusal, user_error=True) for rank in range(2)}
    assert first_failure([RankExit(1, 1), RankExit(0, 1)], failures) == refusal.partition(": ")[2]
    failures[1] = _failure(1, 0.5, "TrainerError: dataset d: no such file", user_error=True)
    assert first_failure([RankExit(1, 1), RankExit(0, 1)], failures).startswith(
        "pipeline rank 1 (stage 1, replica 0): dataset d: no such file\nthe other ranks stopped after it (rank 0: "
    )


def test_a_rank_that_failed_outside_its_process_groups_shows_the_spawned_traceback() -> None:
    message = first_failure([RankExit(1, 1, "Traceback ...\nImportError: no module x\n")], {})
    assert message == "pipeline rank 1 exited with status 1:\nTraceback ...\nImportError: no module x"


def _fail_then_block(folder: Path) -> None:
    """A rank that writes its error down and then never exits (as a failed NCCL rank in its teardown)."""
    record_failures_in(folder)
    note_failure(RuntimeError(INJECTED_FAILURE), rank=1, stage=1, replica=0)
    time.sleep(120)


def test_a_failure_written_down_stops_ranks_that_never_exit(tmp_path: Path) -> None:
    """No rank exits: the written-down failure starts the grace period, then both ranks are killed."""
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=time.sleep, args=(120,), daemon=True),
        context.Process(target=_fail_then_block, args=(tmp_path,), daemon=True),
    ]
    for process in processes:
        process.start()
    started = time.monotonic()
    with pytest.raises(TrainerError) as caught:
        supervise(processes, tmp_path, grace_seconds=0.5)
    assert time.monotonic() - started < 10
    assert all(process.exitcode == -signal.SIGKILL for process in processes)
    message = str(caught.value)
    assert message.startswith("pipeline rank 1 (stage 1, replica 0) failed, and the run stopped:\n"), message
    assert message.endswith("the other ranks stopped after it (rank 0: killed, still running 0.5 s later)"), message


def _launch_two_stages(
    base: Path, folder: Path, monkeypatch: pytest.MonkeyPatch, rank_entry: object, backend: str, **parallel: int
) -> tuple[str, float, Path]:
    """A 2-stage run of the two-job config whose ranks start in ``rank_entry``; its error, seconds and output."""
    from lorafusion_megatron.pipeline import worker
    from lorafusion_megatron.pipeline.launch import launch

    monkeypatch.setattr(worker, "run_rank", rank_entry)
    config = parse_config(two_job_config(base, folder / "run", capacity=64))
    if backend == "nccl":
        config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"device": "cuda"})})
    started = time.monotonic()
    with pytest.raises(TrainerError) as caught:
        launch(config, ParallelConfig(pipeline_stages=2, **parallel), backend=backend)
    return str(caught.value), time.monotonic() - started, Path(config.output_dir)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.multigpu(gpus=2))])
def test_a_failing_rank_is_named_once_and_the_run_stops(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """2 stages: rank 1 raises in its first forward; rank 0, failing on losing it or blocked on it, is stopped.

    Over NCCL a rank blocked on a dead peer would wait for the collective timeout (30 minutes); the
    launcher kills it after :data:`~lorafusion_megatron.pipeline.failures.FAILURE_GRACE_SECONDS`.
    """
    from lorafusion_megatron.run_lock import run_lock

    message, seconds, output = _launch_two_stages(
        tiny_base, tmp_path, monkeypatch, run_rank_failing_in_first_forward, backend
    )
    assert seconds < 120
    assert message.startswith("pipeline rank 1 (stage 1, replica 0) failed, and the run stopped:\n"), message
    assert message.count(INJECTED_FAILURE) == 1, message
    assert f"\nRuntimeError: {INJECTED_FAILURE}\nthe other ranks stopped after it (rank 0: " in message, message
    with run_lock(output):  # released
        pass


HANGS = {
    "first-forward": (run_rank_hanging_in_first_forward, "the forward of microbatch 0"),
    "reading-data": (run_rank_hanging_while_reading_data, "reading the jobs' data"),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "where"),
    [
        ("gloo", "first-forward"),
        ("gloo", "reading-data"),
        pytest.param("nccl", "first-forward", marks=pytest.mark.multigpu(gpus=2)),
        pytest.param("nccl", "reading-data", marks=pytest.mark.multigpu(gpus=2)),
    ],
)
def test_a_hanging_rank_is_stopped_and_named_before_its_neighbour_times_out(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, where: str
) -> None:
    """2 stages, ``collective_timeout_minutes: 1``: rank 1 sleeps in its first forward, or while reading the data.

    Its stall watchdog ends it after 54 s (0.9 of the timeout), before rank 0's wait for it times out
    at 60 s (66 s for the watchdog of rank 0, waiting), so the launcher names rank 1, with what it
    was doing and the line where it sleeps.
    """
    entry, doing = HANGS[where]
    message, seconds, _ = _launch_two_stages(
        tiny_base, tmp_path, monkeypatch, entry, backend, collective_timeout_minutes=1
    )
    assert 54 < seconds < 120, (seconds, message)
    assert message.startswith("pipeline rank 1 (stage 1, replica 0) failed, and the run stopped:\n"), message
    stalled = rf"RankStalledError: rank 1 \(stage 1, replica 0\) spent 5[45] s on {re.escape(doing)} "
    assert re.search(stalled, message), message
    assert ", in hang\n    time.sleep(3600)" in message, message


def test_many_other_ranks_are_counted_not_listed() -> None:
    """64 CPU ranks killed by the kernel gave one line of about 6 kB naming all 63 others."""
    exits = [RankExit(5, -signal.SIGKILL)]
    failures = {rank: _failure(rank, 2.0, _CLOSED) for rank in (7, 9)}
    killed = [rank for rank in range(64) if rank not in (5, 7, 9)]
    message = first_failure(exits, failures, killed, grace_seconds=5)
    assert message.startswith("pipeline rank 5 was killed by SIGKILL (the kernel's out-of-memory killer")
    others = message.partition("\nthe other ranks stopped after it (")[2]
    assert others == (
        f"rank 7: {_CLOSED}; rank 9: {_CLOSED}; rank 0: killed, still running 5 s later; "
        "and 60 other ranks: 60 killed, still running 5 s later)"
    )
    assert len(message) < 1000


def test_more_cpu_ranks_than_cores_are_warned_about_before_they_start(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """64 gloo ranks started on a 2-core host without a word, then the kernel killed them for memory."""
    import importlib

    from lorafusion_megatron.pipeline import launch as launch_module

    class NotStartedError(Exception):
        pass

    def not_started(*args: object, **kwargs: object) -> None:
        raise NotStartedError

    monkeypatch.setattr(launch_module, "cpu_cores", lambda: 1)
    # The module, not the function torch.multiprocessing exports under the same name.
    monkeypatch.setattr(importlib.import_module("torch.multiprocessing.spawn"), "spawn", not_started)
    config = parse_config(two_job_config(tiny_base, tmp_path / "run", capacity=64))
    with caplog.at_level("WARNING", logger="lorafusion_megatron"), pytest.raises(NotStartedError):
        launch_module.launch(config, ParallelConfig(pipeline_stages=2), backend="gloo")
    said = " ".join(caplog.text.split())
    assert "2 processes (2 stages x 1 replicas) on 1 CPU core(s): the ranks share the cores" in said
    assert "to train, use at most 1 processes (--pipeline-stages x --data-parallel)" in said
    assert not (tmp_path / "run").exists(), "a launch that failed before writing left no run folder"
