"""Process groups of a run: ``torch.distributed`` plus megatron-core's pipeline x data-parallel layout.

Only megatron-core's stable ``parallel_state`` API is used (``initialize_model_parallel`` with
tensor parallelism 1, the pipeline/data-parallel ranks and groups, ``destroy_model_parallel``),
which works the same on gloo (CPU) and NCCL (GPU) in megatron-core 0.16 to 0.20. The device
follows the backend: CUDA device ``LOCAL_RANK`` with NCCL, the CPU with gloo.

Beside megatron-core's groups, two gloo groups carry the run's control messages (a gradient
norm, a stop flag: a few bytes of host memory), posted asynchronously so that no stage waits
for the others at an optimizer step: ``control_group`` over each pipeline's ranks and
``world_control_group`` over all ranks. Being gloo groups of their own, they never queue behind
(or in front of) the activations' NCCL transfers, and a pending one occupies no GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.failures import note_failure

if TYPE_CHECKING:
    import torch
    import torch.distributed

__all__ = ["Layout", "parallel_layout"]


@dataclass(frozen=True)
class Layout:
    """Where this process sits.

    Attributes:
        rank: Global rank.
        world_size: Processes in all (``S * d``).
        stage: Pipeline stage ``s``.
        num_stages: ``S``.
        replica: Data-parallel rank.
        num_replicas: ``d``.
        prev_rank: Global rank of stage ``s - 1`` of this replica (``None`` on the first stage).
        next_rank: Global rank of stage ``s + 1`` (``None`` on the last stage).
        pipeline_group: This replica's pipeline group.
        data_group: This stage's data-parallel group.
        device: Where this process computes.
        control_group: Gloo group of this replica's pipeline ranks (``None`` in a single process).
        world_control_group: Gloo group of all ranks (``None`` in a single process).
    """

    rank: int
    world_size: int
    stage: int
    num_stages: int
    replica: int
    num_replicas: int
    prev_rank: int | None
    next_rank: int | None
    pipeline_group: Any
    data_group: Any
    device: torch.device
    control_group: Any = None
    world_control_group: Any = None

    @property
    def is_first(self) -> bool:
        """The first pipeline stage."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """The last pipeline stage."""
        return self.stage == self.num_stages - 1


def _control_groups(pipeline_group: Any, timeout: datetime.timedelta) -> tuple[Any, Any]:
    """New gloo groups (every rank must call this, in the same order): this pipeline's, and the world's."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dist.get_process_group_ranks(pipeline_group))
    pipelines = sorted({tuple(ranks) for ranks in everyone})
    mine, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        [list(ranks) for ranks in pipelines], backend="gloo", timeout=timeout
    )
    return mine, dist.new_group(backend="gloo", timeout=timeout)


def _init_process_group(
    backend: str, init_method: str | None, rank: int | None, world_size: int | None, timeout: datetime.timedelta
) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


@contextlib.contextmanager
def parallel_layout(
    pipeline_stages: int,
    *,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_minutes: int = 30,
) -> Iterator[Layout]:
    """Initialise the process groups (if not yet) and yield this process's place; tear down at exit.

    Under ``torchrun`` the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) says everything;
    otherwise give ``init_method`` (e.g. ``file:///tmp/rendezvous``), ``rank`` and ``world_size``.

    Args:
        pipeline_stages: ``S``; the world size must be a multiple of it (``d = world / S``).
        backend: ``nccl`` or ``gloo``; default NCCL when a GPU is visible, else gloo.
        init_method: Rendezvous URL when not launched by torchrun.
        rank: Global rank (with ``init_method``).
        world_size: Processes in all (with ``init_method``).
        timeout_minutes: How long a transfer or collective of any group waits for its peers before
            it raises (the world's, if this call creates it; megatron-core's; the control groups).

    An exception raised inside the block is written down for the local launcher before the groups
    are torn down (:func:`~lorafusion_megatron.pipeline.failures.note_failure`).

    Raises:
        TrainerError: The world size is not a multiple of ``pipeline_stages``.
    """
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    owns_world = not dist.is_initialized()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    _init_process_group(backend, init_method, rank, world_size, timeout)
    world = dist.get_world_size()
    if world % pipeline_stages:
        raise TrainerError(
            f"{world} processes cannot form pipelines of {pipeline_stages} stages: "
            "start a multiple of pipeline_stages processes"
        )
    with warnings.catch_warnings():
        # megatron-core warns at import about its own internals (Apex/TE fallbacks, module moves).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pipeline_stages,
        distributed_timeout_minutes=timeout_minutes,
    )
    control_group, world_control_group = _control_groups(parallel_state.get_pipeline_model_parallel_group(), timeout)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        layout = Layout(
            rank=dist.get_rank(),
            world_size=world,
            stage=stage,
            num_stages=pipeline_stages,
            replica=parallel_state.get_data_parallel_rank(),
            num_replicas=parallel_state.get_data_parallel_world_size(),
            prev_rank=parallel_state.get_pipeline_model_parallel_prev_rank() if stage > 0 else None,
            next_rank=parallel_state.get_pipeline_model_parallel_next_rank() if stage < pipeline_stages - 1 else None,
            pipeline_group=parallel_state.get_pipeline_model_parallel_group(),
            data_group=parallel_state.get_data_parallel_group(),
            device=device,
            control_group=control_group,
            world_control_group=world_control_group,
        )
        try:
            yield layout
        except Exception as error:
            # Before the groups go: tearing them down makes the peers fail too, and the launcher must
            # tell the first failure from theirs (:mod:`.failures`).
            note_failure(error, rank=layout.rank, stage=layout.stage, replica=layout.replica)
            raise
    finally:
        for group in (control_group, world_control_group):
            dist.destroy_process_group(group)
        parallel_state.destroy_model_parallel()
        if owns_world:
            dist.destroy_process_group()
