"""``lorafusion-tune --gpus N``: one sweep spread over the GPUs of a host, one layer shape per job.

A job is one layer shape ``(N, K)`` with every ``m``, ``r`` and kernel of the sweep; it runs as a
``lorafusion-tune`` process of its own on one GPU (``CUDA_VISIBLE_DEVICES``), so each GPU times
its candidates alone, as a single-GPU sweep would. Jobs go largest ``N * K`` first to whichever
GPU is free; the winners of every job then form one file, with each kernel's default recomputed
over all of them. A time limit stops starting jobs (and, inside a job, shapes) once it has passed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lorafusion_kernels.errors import LoRAFusionKernelsError
from lorafusion_kernels.tuning.agreement import ShapeTimings, timings_from_json
from lorafusion_kernels.tuning.config import ConfigFile, ShapeKey, TunedEntry
from lorafusion_kernels.tuning.search_space import MODEL_LAYERS


@dataclasses.dataclass(frozen=True)
class TuneJob:
    """One layer shape of the sweep, named by the first model layer that has it."""

    model: str
    layer: str
    n: int
    k: int

    @property
    def name(self) -> str:
        """``<model>-<layer>``: the job's directory and its name in progress lines."""
        return f"{self.model}-{self.layer}"

    @property
    def argv(self) -> list[str]:
        """The ``lorafusion-tune`` arguments that select this shape alone."""
        return ["--models", self.model, "--layers", self.layer]


def layer_jobs(models: Sequence[str], layers: Sequence[str] | None = None) -> list[TuneJob]:
    """One job per distinct ``(N, K)`` of the models' layers (all, or those in ``layers``), largest first.

    Raises:
        LoRAFusionKernelsError: for an unknown model, or a layer name no listed model has.
    """
    for model in models:
        if model not in MODEL_LAYERS:
            raise LoRAFusionKernelsError(f"unknown model {model!r}; choose from {sorted(MODEL_LAYERS)}")
    known = sorted({name for model in models for name, _, _ in MODEL_LAYERS[model]})
    for layer in layers or ():
        if layer not in known:
            raise LoRAFusionKernelsError(f"unknown layer {layer!r} for models {list(models)}; choose from {known}")
    jobs: dict[tuple[int, int], TuneJob] = {}
    for model in models:
        for layer, n, k in MODEL_LAYERS[model]:
            if (layers is None or layer in layers) and (n, k) not in jobs:
                jobs[(n, k)] = TuneJob(model, layer, n, k)
    return sorted(jobs.values(), key=lambda job: -job.n * job.k)


JobRunner = Callable[[TuneJob, str, float | None], bool]
"""Runs one job on one GPU (its ``CUDA_VISIBLE_DEVICES`` value) with a time limit in seconds; True if it succeeded."""


@dataclasses.dataclass(frozen=True)
class JobsOutcome:
    """Which jobs ran to the end, which failed, and which never started (time limit)."""

    succeeded: tuple[TuneJob, ...]
    failed: tuple[TuneJob, ...]
    skipped: tuple[TuneJob, ...]


def run_jobs(
    jobs: Sequence[TuneJob],
    gpus: Sequence[str],
    run: JobRunner,
    time_limit_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> JobsOutcome:
    """Run ``jobs`` in order, one at a time per GPU, each on the next free GPU.

    A job that would start after ``time_limit_s`` is skipped; one that starts gets the time left.
    """
    todo: queue.SimpleQueue[TuneJob] = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    started = clock()
    lock = threading.Lock()
    succeeded: list[TuneJob] = []
    failed: list[TuneJob] = []
    skipped: list[TuneJob] = []

    def worker(gpu: str) -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            left = None if time_limit_s is None else time_limit_s - (clock() - started)
            if left is not None and left <= 0:
                with lock:
                    skipped.append(job)
                continue
            ok = run(job, gpu, left)
            with lock:
                (succeeded if ok else failed).append(job)

    threads = [threading.Thread(target=worker, args=(gpu,), name=f"tune-gpu-{gpu}") for gpu in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    order = {job: i for i, job in enumerate(jobs)}
    return JobsOutcome(*(tuple(sorted(done, key=order.__getitem__)) for done in (succeeded, failed, skipped)))


def visible_gpus(count: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of the first ``count`` GPUs this process sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [part.strip() for part in visible.split(",") if part.strip()] if visible else []
    return ids[:count] if ids else [str(i) for i in range(count)]


def job_dir(workdir: Path, job: TuneJob) -> Path:
    """Where ``job`` writes its config file, its timings and its log."""
    return workdir / job.name


def subprocess_runner(common_argv: Sequence[str], workdir: Path, say: Callable[[str], None]) -> JobRunner:
    """A :data:`JobRunner` that runs ``python -m lorafusion_kernels.tuning`` for each job, logging to its dir."""

    def run(job: TuneJob, gpu: str, time_limit_s: float | None) -> bool:
        out = job_dir(workdir, job)
        out.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "lorafusion_kernels.tuning", *common_argv, *job.argv]
        argv += ["--out", str(out), "--timings", str(out / "timings.json")]
        if time_limit_s is not None:
            argv += ["--time-limit", f"{time_limit_s:.0f}"]
        say(f"gpu {gpu}: {job.name} (n={job.n} k={job.k}) started")
        began = time.monotonic()
        with (out / "tune.log").open("w") as log:
            code = subprocess.run(
                argv, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}, stdout=log, stderr=subprocess.STDOUT, check=False
            ).returncode
        seconds = time.monotonic() - began
        if code != 0:
            tail = (out / "tune.log").read_text().splitlines()[-5:]
            say(f"gpu {gpu}: {job.name} failed (exit {code}) after {seconds:.0f} s; log ends:")
            for line in tail:
                say(f"    {line}")
            return False
        say(f"gpu {gpu}: {job.name} done in {seconds:.0f} s")
        return True

    return run


_TIME_LIMIT = re.compile(r"\(time limit: (\d+) of (\d+) shapes\)")


def points_done(config_file: ConfigFile, points_per_job: int) -> int:
    """How many of a job's ``(m, r)`` points its sweep finished, from its provenance."""
    cut = _TIME_LIMIT.search(config_file.provenance.get("sweep", ""))
    return int(cut.group(1)) if cut else points_per_job


@dataclasses.dataclass(frozen=True)
class JobResults:
    """What the finished jobs wrote: their config files, every timing, and the winners by kernel."""

    files: tuple[ConfigFile, ...]
    timings: tuple[ShapeTimings, ...]
    entries: dict[str, list[TunedEntry]]


def read_job_results(workdir: Path, jobs: Sequence[TuneJob]) -> JobResults:
    """Read the jobs' outputs; a key two jobs timed (e.g. the shrink of two layers with one ``K``) keeps the first.

    That first job's winner and timings are kept, the later jobs' dropped, as one process times a
    key once.

    Raises:
        LoRAFusionKernelsError: if no job wrote a file, or two were measured on different GPUs.
    """
    files: list[ConfigFile] = []
    first_timings: dict[tuple[str, ShapeKey], ShapeTimings] = {}
    first_entries: dict[tuple[str, ShapeKey], TunedEntry] = {}
    for job in jobs:
        out = job_dir(workdir, job)
        written = sorted(out.glob("*.json"), key=lambda path: path.name)
        config_path = next((path for path in written if path.name != "timings.json"), None)
        if config_path is None:
            continue
        config_file = ConfigFile.from_json(json.loads(config_path.read_text()), where=str(config_path))
        if files and config_file.device_key != files[0].device_key:
            raise LoRAFusionKernelsError(
                f"jobs ran on different GPUs ({files[0].device_key}, {config_file.device_key}); "
                "give --gpus only GPUs of one model"
            )
        files.append(config_file)
        timings_path = out / "timings.json"
        if timings_path.is_file():
            for row in timings_from_json(json.loads(timings_path.read_text()), where=str(timings_path)):
                first_timings.setdefault((row.kernel, row.key), row)
        for kernel, table in config_file.kernels.items():
            for entry in table.entries:
                first_entries.setdefault((kernel, entry.key), entry)
    entries: dict[str, list[TunedEntry]] = {}
    for (kernel, _), entry in first_entries.items():
        entries.setdefault(kernel, []).append(entry)
    if not files:
        raise LoRAFusionKernelsError(f"no tuning job wrote a config file (logs in {workdir})")
    return JobResults(files=tuple(files), timings=tuple(first_timings.values()), entries=entries)
