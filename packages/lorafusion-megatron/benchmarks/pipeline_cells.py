"""Many cells of the pipeline benchmark in one launch: process group and stage model built once.

A launch of the real launcher costs 70 to 110 s besides its training on the 32B and 70B presets
(process group, data, the stage model, writing the adapters): with one launch per cell, most of a
device call. ``bench_pipeline.py --one-launch`` starts this program once instead, one rank per
stage under ``torch.distributed.run``. Each rank builds its stage model with the adapters of the
cell with the most jobs, then runs the cells in turn as the launcher's ranks would: the cell's own
plan (made by rank 0 and broadcast), program, fresh optimizers and engine, and the LoRA layers
patched for ``lorafusion_kernels`` or not, by the cell's ``runtime.fused_kernels``; rank 0 writes
the cell's ``plan.json`` and ``pipeline_summary.json`` into the cell's folder, as the launcher
does. The measurement is the launcher's: the program's wall time and each stage's busy time.
Two differences from separate launches: the adapters' weights carry over from cell to cell (the
throughput does not depend on their values), and no adapter folders are written.

Cells predicted (from the cells before them) to end past ``deadline_seconds`` after the program
started are skipped, by rank 0 for all. Each cell's summary also records two kinds of stall that
a pipeline turns into idle time on every other stage: the Triton kernels each rank compiled (or
loaded from the on-disk cache) during the cell, with their seconds and names, under
``kernel_compiles_per_stage``, and the garbage collector's pauses under ``gc_pauses_per_stage``
(the start-up objects are frozen, as the launcher does: :mod:`lorafusion_megatron.gc_tuning`).
Rank 0 writes the cell's ``pipeline_trace.json`` (:mod:`lorafusion_megatron.pipeline.trace`) too.

    python -m torch.distributed.run --standalone --nproc-per-node S pipeline_cells.py cells.json

``cells.json``: ``{"folders": [...], "warmup": 1, "deadline_seconds": 480.0 or null}``, each folder
holding a ``config.yaml`` whose ``output_dir`` is the folder itself; the first ``warmup`` cells are
warm-ups (their rates are left out of the predictions: they include compiling the kernels).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from pipeline_results import expected_rate

from lorafusion_megatron.atomic_files import write_json_atomically
from lorafusion_megatron.config import TrainerConfig, load_config


def _tokens(config: TrainerConfig, jobs: dict[str, Any]) -> int:
    return sum(sum(jobs[job.name].sample_tokens) for job in config.jobs)


def _predicted(done: list[tuple[str, float]], schedule: str, tokens: int) -> float | None:
    """Seconds a cell should take from the tokens/s of the cells before it (``None`` before the first)."""
    rate = expected_rate(done, schedule)
    return None if rate is None else tokens / rate


class CompileCounter:
    """Counts Triton's kernel compilations in this process through its JIT hooks (Triton 3.4 and later).

    A compilation here is what Triton does the first time a kernel meets a new specialisation:
    compile it, or load it from the on-disk cache. Without the hooks (an older Triton) the counts
    stay ``None``.
    """

    def __init__(self) -> None:
        self.count: int | None = None
        self.seconds: float | None = None
        self.kernels: list[dict[str, str]] = []
        self._began: float | None = None
        try:
            from triton import knobs
        except ImportError:
            return
        if not hasattr(knobs.runtime, "jit_post_compile_hook"):
            return
        self.count, self.seconds = 0, 0.0
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **_: Any) -> bool:
        self._began = time.perf_counter()
        return False  # False: compile as usual

    def _after(self, **hook: Any) -> None:
        if self.count is None or self.seconds is None or self._began is None:
            return
        self.count += 1
        self.seconds += time.perf_counter() - self._began
        # The kernel's name and Triton's specialisation key (each argument's type and properties,
        # e.g. divisibility by 16): two compilations of one kernel differ in the key.
        name = str(hook.get("repr", "?")).split("[", 1)[0]
        self.kernels.append({"name": name, "key": str(hook.get("key", "?"))})
        self._began = None

    def take(self) -> dict[str, Any]:
        """The compilations since the last call: count, seconds and each one's kernel and specialisation."""
        taken = {"count": self.count, "seconds": self.seconds, "kernels": self.kernels}
        if self.count is not None:
            self.count, self.seconds, self.kernels = 0, 0.0, []
        return taken


class GcPauses:
    """The garbage collector's pauses in this process (``gc.callbacks``), per generation collected."""

    def __init__(self) -> None:
        self._began = 0.0
        self._pauses: list[tuple[int, float]] = []
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self._pauses.append((int(info["generation"]), time.perf_counter() - self._began))

    def take(self) -> dict[str, Any]:
        """Count, total and longest seconds of the full (generation 2) and of all collections since the last call."""
        full = [seconds for generation, seconds in self._pauses if generation == 2]
        every = [seconds for _, seconds in self._pauses]
        self._pauses = []
        return {
            "full_count": len(full),
            "full_seconds": sum(full),
            "count": len(every),
            "seconds": sum(every),
            "longest_seconds": max(every, default=0.0),
        }


def run_cells(configs: list[TrainerConfig], warmup: int, deadline_seconds: float | None) -> None:
    """Run every cell on this rank (all ranks call it with the same cells)."""
    import torch
    import torch.distributed as dist

    import lorafusion_kernels
    from lorafusion_megatron.gc_tuning import start_up_objects_frozen
    from lorafusion_megatron.model import load_model_config, set_active_adapters
    from lorafusion_megatron.pipeline.groups import parallel_layout
    from lorafusion_megatron.pipeline.partition import partition_model
    from lorafusion_megatron.pipeline.programs import build_program
    from lorafusion_megatron.pipeline.stage_model import build_stage_model
    from lorafusion_megatron.pipeline.trace import chrome_trace
    from lorafusion_megatron.pipeline.worker import shared_plan, stage_engine, summarise
    from lorafusion_megatron.trainer import prepare_data

    begin = time.perf_counter()
    compiles, pauses = CompileCounter(), GcPauses()
    largest = max(configs, key=lambda config: len(config.jobs))
    fused_runtime = largest.runtime.model_copy(update={"fused_kernels": True})
    with parallel_layout(largest.parallel.pipeline_stages) as layout:
        spec = partition_model(load_model_config(largest.base_model).to_dict(), layout.num_stages)[layout.stage]
        stage = build_stage_model(largest.model_copy(update={"runtime": fused_runtime}), spec, layout.device)
        # With NCCL, a group's first call must involve all its ranks (see the worker).
        dist.all_reduce(torch.zeros(1, device=layout.device), group=layout.pipeline_group)
        start_up = time.perf_counter() - begin
        done: list[tuple[str, float]] = []
        with start_up_objects_frozen():
            for index, config in enumerate(configs):
                prepared = prepare_data(config)
                schedule = config.parallel.schedule
                predicted = _predicted(done, schedule, _tokens(config, prepared.jobs))
                skip = [
                    deadline_seconds is not None
                    and predicted is not None
                    and time.perf_counter() - begin + predicted > deadline_seconds
                ]
                dist.broadcast_object_list(skip, src=0)
                if skip[0]:
                    continue
                plan, _, _ = shared_plan(config, prepared.jobs, config.parallel, layout, resume=False)
                program = build_program(plan, schedule, config.parallel.baseline_microbatch_samples)
                fused = config.runtime.fused_kernels
                names = [job.name for job in config.jobs]
                if fused:
                    lorafusion_kernels.patch_peft_model(stage.model)
                else:
                    lorafusion_kernels.unpatch_peft_model(stage.model)
                set_active_adapters(stage.model, names)
                cell_stage = dataclasses.replace(stage, adapters=tuple(names), fused=fused)
                _, engine = stage_engine(config, layout, cell_stage, prepared.jobs)
                dist.barrier()
                compiles.take()
                pauses.take()
                position = engine.execute(program)
                everyone: list[Any] = [None] * layout.world_size
                dist.all_gather_object(everyone, (engine.stats, compiles.take(), pauses.take()))
                everyone.sort(key=lambda e: (e[0].replica, e[0].stage))
                stats = [rank_stats for rank_stats, _, _ in everyone]
                summary = summarise(stats, program.name, names)
                if index >= warmup:
                    done.append((schedule, summary["tokens_per_second"]))
                if layout.rank == 0:
                    summary |= {
                        "pipeline_stages": layout.num_stages,
                        "data_parallel": layout.num_replicas,
                        "position": position,
                        "num_microbatches": program.num_microbatches,
                        "rank0_phase_seconds": {"shared start-up (one launch)": start_up},
                        "kernel_compiles_per_stage": [c for rank_stats, c, _ in everyone if rank_stats.replica == 0],
                        "gc_pauses_per_stage": [g for rank_stats, _, g in everyone if rank_stats.replica == 0],
                    }
                    write_json_atomically(Path(config.output_dir) / "pipeline_summary.json", summary)
                    write_json_atomically(Path(config.output_dir) / "pipeline_trace.json", chrome_trace(stats))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    configs = [load_config(Path(folder) / "config.yaml") for folder in spec["folders"]]
    run_cells(configs, spec["warmup"], spec["deadline_seconds"])


if __name__ == "__main__":
    main()
