"""Ctrl-C in a pipeline run: every rank notes the signal, and all agree at an optimizer step where to stop.

A checkpoint needs a drained pipeline and every rank's part of it, so no rank may stop on its own.
Each rank turns SIGINT and SIGTERM into a local request (:func:`rank_stop_signal`, the
single-process trainer's :class:`~lorafusion_megatron.executor.StopSignal` extended to SIGTERM);
after the optimizer steps of a microbatch, where every stage of a pipeline already waits for the
others (the steps' gradient-norm all-reduce), :func:`stop_agreement` turns the requests into one
answer with a 4-byte max-all-reduce over all ranks: the only cost on the normal path, once per
microbatch that steps. The engine then drains the pipeline (:mod:`.engine`) and the worker writes
the checkpoint.

The same Ctrl-C usually arrives several times: the terminal signals every process of its
foreground group, and launchers (the local one here, ``torchrun``) forward what they receive to
their ranks. A rank therefore treats repeats as the same request; aborting without a checkpoint is
the launcher's business (:mod:`.launch`: a second Ctrl-C kills the ranks).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from lorafusion_megatron.executor import StopSignal

if TYPE_CHECKING:
    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["RANK_STOP_MESSAGE", "rank_stop_signal", "stop_agreement"]

_log = logging.getLogger(__name__)


RANK_STOP_MESSAGE = "{signal}: the ranks stop at the next optimizer step, drain the pipeline and write a checkpoint"
"""What one rank logs at the first signal."""


def rank_stop_signal() -> StopSignal:
    """SIGINT or SIGTERM asks this rank to stop at the next agreement; repeats change nothing.

    Silent until the caller sets ``message`` (one rank should log, not all: e.g. to
    :data:`RANK_STOP_MESSAGE` on global rank 0).
    """
    return StopSignal((signal.SIGINT, signal.SIGTERM), repeat_aborts=False, message=None)


def stop_agreement(requested: Callable[[], bool], layout: Layout) -> Callable[[], bool]:
    """A collective ``should_stop`` for the engine: ``True`` on every rank once any rank was asked to stop.

    Args:
        requested: This rank's own request (e.g. a :func:`rank_stop_signal`).
        layout: The process's place (device, world size).
    """
    if layout.world_size == 1:
        return requested

    def agree() -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(requested())], dtype=torch.int32, device=layout.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return agree
