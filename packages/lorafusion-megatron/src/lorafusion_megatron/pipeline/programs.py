"""What the pipeline executes: the plan, or one of the paper's baselines, as runs of microbatches (torch-free).

A :class:`Program` is a sequence of runs; each run is one 1F1B pipeline (the engine flushes the
pipeline between runs) over microbatches in the plan's own format, so one engine executes all three:

* ``lorafusion``: the plan itself, one continuous run (its bubble lemma makes flushes unnecessary);
* ``megatron-1f1b``: each adapter alone in turn, each global batch cut in order into microbatches
  of a fixed number of samples, one run (so one flush) per global batch, as Megatron-LM trains;
* ``mlora``: for each global-batch index, adapters round-robin, fixed samples per microbatch (one
  adapter per microbatch, no token balancing), one continuous run with the no-ops the bubble lemma
  needs, as mLoRA does.

With ``d`` data-parallel replicas, microbatch ``i`` of a run goes to replica ``i % d`` and every
run holds a whole number of rounds; an adapter steps after the last round of its global batch on
every replica (``step_after``), so its gradient all-reduce lines up across replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.pipeline.options import Schedule

if TYPE_CHECKING:
    from lorafusion_sched.models import Microbatch, Plan

__all__ = ["Program", "build_program", "megatron_program", "mlora_program", "split_for_checkpoints"]


@dataclass(frozen=True)
class Program:
    """Runs of microbatches, each a 1F1B pipeline with a flush after it.

    Attributes:
        name: The schedule (``lorafusion``, ``megatron-1f1b`` or ``mlora``).
        runs: Microbatches of each run in global order (replica ``i % d``).
        data_parallel: ``d``.
    """

    name: str
    runs: tuple[tuple[Microbatch, ...], ...]
    data_parallel: int

    @property
    def num_microbatches(self) -> int:
        """Microbatches of all runs, no-ops included."""
        return sum(len(run) for run in self.runs)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _chunks(plan: Plan, adapter: int, global_batch: int, per_microbatch: int) -> list[Microbatch]:
    """Global batch ``global_batch`` of an adapter cut in order into single-segment microbatches."""
    from lorafusion_sched.models import Microbatch, Segment

    info = plan.adapters[adapter]
    first = global_batch * info.global_batch_size
    samples = list(range(first, min(first + info.global_batch_size, len(info.sample_tokens))))
    out = []
    for i in range(0, len(samples), per_microbatch):
        chunk = tuple(samples[i : i + per_microbatch])
        tokens = sum(info.sample_tokens[s] for s in chunk)
        segment = Segment(
            adapter=info.name,
            global_batch=global_batch,
            samples=chunk,
            tokens=tokens,
            padded_tokens=_round_up(tokens, plan.padding_multiple),
        )
        out.append(Microbatch(segments=(segment,)))
    return out


def _samples_per_microbatch(plan: Plan, samples: int | None) -> dict[str, int]:
    from lorafusion_sched.simulate import baseline_microbatch_samples

    if samples is not None:
        return {a.name: samples for a in plan.adapters}
    return baseline_microbatch_samples(plan)


def _with_steps(sequence: Sequence[Microbatch | None], replicas: int) -> tuple[Microbatch, ...]:
    """Fill no-ops, set ``replica`` and put ``step_after`` on every microbatch of an adapter's last round."""
    from lorafusion_sched.models import Microbatch

    last_round: dict[tuple[str, int], int] = {}
    for i, mb in enumerate(sequence):
        for seg in mb.segments if mb is not None else ():
            last_round[(seg.adapter, seg.global_batch)] = i // replicas
    steps: dict[int, set[str]] = {}
    for (adapter, _batch), round_ in last_round.items():
        steps.setdefault(round_, set()).add(adapter)
    out = []
    for i, mb in enumerate(sequence):
        base = mb if mb is not None else Microbatch(noop=True)
        out.append(
            base.model_copy(
                update={
                    "step_after": tuple(sorted(steps.get(i // replicas, ()))),
                    "replica": i % replicas if replicas > 1 else None,
                }
            )
        )
    return tuple(out)


def megatron_program(plan: Plan, samples_per_microbatch: int | None = None) -> Program:
    """Each adapter alone in turn, one flushed 1F1B run per global batch.

    Args:
        plan: The plan (its adapters carry the sample lengths and global batch sizes).
        samples_per_microbatch: Fixed samples per microbatch; default per adapter: the most whose
            mean padded length fits the plan's capacity.
    """
    per_mb = _samples_per_microbatch(plan, samples_per_microbatch)
    d = plan.data_parallel
    runs = []
    for a, info in enumerate(plan.adapters):
        for g in range(info.num_global_batches):
            chunks: list[Microbatch | None] = list(_chunks(plan, a, g, per_mb[info.name]))
            chunks += [None] * (-len(chunks) % d)
            runs.append(_with_steps(chunks, d))
    return Program(name="megatron-1f1b", runs=tuple(runs), data_parallel=d)


def mlora_program(plan: Plan, samples_per_microbatch: int | None = None) -> Program:
    """Adapters round-robin per global-batch index, one adapter per microbatch, one continuous run.

    Args:
        plan: The plan (its adapters carry the sample lengths and global batch sizes).
        samples_per_microbatch: As for :func:`megatron_program`.
    """
    from lorafusion_sched.sequence import Slot, insert_noops

    per_mb = _samples_per_microbatch(plan, samples_per_microbatch)
    d = plan.data_parallel
    microbatches: list[Microbatch] = []
    slots: list[Slot] = []
    for g in range(max(a.num_global_batches for a in plan.adapters)):
        for a, info in enumerate(plan.adapters):
            if g < info.num_global_batches:
                for mb in _chunks(plan, a, g, per_mb[info.name]):
                    slots.append({a: (g, list(mb.segments[0].samples))})
                    microbatches.append(mb)
    order = insert_noops(slots, plan.pipeline_stages, d)
    sequence = [None if i is None else microbatches[i] for i in order]
    return Program(name="mlora", runs=(_with_steps(sequence, d),), data_parallel=d)


def build_program(plan: Plan, schedule: Schedule, samples_per_microbatch: int | None = None) -> Program:
    """The program of ``schedule`` for the jobs of ``plan``.

    Raises:
        TrainerError: An unknown schedule.
    """
    if schedule == "lorafusion":
        return Program(name="lorafusion", runs=(plan.microbatches,), data_parallel=plan.data_parallel)
    if schedule == "megatron-1f1b":
        return megatron_program(plan, samples_per_microbatch)
    if schedule == "mlora":
        return mlora_program(plan, samples_per_microbatch)
    raise TrainerError(f"parallel.schedule = {schedule!r} is unknown: use lorafusion, megatron-1f1b or mlora")


def split_for_checkpoints(program: Program, save_steps: int) -> Program:
    """Cut runs after each round where the optimizer steps (all adapters) reach a multiple of ``save_steps``.

    The pipeline drains at every cut, so a checkpoint can be taken there; the steps and their order
    are unchanged (a cut never falls between a global batch's microbatches and its step).
    """
    d = program.data_parallel
    runs: list[tuple[Microbatch, ...]] = []
    steps = 0
    for run in program.runs:
        begin = 0
        for round_start in range(0, len(run), d):
            before = steps
            steps += len(run[round_start].step_after)
            end = round_start + d
            if steps // save_steps > before // save_steps and end < len(run):
                runs.append(run[begin:end])
                begin = end
        runs.append(run[begin:])
    return Program(name=program.name, runs=tuple(runs), data_parallel=d)
