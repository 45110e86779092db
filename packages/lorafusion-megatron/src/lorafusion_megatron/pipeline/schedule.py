"""The non-interleaved 1F1B order of one stage as a list of actions (torch-free).

For ``N`` microbatches on ``S`` stages, stage ``s`` runs ``w = min(S - 1 - s, N)`` warm-up
forwards, then alternates one forward and one backward, then drains the last ``w`` backwards.
Communication with the neighbours is part of the list, paired as Megatron-LM pairs it (a send
towards one neighbour posted together with the receive expected from the other), which keeps every
pair of adjacent stages in lockstep without deadlock::

    warm-up    recv F(i) | fwd i | send F(i)
    steady     fwd i | send F(i) + recv B(j) | bwd j | send B(j) + recv F(i + 1)
    cool-down  recv B(j) | bwd j | send B(j)

Each :class:`Exchange` lists every transfer the position could hold; the engine drops those a
stage does not have (no receive of activations on the first stage, no send on the last) and those
of no-op microbatches, which exchange nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "Compute", "Exchange", "one_f_one_b"]


@dataclass(frozen=True)
class Compute:
    """Forward (``backward = False``) or backward of local microbatch ``index``."""

    index: int
    backward: bool


@dataclass(frozen=True)
class Exchange:
    """Transfers posted together: local microbatch indices, ``None`` where the slot is unused.

    Attributes:
        send_forward: Activations of this microbatch go to the next stage.
        recv_backward: Gradients of this microbatch come from the next stage.
        send_backward: Input gradients of this microbatch go to the previous stage.
        recv_forward: Activations of this microbatch come from the previous stage.
    """

    send_forward: int | None = None
    recv_backward: int | None = None
    send_backward: int | None = None
    recv_forward: int | None = None


Action = Compute | Exchange


def one_f_one_b(num_microbatches: int, stages: int, stage: int) -> list[Action]:
    """The 1F1B actions of ``stage`` for microbatches ``0 .. num_microbatches - 1``.

    Args:
        num_microbatches: ``N`` (no-ops included: they keep their slot).
        stages: ``S``.
        stage: ``s``.

    Returns:
        Actions in execution order; every forward and backward appears exactly once, backwards in
        microbatch order.
    """
    n = num_microbatches
    warmup = min(stages - 1 - stage, n)
    remaining = n - warmup
    actions: list[Action] = []
    for i in range(warmup):
        actions += [Exchange(recv_forward=i), Compute(i, backward=False), Exchange(send_forward=i)]
    if remaining:
        actions.append(Exchange(recv_forward=warmup))
    for k in range(remaining):
        i = warmup + k
        actions += [Compute(i, backward=False), Exchange(send_forward=i, recv_backward=k), Compute(k, backward=True)]
        last = k == remaining - 1
        actions.append(Exchange(send_backward=k, recv_forward=None if last else i + 1))
    for j in range(remaining, n):
        actions += [Exchange(recv_backward=j), Compute(j, backward=True), Exchange(send_backward=j)]
    return actions
