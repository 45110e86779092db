"""Ctrl-C in a pipeline run: every rank notes the signal, and all agree at an optimizer step where to stop.

A checkpoint needs a drained pipeline and every rank's part of it, so no rank may stop on its own.
Each rank turns SIGINT and SIGTERM into a local request (:func:`rank_stop_signal`, the
single-process trainer's :class:`~lorafusion_megatron.executor.StopSignal` extended to SIGTERM);
:class:`StopAgreement` turns the requests into one answer that every rank reads at the same point
of the program, without making any rank wait for another: at each optimizer step point (local
microbatch ``k`` of a run) every rank *posts* a 4-byte max-all-reduce of its request on the
layout's gloo ``world_control_group``, asynchronously, and reads the posts made at step points
``S`` or more microbatches earlier (``S`` stages). A post at ``k`` is complete by then on every
rank: stage 0 posts after its backward of ``k``, which precedes its forward of ``k + S``, which
every later stage runs before its backward of ``k + S``. The answer is therefore late by ``S``
microbatches or so, and free: the only cost on the normal path is one asynchronous post per step
point. At the end of a run every rank waits for its outstanding posts (all ranks are there anyway,
the pipeline being drained), so none is left behind. The engine then drains the pipeline
(:mod:`.engine`) and the worker writes the checkpoint.

The same Ctrl-C usually arrives several times: the terminal signals every process of its
foreground group, and launchers (the local one here, ``torchrun``) forward what they receive to
their ranks. A rank therefore treats repeats as the same request; aborting without a checkpoint is
the launcher's business (:mod:`.launch`: a second Ctrl-C kills the ranks).
"""

from __future__ import annotations

import logging
import signal
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.executor import StopSignal

if TYPE_CHECKING:
    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["RANK_STOP_MESSAGE", "StopAgreement", "rank_stop_signal"]

_log = logging.getLogger(__name__)


RANK_STOP_MESSAGE = "{signal}: the ranks stop at the next optimizer step, drain the pipeline and write a checkpoint"
"""What one rank logs at the first signal."""


def rank_stop_signal() -> StopSignal:
    """SIGINT or SIGTERM asks this rank to stop at the next agreement; repeats change nothing.

    Silent until the caller sets ``message`` (one rank should log, not all: e.g. to
    :data:`RANK_STOP_MESSAGE` on global rank 0).
    """
    return StopSignal((signal.SIGINT, signal.SIGTERM), repeat_aborts=False, message=None)


class StopAgreement:
    """Every rank's stop request, combined asynchronously and read by all at the same program points.

    Args:
        requested: This rank's own request (e.g. a :func:`rank_stop_signal`).
        layout: The process's place: the number of stages (the reading lag) and
            ``world_control_group`` (``None`` or a world of one: the request is read directly).
    """

    def __init__(self, requested: Callable[[], bool], layout: Layout) -> None:
        self.requested = requested
        self.group = layout.world_control_group if layout.world_size > 1 else None
        self.lag = layout.num_stages
        self._posted: deque[tuple[int, Any, Any]] = deque()

    def post(self, index: int) -> None:
        """Post this rank's request at the step point of local microbatch ``index`` (all ranks, same points)."""
        if self.group is None:
            return
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.requested())], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._posted.append((index, work, flag))

    def agreed(self, index: int) -> bool:
        """Whether the posts made at least ``S`` microbatches before step point ``index`` ask to stop.

        Every rank gets the same answer at the same ``index``; a single process reads its own request.
        """
        if self.group is None:
            return self.requested()
        stop = False
        while self._posted and self._posted[0][0] + self.lag <= index:
            stop = self._take() or stop
        return stop

    def settle(self) -> bool:
        """Wait for every outstanding post (at the end of a run, on every rank); whether any asks to stop."""
        stop = False
        while self._posted:
            stop = self._take() or stop
        return stop

    def _take(self) -> bool:
        _index, work, flag = self._posted.popleft()
        work.wait()
        return bool(flag.item())
