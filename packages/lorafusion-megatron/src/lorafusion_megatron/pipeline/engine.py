"""Execute a program on one pipeline stage: 1F1B over each run, per-adapter steps at ``step_after``.

The engine walks the stage's :func:`~lorafusion_megatron.pipeline.schedule.one_f_one_b` actions.
A forward packs the plan microbatch (every rank packs it from the same data, so token counts,
position ids and masks need no communication), runs the stage and keeps its input and output for
the backward; on the last stage the output is the microbatch's share of each adapter's loss, each
segment's token-loss sum divided by the trained tokens of that adapter's whole global batch, as in
the single-process trainer. A no-op microbatch computes and exchanges nothing, but keeps its slot.
The forward names its microbatch to :mod:`lorafusion_megatron.dropout_seeds`, so the stage's layers
draw their dropout as the single-process trainer's do, whatever the 1F1B order.

Adapter ``a`` steps on this stage right after the stage sent the input gradients of the plan's
``step_after`` microbatch of ``a`` (after its backward): by then this stage has run the backward
of every microbatch of the global batch, and the bubble lemma (``S`` microbatches between global
batches of one adapter) guarantees that no forward of ``a``'s next global batch has run here yet,
since stage ``s`` is at most ``S - 1 - s`` forwards ahead of its backwards. The step comes in two
halves (:class:`~lorafusion_megatron.pipeline.optim.StageOptimizer`): at the step point the stage
only posts the gradient norm's all-reduce over the stages and goes on; it waits for it, clips and
steps just before its next forward of a microbatch of ``a`` (or when the run drains). A stage that
waited at the step point itself would idle until stage 0 got there, ``S - 1 - s`` microbatch
slots later, at every step of every adapter: measured on LLaMa-3.1-70B over 4 H200s, that made
the continuous schedule idle 38% of the time where the simulator predicts 8%.

Stopping early (Ctrl-C): at each step point every rank posts its request and reads the requests
posted ``S`` microbatches earlier (:class:`~lorafusion_megatron.pipeline.stopping.StopAgreement`),
so all ranks get the same answer at the same logical point. On yes, the run is cut
at ``c = k + S`` (local indices): stage ``s`` has run no forward past ``k + S - 1 - s`` yet, and
dropping every action of microbatches ``>= c`` from the rest of the 1F1B list leaves exactly the
1F1B list of the first ``c`` microbatches, so the stages drain in lockstep. A later
:meth:`StageEngine.execute` from that position runs the rest of the run as its own 1F1B run; the
forwards, backwards and steps on every stage come in the same order as without the cut, so a
resumed run ends with the same weights bit for bit.

A stage's output activations are freed as soon as they are sent (:mod:`.activations`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafusion_megatron.dropout_seeds import drawing_for
from lorafusion_megatron.pipeline.activations import backward_from, release_storage
from lorafusion_megatron.pipeline.p2p import Expect, PipelineMismatchError, Transfer
from lorafusion_megatron.pipeline.schedule import Exchange, one_f_one_b
from lorafusion_megatron.pipeline.stall import Heartbeat, no_heartbeat
from lorafusion_megatron.pipeline.trace import Timeline

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.data.job_data import JobData
    from lorafusion_megatron.packing import PackedBatch
    from lorafusion_megatron.pipeline.groups import Layout
    from lorafusion_megatron.pipeline.optim import StageOptimizer
    from lorafusion_megatron.pipeline.p2p import StageLink
    from lorafusion_megatron.pipeline.programs import Program
    from lorafusion_megatron.pipeline.stage_model import StageModel
    from lorafusion_megatron.pipeline.stopping import StopAgreement
    from lorafusion_sched.models import Microbatch

__all__ = ["EngineStats", "StageEngine", "StepRecord"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of one adapter, as seen by this stage.

    Attributes:
        adapter: Job name.
        step: Steps completed, this one included.
        learning_rate: Learning rate of the step.
        grad_norm: Pipeline-wide gradient norm before clipping.
        loss: Mean loss of the global batch (last stage only, else ``None``).
    """

    adapter: str
    step: int
    learning_rate: float
    grad_norm: float
    loss: float | None


@dataclass
class EngineStats:
    """What one stage measured.

    Attributes:
        stage: Pipeline stage.
        replica: Data-parallel rank.
        wall_seconds: From the start of the program to the end of its last action.
        busy_seconds: Time spent computing forwards and backwards.
        exchange_seconds: Time in transfers with the neighbours (mostly waiting for them).
        step_seconds: Time in optimizer steps (both halves).
        norm_wait_seconds: The part of ``step_seconds`` spent waiting for the other stages'
            gradient norms (a stage that steps before a stage behind it posted its norm).
        pack_seconds: Time packing microbatches and moving them to the device.
        first_forward_seconds: The first forward alone (one-time costs: kernels loaded, memory
            allocated), part of ``busy_seconds``.
        tokens: Real tokens of the microbatches this replica ran.
        microbatches: Microbatches run (no-ops included).
        steps: The steps taken, in order.
        timeline: Every forward and backward, in the order they ran (:mod:`.trace`).
    """

    stage: int
    replica: int
    wall_seconds: float = 0.0
    busy_seconds: float = 0.0
    exchange_seconds: float = 0.0
    step_seconds: float = 0.0
    norm_wait_seconds: float = 0.0
    pack_seconds: float = 0.0
    first_forward_seconds: float | None = None
    tokens: int = 0
    microbatches: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the wall time."""
        return 1.0 - self.busy_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def idle_shares(self) -> dict[str, float]:
        """Where the idle time went, as shares of the wall time (``other``: the engine's own host work)."""
        if self.wall_seconds <= 0:
            return {}
        parts = {
            "exchange": self.exchange_seconds,
            "norm_wait": self.norm_wait_seconds,
            "optimizer": self.step_seconds - self.norm_wait_seconds,
            "pack": self.pack_seconds,
        }
        shares = {name: seconds / self.wall_seconds for name, seconds in parts.items()}
        shares["other"] = max(0.0, self.bubble_ratio - sum(shares.values()))
        return shares


@dataclass
class _InFlight:
    """A microbatch between its forward and its backward on this stage."""

    batch: PackedBatch
    inputs: torch.Tensor | None
    output: torch.Tensor


@dataclass
class _Run:
    """One 1F1B run's microbatches (this replica's), their header keys, and the tensors between actions.

    Attributes:
        microbatches: The run's microbatches, local order.
        keys: Identity of each in the transfer headers (its index in the whole program).
        in_flight: Forward done, backward pending, by local index.
        received: Activations received, forward pending.
        gradients: Output gradients received, backward pending.
        input_grads: Input gradients computed, send pending.
        limit: Microbatches ``>= limit`` are not run (the cut of a stop; ``len(microbatches)`` else).
    """

    microbatches: list[Microbatch]
    keys: list[int]
    in_flight: dict[int, _InFlight] = field(default_factory=dict)
    received: dict[int, torch.Tensor] = field(default_factory=dict)
    gradients: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.limit = len(self.microbatches)

    def runs(self, index: int) -> bool:
        """Whether microbatch ``index`` computes: before the cut and not a no-op."""
        return index < self.limit and not self.microbatches[index].noop

    def real(self, index: int | None) -> int | None:
        """``index`` unless it is absent, a no-op (which exchanges nothing) or past the cut."""
        return index if index is not None and self.runs(index) else None

    def transfer(self, index: int, tensor: torch.Tensor) -> Transfer:
        """A tensor of local microbatch ``index`` to send."""
        return Transfer(self.keys[index], self.microbatches[index].tokens, tensor)

    def expect(self, index: int) -> Expect:
        """A tensor of local microbatch ``index`` to receive."""
        return Expect(self.keys[index], self.microbatches[index].tokens)


class StageEngine:
    """Runs programs on one stage.

    Args:
        layout: The process's place and groups.
        stage: The stage's model.
        link: Transfers with the neighbour stages.
        data: Every job's training data (to pack microbatches and count loss denominators).
        optimizers: Each adapter's optimizer on this stage.
        on_step: Called after every step (logging); optional.
        on_backward: Called with a microbatch's program index after its backward on this stage
            (progress); optional.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        stage: StageModel,
        link: StageLink,
        data: Mapping[str, JobData],
        optimizers: Mapping[str, StageOptimizer],
        on_step: Callable[[StepRecord], None] | None = None,
        on_backward: Callable[[int], None] | None = None,
    ) -> None:
        self.layout = layout
        self.stage = stage
        self.link = link
        self.data = data
        self.optimizers = optimizers
        self.on_step = on_step
        self.on_backward = on_backward
        self._denominators: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}
        self._steps_done = dict.fromkeys(optimizers, 0)
        self._unfinished: dict[str, float | None] = {}
        """Adapters whose step was begun and not finished, with the loss of their global batch."""
        self.stats = EngineStats(stage=layout.stage, replica=layout.replica)
        self._origin: float | None = None
        """Host clock at the start of the first :meth:`execute` (the timeline's zero)."""
        self.stopped = False
        """Whether the last :meth:`execute` ended early because ``stop`` said so."""

    def _denominator(self, adapter: str, global_batch: int) -> int:
        key = (adapter, global_batch)
        if key not in self._denominators:
            self._denominators[key] = self.data[adapter].global_batch_targets(global_batch)
        return self._denominators[key]

    def execute(
        self,
        program: Program,
        *,
        start: int = 0,
        on_drain: Callable[[int], None] | None = None,
        stop: StopAgreement | None = None,
        heartbeat: Heartbeat = no_heartbeat,
    ) -> int:
        """Run this replica's share of ``program`` from ``start``; measurements go to :attr:`stats`.

        Args:
            program: The runs to execute.
            start: Program index of the first microbatch to run (a resumed run's position); it
                must begin a round of the replicas.
            on_drain: Called with the program index of the next microbatch after every run, when
                the pipeline is empty (checkpoints).
            stop: Posted and read at the steps of every microbatch that has some (every rank at
                the same steps, all getting the same answer). Yes cuts the run (see the module's
                docstring) and returns once the pipeline drained; a yes that arrives only as the
                run ends stops before the next run.
            heartbeat: Told of every action as it starts (what, and whether it waits on the
                neighbours), e.g. :meth:`~lorafusion_megatron.pipeline.stall.StallWatchdog.beat`;
                ``on_drain`` reports its own actions.

        Returns:
            Program index of the next microbatch to run: ``program.num_microbatches`` when the
            program ran to its end, less when ``stop`` stopped it.

        Raises:
            PipelineMismatchError: ``start`` falls inside a round of the replicas.
        """
        begin = time.perf_counter()
        if self._origin is None:
            self._origin = begin
        self.stopped = False
        d = program.data_parallel
        position, offset = program.num_microbatches, 0
        for run in program.runs:
            end = offset + len(run)
            if end <= start:
                offset = end
                continue
            skip = max(0, start - offset)
            if skip % d:
                raise PipelineMismatchError(f"position {start} is inside a round of the {d} replicas, not at its start")
            first = offset + skip + self.layout.replica
            local = list(run[skip + self.layout.replica :: d])
            done = self._run(local, [first + k * d for k in range(len(local))], stop, heartbeat)
            # Runs hold whole rounds, so an uncut run ends exactly at ``end``.
            position, offset = offset + skip + done * d, end
            self._finish_steps(list(self._unfinished))
            if stop is not None and stop.settle():
                self.stopped = True
            if on_drain is not None:
                heartbeat(f"the drain at microbatch {position}")
                self._synchronize()
                on_drain(position)
            if self.stopped:
                break
        self._synchronize()
        self.stats.wall_seconds += time.perf_counter() - begin
        return position

    @property
    def total_steps(self) -> int:
        """Optimizer steps taken so far, all adapters together."""
        return sum(self._steps_done.values())

    def state_dict(self) -> dict[str, Any]:
        """Steps per adapter and the loss sums of unfinished global batches (for checkpoints)."""
        return {
            "steps_done": dict(self._steps_done),
            "pending": [(a, g, float(loss), targets) for (a, g), (loss, targets) in self._pending.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        import torch

        self._steps_done = {name: int(n) for name, n in state["steps_done"].items()}
        self._pending = {
            (a, int(g)): (torch.tensor(loss, device=self.layout.device), int(targets))
            for a, g, loss, targets in state["pending"]
        }

    def _synchronize(self) -> None:
        """Wait for this stage's compute stream (not the whole device: transfers run on their own)."""
        import torch

        if self.layout.device.type == "cuda":
            torch.cuda.current_stream(self.layout.device).synchronize()

    def _run(
        self, microbatches: list[Microbatch], keys: list[int], stop: StopAgreement | None, heartbeat: Heartbeat
    ) -> int:
        """One 1F1B run; returns how many of its microbatches ran (fewer when a stop cut it)."""
        run = _Run(microbatches, keys)
        stages = self.layout.num_stages
        for action in one_f_one_b(len(microbatches), stages, self.layout.stage):
            if isinstance(action, Exchange):
                heartbeat("an exchange with the neighbouring stages (and the steps after it)", waiting=True)
                begin = time.perf_counter()
                self._exchange(action, run)
                self.stats.exchange_seconds += time.perf_counter() - begin
                sent = action.send_backward
                if sent is not None and sent < run.limit and microbatches[sent].step_after:
                    for adapter in microbatches[sent].step_after:
                        self._begin_step(adapter)
                    if not self.stopped and stop is not None:
                        stop.post(sent)
                        if stop.agreed(sent):
                            self.stopped = True
                            run.limit = min(sent + stages, len(microbatches))
            elif not run.runs(action.index):
                continue
            elif action.backward:
                heartbeat(f"the backward of microbatch {keys[action.index]}")
                self._backward(action.index, run)
            else:
                heartbeat(f"the forward of microbatch {keys[action.index]}")
                microbatch = microbatches[action.index]
                self._finish_steps([segment.adapter for segment in microbatch.segments])
                begin = time.perf_counter()
                batch = self._pack(microbatch)
                self.stats.pack_seconds += time.perf_counter() - begin
                run.in_flight[action.index] = self._forward(
                    run.keys[action.index], microbatch, batch, run.received.pop(action.index, None)
                )
                self.stats.tokens += batch.num_tokens
        self.stats.microbatches += run.limit
        return run.limit

    def _exchange(self, action: Exchange, run: _Run) -> None:
        """The transfers of ``action`` this stage has: none across the pipeline's ends or for no-ops."""
        layout = self.layout
        send_f = run.real(action.send_forward) if not layout.is_last else None
        recv_b = run.real(action.recv_backward) if not layout.is_last else None
        send_b = run.real(action.send_backward) if not layout.is_first else None
        recv_f = run.real(action.recv_forward) if not layout.is_first else None
        activations, grads = self.link.exchange(
            send_forward=None if send_f is None else run.transfer(send_f, run.in_flight[send_f].output.detach()),
            recv_backward=None if recv_b is None else run.expect(recv_b),
            send_backward=None if send_b is None else run.transfer(send_b, run.input_grads.pop(send_b)),
            recv_forward=None if recv_f is None else run.expect(recv_f),
        )
        if send_f is not None:
            output = run.in_flight[send_f].output
            if output.requires_grad and output._base is None:
                release_storage(output)
        if activations is not None and recv_f is not None:
            run.received[recv_f] = activations.requires_grad_(True)
        if grads is not None and recv_b is not None:
            run.gradients[recv_b] = grads

    def _pack(self, microbatch: Microbatch) -> PackedBatch:
        from lorafusion_megatron.packing import pack_microbatch

        batch = pack_microbatch(microbatch, self.data).to(self.layout.device)
        if batch.num_tokens != microbatch.tokens:
            raise PipelineMismatchError(
                f"a microbatch packs {batch.num_tokens} tokens but the plan says {microbatch.tokens}: "
                "the plan does not match the data"
            )
        return batch

    def _record(self, key: int, tokens: int, begin: float, *, backward: bool) -> float:
        """Count the action that began at ``begin`` and just ended as busy; returns its seconds."""
        end = time.perf_counter()
        assert self._origin is not None
        self.stats.busy_seconds += end - begin
        self.stats.timeline.append(
            key, backward=backward, tokens=tokens, start=begin - self._origin, end=end - self._origin
        )
        return end - begin

    def _forward(self, key: int, microbatch: Microbatch, batch: PackedBatch, inputs: torch.Tensor | None) -> _InFlight:
        begin = time.perf_counter()
        with drawing_for(microbatch):
            output = self.stage.forward(batch, inputs)
        if self.layout.is_last:
            output = self._objective(microbatch, batch, output)
        self._synchronize()
        seconds = self._record(key, batch.num_tokens, begin, backward=False)
        if self.stats.first_forward_seconds is None:
            self.stats.first_forward_seconds = seconds
        return _InFlight(batch=batch, inputs=inputs, output=output)

    def _objective(self, microbatch: Microbatch, batch: PackedBatch, token_loss: torch.Tensor) -> torch.Tensor:
        """Each segment's loss sum over its adapter's global-batch token count, summed; records the sums.

        The sums stay on the device until the adapter steps (no host synchronisation per microbatch);
        trained-token counts come from the host-side samples.
        """
        objective = token_loss.new_zeros(())
        for span, segment in zip(batch.segments, microbatch.segments, strict=True):
            segment_sum = token_loss[span.start : span.start + span.length].sum()
            objective = objective + segment_sum / self._denominator(span.adapter, span.global_batch)
            job = self.data[segment.adapter]
            targets = sum(job.sample(i).num_targets for i in segment.samples)
            key = (span.adapter, span.global_batch)
            loss, seen = self._pending.get(key, (token_loss.new_zeros(()), 0))
            self._pending[key] = (loss + segment_sum.detach(), seen + targets)
        return objective

    def _backward(self, index: int, run: _Run) -> None:
        import torch

        flight = run.in_flight.pop(index)
        begin = time.perf_counter()
        if self.layout.is_last:
            flight.output.backward()  # type: ignore[no-untyped-call]
        elif flight.output.requires_grad:
            # The output's storage was released when it was sent: no shape check on the way in.
            backward_from(flight.output, run.gradients.pop(index))
        else:
            run.gradients.pop(index)
        if not self.layout.is_first:
            assert flight.inputs is not None
            grad = flight.inputs.grad
            run.input_grads[index] = grad if grad is not None else torch.zeros_like(flight.inputs)
        self._synchronize()
        self._record(run.keys[index], flight.batch.num_tokens, begin, backward=True)
        if self.on_backward is not None:
            self.on_backward(run.keys[index])

    def _begin_step(self, adapter: str) -> None:
        """The first half of ``adapter``'s step (its global batch's loss on the last stage, the norm posted).

        A replica that ran no microbatch of the adapter since its last step finishes that one first.
        """
        self._finish_steps([adapter])
        begin = time.perf_counter()
        global_batch = self._steps_done[adapter]
        loss = self._global_batch_loss(adapter, global_batch) if self.layout.is_last else None
        self.optimizers[adapter].begin_step()
        self._unfinished[adapter] = loss
        self.stats.step_seconds += time.perf_counter() - begin

    def _finish_steps(self, adapters: list[str]) -> None:
        """The second half of the begun steps of ``adapters`` (others are skipped), in step order."""
        for adapter in [a for a in self._unfinished if a in adapters]:
            begin = time.perf_counter()
            loss = self._unfinished.pop(adapter)
            optimizer = self.optimizers[adapter]
            stats = optimizer.finish_step()
            self._synchronize()
            self.stats.step_seconds += time.perf_counter() - begin
            self.stats.norm_wait_seconds += optimizer.norm_wait_seconds
            self._steps_done[adapter] = stats.step
            record = StepRecord(
                adapter=adapter,
                step=stats.step,
                learning_rate=stats.learning_rate,
                grad_norm=stats.grad_norm,
                loss=loss,
            )
            self.stats.steps.append(record)
            if self.on_step is not None:
                self.on_step(record)

    def _global_batch_loss(self, adapter: str, global_batch: int) -> float:
        """Mean loss of the finished global batch over all replicas; checks every trained token was seen."""
        import torch
        import torch.distributed as dist

        pending, targets = self._pending.pop((adapter, global_batch), (None, 0))
        loss = 0.0 if pending is None else float(pending)
        if self.layout.num_replicas > 1:
            both = torch.tensor([loss, float(targets)], dtype=torch.float64, device=self.layout.device)
            dist.all_reduce(both, group=self.layout.data_group)
            loss, targets = float(both[0]), round(float(both[1]))
        expected = self._denominator(adapter, global_batch)
        if targets != expected:
            raise PipelineMismatchError(
                f"{adapter} steps after {targets} of the {expected} trained tokens of its global batch {global_batch}: "
                "the plan does not match the data"
            )
        return loss / expected
