"""Start a pipeline run (or a profile): under an external ``torchrun``, or as local processes started here.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment, any number of nodes) this
process is one rank. Otherwise ``S * d`` processes are started on this node with
``torch.multiprocessing`` (one per GPU with NCCL, or CPU processes with gloo), which meet through
a rendezvous file in a temporary folder (no port to pick); this process waits for them and reads
the summary rank 0 wrote. While it waits, the first SIGINT or SIGTERM it receives goes on to every
rank as SIGTERM (a signal sent to this process alone reaches the ranks; the ranks take the copy a
terminal's Ctrl-C also sends them as the same request): they stop at their next optimizer step and
write a checkpoint (:mod:`.stopping`). A second one kills the ranks at once, without a checkpoint.
When a rank fails, the others are stopped within seconds and the error names the rank that failed
first, not a peer that failed because of it (:mod:`.failures`). A resume is checked here before any
rank starts; one of a run that already finished starts none and writes nothing
(:mod:`lorafusion_megatron.finished_run`).

On the CPU (gloo) more ranks than cores are warned about, not refused: they still train correctly,
each with one thread and a share of the cores, which is how the pipeline is tested on small hosts
(4 gloo ranks on 2 cores), but each rank is a process with its own torch and its own stage of the
model, and 64 ranks on a 2-core host with 23 GB ran out of memory and were killed by the kernel.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.interrupts import Interrupted, repeat_hint
from lorafusion_megatron.pipeline.options import ParallelConfig
from lorafusion_megatron.run_layout import PIPELINE_SUMMARY, PROFILE_REPORT
from lorafusion_sched.planner import default_workers as cpu_cores  # the CPU cores this process may run on

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from lorafusion_megatron.config import TrainerConfig

__all__ = ["cpu_cores", "launch", "launch_profile", "run_demo", "under_torchrun"]

RankEntry = Callable[..., "dict[str, Any] | None"]
"""``entry(config, parallel, *, backend, init_method, rank, world_size)``: one rank's work."""

_log = logging.getLogger(__name__)


def under_torchrun() -> bool:
    """Whether this process is a rank started by ``torchrun`` (or another launcher setting the env)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _spawned_rank(
    rank: int,
    entry: RankEntry,
    config: TrainerConfig,
    parallel: ParallelConfig,
    backend: str,
    init_method: str,
    world: int,
    failures: str,
) -> None:
    import logging

    from lorafusion_megatron.pipeline.failures import record_failures_in

    record_failures_in(Path(failures))
    os.environ["LOCAL_RANK"] = str(rank)
    if backend == "gloo":
        import torch

        # Processes sharing this node's cores: without a split, each would start one thread per core.
        torch.set_num_threads(max(1, cpu_cores() // world))
    # Rank 0 logs the summary and the last stage of replica 0 the steps; the others log nothing.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    entry(config, parallel, backend=backend, init_method=init_method, rank=rank, world_size=world)


def _start(
    entry: RankEntry, config: TrainerConfig, parallel: ParallelConfig, backend: str | None, result: str
) -> tuple[dict[str, Any] | None, signal.Signals | None]:
    """Run ``entry`` on every rank (here, or as this torchrun rank).

    Returns:
        Rank 0's ``result`` file (None on other torchrun ranks), and the first SIGINT/SIGTERM this
        launcher passed on to the ranks while they ran (None under torchrun).
    """
    import torch

    if under_torchrun():
        return entry(config, parallel, backend=backend), None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    world = parallel.world_size
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise TrainerError(
            f"{world} processes ({parallel.pipeline_stages} stages x {parallel.data_parallel} replicas) need "
            f"{world} GPUs; {torch.cuda.device_count()} are visible"
        )
    if backend == "gloo":
        _warn_past_cpu_cores(parallel)
    from torch.multiprocessing.spawn import spawn

    from lorafusion_megatron.checkpoint import recover_interrupted_writes
    from lorafusion_megatron.pipeline.failures import supervise
    from lorafusion_megatron.run_lock import new_run_folders, run_locks

    # A run that fails before it writes anything leaves no folder of its own making behind.
    tidy = new_run_folders(config)
    with run_locks(config, tidy=tidy), tempfile.TemporaryDirectory(prefix="lorafusion-rendezvous-") as folder:
        recover_interrupted_writes(config)
        init_method = Path(folder, "store").as_uri()
        context = spawn(  # type: ignore[no-untyped-call]
            _spawned_rank,
            args=(entry, config, parallel, backend, init_method, world, folder),
            nprocs=world,
            join=False,
        )
        forwarder = _SignalForwarder(context.processes)
        try:
            with forwarder:
                supervise(
                    context.processes,
                    Path(folder),
                    errors=functools.partial(_spawn_error, context.error_files),
                    signalled=lambda: forwarder.received > 0,
                )
        finally:
            for path in context.error_files:  # torch's spawn leaves them to its own join, not used here
                Path(path).unlink(missing_ok=True)
    summary: dict[str, Any] = json.loads((Path(config.output_dir) / result).read_text(encoding="utf-8"))
    return summary, forwarder.first


def _warn_past_cpu_cores(parallel: ParallelConfig) -> None:
    """Warn when the gloo ranks about to start outnumber the CPU cores (see the module's docstring)."""
    cores, world = cpu_cores(), parallel.world_size
    if world <= cores:
        return
    _log.warning(
        "%d processes (%d stages x %d replicas) on %d CPU core(s): the ranks share the cores (one thread each), so "
        "the run is no faster than with fewer of them, and each holds torch and its stage of the model in memory "
        "of its own: too many exhaust the host's memory and the kernel kills them. To test the pipeline this is "
        "fine; to train, use at most %d processes (--pipeline-stages x --data-parallel)",
        world,
        parallel.pipeline_stages,
        parallel.data_parallel,
        cores,
        cores,
    )


def _spawn_error(error_files: Sequence[str], rank: int) -> str:
    """The traceback torch's spawn wrapper saved of an exception ``rank`` raised (``""`` if none)."""
    import pickle

    try:
        with open(error_files[rank], "rb") as file:
            text = pickle.load(file)  # written by torch.multiprocessing.spawn in the rank's process
    except (OSError, EOFError, pickle.UnpicklingError):
        return ""
    return text if isinstance(text, str) else ""


class _SignalForwarder:
    """While the ranks run: the first SIGINT/SIGTERM is passed on to them as SIGTERM, a second kills them.

    The second raises :class:`~lorafusion_megatron.interrupts.Interrupted` naming its signal (the exit status).

    Args:
        processes: The ranks' processes.
    """

    def __init__(self, processes: Sequence[BaseProcess]) -> None:
        self._processes = processes
        self.received = 0
        """Signals received so far."""
        self.first: signal.Signals | None = None
        """The first of them."""
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        alive = [p for p in self._processes if p.is_alive()]
        if self.received == 1:
            self.first = signal.Signals(signum)
            _log.warning(
                "%s: the ranks stop at their next optimizer step, drain the pipeline and write a checkpoint; "
                "%s to abort without one",
                signal.Signals(signum).name,
                repeat_hint(signal.Signals(signum)),
            )
            for process in alive:
                process.terminate()  # SIGTERM
            return
        for process in alive:
            process.kill()
        raise Interrupted(signum)

    def __enter__(self) -> _SignalForwarder:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def launch(
    config: TrainerConfig, parallel: ParallelConfig, *, backend: str | None = None, resume: bool = False
) -> dict[str, Any] | None:
    """Train ``config`` on ``parallel.world_size`` processes; returns rank 0's summary.

    Args:
        config: The run.
        parallel: Stages, replicas and schedule.
        backend: ``nccl`` or ``gloo``; default NCCL when GPUs are visible, else gloo.
        resume: Continue from the newest checkpoint in ``output_dir``.

    Returns:
        The run summary (tokens/s, bubble ratio per stage, steps, adapter folders, per-job counters
        under ``run_state``, the run's id, config and parallel settings), also written to
        ``<output_dir>/pipeline_summary.json``; ``None`` on ranks other than 0 under torchrun.
        After a Ctrl-C, ``checkpoint`` names the checkpoint written and ``position < num_microbatches``;
        no adapters are written. A first SIGINT/SIGTERM that came too late to stop the run (after
        the ranks' last agreement, while the adapters were written) adds ``stopped_by``, its name,
        to the returned summary (not to the file): the run is complete. A ``resume`` of a run that
        finished starts no rank, writes nothing, logs that the run is complete and returns its
        summary as it was written.

    Raises:
        TrainerError: Too few GPUs for the processes, a ``resume`` that the newest checkpoint or
            the finished run refuses (checked before any rank starts), or a rank failed.
    """
    from lorafusion_megatron.pipeline.checkpoint import check_resumable
    from lorafusion_megatron.pipeline.worker import run_rank

    finished = None
    if resume:
        from lorafusion_megatron.run_lock import new_run_folders, run_locks

        # Under the run's lock, as the single-process trainer checks: a run training in the folder now is
        # refused as such, not taken for the finished one its older summary records.
        tidy = new_run_folders(config)
        with contextlib.nullcontext() if under_torchrun() else run_locks(config, tidy=tidy):
            finished = check_resumable(config, parallel)
    if finished is not None:
        if under_torchrun() and os.environ["RANK"] != "0":  # every rank checked; rank 0 reports
            return None
        _log.info("%s", finished.message())
        return finished.record
    if not under_torchrun() or os.environ["RANK"] == "0":
        _warn_past_context(config)
    summary, signalled = _start(functools.partial(run_rank, resume=resume), config, parallel, backend, PIPELINE_SUMMARY)
    if summary is not None and signalled is not None and summary["checkpoint"] is None:
        summary["stopped_by"] = signalled.name
    return summary


def _warn_past_context(config: TrainerConfig) -> None:
    """Warn, once for the run, when its capacity lets samples run past the base model's context."""
    from lorafusion_megatron.checks import capacity_past_context
    from lorafusion_megatron.profiler.run import with_profiled_choices

    warning = capacity_past_context(with_profiled_choices(config))
    if warning is not None:
        _log.warning("%s", warning)


def launch_profile(
    config: TrainerConfig, parallel: ParallelConfig, *, backend: str | None = None, **options: Any
) -> dict[str, Any] | None:
    """Profile ``config``'s model on its stages; returns the report (``<output_dir>/profile.json``).

    Args:
        config: The run (model, jobs).
        parallel: Stages and replicas.
        backend: ``nccl`` or ``gloo``; default from the hardware.
        **options: ``candidates``, ``sample_length``, ``repeats``, ``memory_fraction`` of
            :func:`~lorafusion_megatron.profiler.run.profile_rank`.

    Raises:
        TrainerError: Too few GPUs for the processes, or a rank failed.
    """
    from lorafusion_megatron.profiler.run import profile_rank

    report, _ = _start(functools.partial(profile_rank, **options), config, parallel, backend, PROFILE_REPORT)
    return report


def run_demo(
    output: Path,
    pipeline_stages: int,
    *,
    samples_per_job: int = 128,
    epochs: int = 2,
    schedule: str = "lorafusion",
    data_parallel: int = 1,
) -> dict[str, Any] | None:
    """``lorafusion-megatron demo --pipeline-stages S``: the demo as ``S * d`` CPU processes over gloo.

    Args:
        output: Demo folder (base model, data, config, adapters).
        pipeline_stages: ``S`` (the tiny model has 2 decoder layers, so 1 or 2).
        samples_per_job: Records per job.
        epochs: Passes over each job's data.
        schedule: ``lorafusion``, ``megatron-1f1b`` or ``mlora``.
        data_parallel: Replicas ``d``.

    Returns:
        The run summary.
    """
    from lorafusion_megatron.demo import build_demo

    parallel = ParallelConfig.model_validate(
        {"pipeline_stages": pipeline_stages, "data_parallel": data_parallel, "schedule": schedule}
    )
    config = build_demo(output, samples_per_job=samples_per_job, epochs=epochs, parallel=parallel)
    return launch(config, parallel, backend="gloo")
