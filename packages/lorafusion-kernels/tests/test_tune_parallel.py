"""``lorafusion-tune --gpus N``: jobs, their queue over GPUs, and one file from their outputs (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch

import lorafusion_kernels.tuning.cli as cli
import lorafusion_kernels.tuning.tune as tune
from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning import ConfigFile, KernelTable, ShapeKey, TunedEntry
from lorafusion_kernels.tuning.agreement import ShapeTimings, timings_from_json, timings_to_json
from lorafusion_kernels.tuning.config import dumps
from lorafusion_kernels.tuning.parallel import (
    TuneJob,
    job_dir,
    layer_jobs,
    points_done,
    read_job_results,
    run_jobs,
    subprocess_runner,
    visible_gpus,
)
from lorafusion_kernels.tuning.search_space import CANDIDATES
from lorafusion_kernels.tuning.tune import SweepPlan, sweep_text, tune_on_gpus

GEMM_A, GEMM_B, GEMM_C = CANDIDATES["xw_sb"][:3]
PLAN = SweepPlan(models=["llama-3.1-8b"], ms=[8192], ranks=[16, 128], kernels=["xw_sb"])


def test_one_job_per_distinct_shape_largest_first():
    jobs = layer_jobs(["llama-3.1-8b", "llama-3.1-70b"], ["o", "gate_up"])
    assert [(job.name, job.n, job.k) for job in jobs] == [
        ("llama-3.1-70b-gate_up", 28672, 8192),
        ("llama-3.1-70b-o", 8192, 8192),
        ("llama-3.1-8b-gate_up", 14336, 4096),
        ("llama-3.1-8b-o", 4096, 4096),
    ]
    assert len(layer_jobs(["llama-3.1-8b"])) == 4


def test_a_job_passes_the_plan_to_its_process_unchanged():
    plan = dataclasses.replace(PLAN, kernels=["xa", "multi_xw_sb"], adapters=3, p=0.05, rep=12, rounds=4)
    job = layer_jobs(plan.models, ["down"])[0]
    args = cli._parser().parse_args([*plan.argv(), *job.argv])
    assert cli._plan(args) == dataclasses.replace(plan, models=[job.model], layers=[job.layer])


def test_each_gpu_runs_one_job_at_a_time_and_every_job_runs_once():
    jobs = layer_jobs(["llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b"])
    running: dict[str, int] = {"0": 0, "1": 0, "2": 0}
    ran: list[tuple[TuneJob, str]] = []
    lock = threading.Lock()

    def run(job: TuneJob, gpu: str, limit: float | None) -> bool:
        with lock:
            running[gpu] += 1
            assert running[gpu] == 1, f"gpu {gpu} runs two jobs at once"
            ran.append((job, gpu))
        time.sleep(0.005)
        with lock:
            running[gpu] -= 1
        return job.layer != "o"

    outcome = run_jobs(jobs, ["0", "1", "2"], run)
    assert sorted(job.name for job, _ in ran) == sorted(job.name for job in jobs)
    assert {gpu for _, gpu in ran} == {"0", "1", "2"}
    assert [job.layer for job in outcome.failed] == ["o", "o", "o"]
    assert len(outcome.succeeded) == len(jobs) - 3
    assert outcome.skipped == ()


def test_no_job_starts_after_the_time_limit_and_each_gets_the_time_left():
    now = [0.0]
    limits: list[float | None] = []

    def run(job: TuneJob, gpu: str, limit: float | None) -> bool:
        limits.append(limit)
        now[0] += 40.0  # each job takes 40 s
        return True

    jobs = layer_jobs(["llama-3.1-8b"])
    outcome = run_jobs(jobs, ["0"], run, time_limit_s=100.0, clock=lambda: now[0])
    assert limits == [100.0, 60.0, 20.0]
    assert [job.name for job in outcome.skipped] == [jobs[3].name]


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,6")
    assert visible_gpus(2) == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(3) == ["0", "1", "2"]


def _key(n: int, k: int, r: int = 16) -> ShapeKey:
    return ShapeKey(m=8192, n=n, k=k, r=r, dtype="bfloat16")


def _job_file(entries: list[TunedEntry], sweep: str = "models=x", device_key: str = "nvidia_h200") -> ConfigFile:
    return ConfigFile(
        device_name="NVIDIA H200",
        device_key=device_key,
        capability=(9, 0),
        provenance={
            **dict.fromkeys(("torch", "triton", "lorafusion_kernels", "search_space"), "x"),
            "date": "2026-11-26",
            "sweep": sweep,
        },
        kernels={"xw_sb": KernelTable(default=entries[0].config, entries=tuple(entries))},
    )


def _write_job(workdir: Path, job: TuneJob, config_file: ConfigFile, timings: list[ShapeTimings]) -> None:
    out = job_dir(workdir, job)
    out.mkdir(parents=True)
    (out / f"{config_file.device_key}.json").write_text(dumps(config_file))
    (out / "timings.json").write_text(json.dumps(timings_to_json(timings, config_file.provenance)))


def test_job_results_keep_the_first_job_of_a_key_with_its_timings(tmp_path):
    big, small = layer_jobs(["llama-3.1-8b"], ["gate_up", "o"])
    shared = _key(1, 1)
    big_entries = [TunedEntry(key=shared, config=GEMM_A, ms=1), TunedEntry(key=_key(14336, 4096), config=GEMM_A, ms=2)]
    small_entries = [TunedEntry(key=shared, config=GEMM_B, ms=1), TunedEntry(key=_key(4096, 4096), config=GEMM_B, ms=1)]
    big_timings = [
        ShapeTimings("xw_sb", shared, {GEMM_A: 1.0, GEMM_B: 1.1}, 1.0),
        ShapeTimings("xw_sb", _key(14336, 4096), {GEMM_A: 2.0, GEMM_B: 3.0}, 2.5),
    ]
    small_timings = [
        ShapeTimings("xw_sb", shared, {GEMM_A: 0.95, GEMM_B: 0.9}, 0.9),
        ShapeTimings("xw_sb", _key(4096, 4096), {GEMM_A: 1.2, GEMM_B: 1.0}, 1.1),
    ]
    _write_job(tmp_path, big, _job_file(big_entries), big_timings)
    _write_job(tmp_path, small, _job_file(small_entries), small_timings)
    results = read_job_results(tmp_path, [big, small])
    assert [(e.key, e.config) for e in results.entries["xw_sb"]] == [
        (shared, GEMM_A),
        (_key(14336, 4096), GEMM_A),
        (_key(4096, 4096), GEMM_B),
    ]
    assert results.timings == (big_timings[0], big_timings[1], small_timings[1])


def test_jobs_on_different_gpus_or_none_written_are_refused(tmp_path):
    big, small = layer_jobs(["llama-3.1-8b"], ["gate_up", "o"])
    with pytest.raises(LoRAFusionKernelsError, match="no tuning job wrote a config file"):
        read_job_results(tmp_path, [big, small])
    _write_job(tmp_path, big, _job_file([TunedEntry(key=_key(1, 1), config=GEMM_A, ms=1.0)]), [])
    other_gpu = _job_file([TunedEntry(key=_key(2, 2), config=GEMM_A, ms=1.0)], device_key="nvidia_h100_80gb_hbm3")
    _write_job(tmp_path, small, other_gpu, [])
    with pytest.raises(LoRAFusionKernelsError, match="jobs ran on different GPUs"):
        read_job_results(tmp_path, [big, small])


def test_points_done_reads_a_cut_jobs_provenance():
    entry = TunedEntry(key=_key(1, 1), config=GEMM_A, ms=1.0)
    assert points_done(_job_file([entry], sweep="models=x m=8192 (time limit: 1 of 2 shapes)"), 2) == 1
    assert points_done(_job_file([entry], sweep="models=x m=8192"), 2) == 2


def test_one_file_from_every_gpus_jobs_with_defaults_over_all_winners(tmp_path, monkeypatch):
    """Three shapes win with C, one with A: the file's default is C, as one process's sweep would give."""
    winners = {"gate_up": GEMM_C, "down": GEMM_C, "qkv": GEMM_C, "o": GEMM_A}

    def fake_runner(common_argv, workdir, say):
        assert common_argv == PLAN.argv()

        def run(job: TuneJob, gpu: str, limit: float | None) -> bool:
            if job.layer == "qkv":
                return False
            sweep = "models=x (time limit: 1 of 2 shapes)" if job.layer == "down" else "models=x"
            entry = TunedEntry(key=_key(job.n, job.k), config=winners[job.layer], ms=1.0)
            _write_job(workdir, job, _job_file([entry], sweep=sweep), [])
            return True

        return run

    monkeypatch.setattr(tune, "subprocess_runner", fake_runner)
    config_file, timings, outcome = tune_on_gpus(PLAN, ["0", "1"], tmp_path)
    assert [job.layer for job in outcome.failed] == ["qkv"]
    table = config_file.kernels["xw_sb"]
    assert table.default == GEMM_C
    assert {e.key.n for e in table.entries} == {14336, 4096}
    assert config_file.device_key == "nvidia_h200"
    # 4 jobs x 2 (m, r) points: gate_up and o did both, down one, qkv none.
    assert config_file.provenance["sweep"] == sweep_text(PLAN, done=5, total=8, gpus=2)
    assert config_file.provenance["sweep"].endswith("gpus=2 (time limit: 5 of 8 shapes)")
    assert timings == ()


def test_timings_of_the_jobs_read_back_as_written(tmp_path):
    job = layer_jobs(["llama-3.1-8b"], ["o"])[0]
    row = ShapeTimings("xw_sb", _key(4096, 4096), {GEMM_A: 1.5, GEMM_B: float("inf")}, 1.4)
    _write_job(tmp_path, job, _job_file([TunedEntry(key=row.key, config=GEMM_A, ms=1.5)]), [row])
    written = json.loads((job_dir(tmp_path, job) / "timings.json").read_text())
    assert timings_from_json(written) == [row]
    assert read_job_results(tmp_path, [job]).timings == (row,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU the job's process exits at once")
def test_a_job_runs_as_its_own_process_on_its_gpu_and_a_failure_shows_its_log(tmp_path):
    said: list[str] = []
    job = layer_jobs(["llama-3.1-8b"], ["o"])[0]
    run = subprocess_runner(PLAN.argv(), tmp_path, said.append)
    assert run(job, "7", 30.0) is False
    log = (job_dir(tmp_path, job) / "tune.log").read_text()
    assert "lorafusion-tune needs a CUDA GPU" in log
    assert said[0] == "gpu 7: llama-3.1-8b-o (n=4096 k=4096) started"
    assert said[1].startswith("gpu 7: llama-3.1-8b-o failed (exit 2) after")
    assert said[2:] == ["    lorafusion-tune needs a CUDA GPU"]


def test_gpus_of_different_models_are_refused_before_any_job(monkeypatch, capsys):
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(tune, "tune_on_gpus", lambda *a, **k: pytest.fail("no job may start"))
    assert cli.main(["--gpus", "2", "--models", "llama-3.1-8b"]) == 2
    assert "--gpus 2 spans different GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200)" in capsys.readouterr().out
    assert cli.main(["--gpus", "3"]) == 2
    assert "--gpus must be between 1 and the 2 GPUs" in capsys.readouterr().out
