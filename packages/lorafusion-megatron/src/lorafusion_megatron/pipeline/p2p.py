"""Point-to-point exchange of variable-length activations and gradients between adjacent stages.

megatron-core's p2p helpers allocate on CUDA unconditionally, so the runtime owns its transfers:
``torch.distributed.batch_isend_irecv`` on the pipeline group, the same code on gloo (CPU) and
NCCL (GPU). Every rank knows from the plan how many tokens microbatch ``i`` holds, so buffers are
allocated from the plan, never from a shape message; a small header ``[microbatch, tokens]``
travels with every tensor and is checked on arrival, so a rank that fell out of step with its
neighbour raises an error naming the microbatch instead of reading someone else's activations.
No-op microbatches exchange nothing at all (both sides know it from the plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorafusion_megatron.host_copy import to_device

if TYPE_CHECKING:
    import torch

    from lorafusion_megatron.pipeline.groups import Layout

__all__ = ["Expect", "PipelineMismatchError", "StageLink", "Transfer"]


class PipelineMismatchError(RuntimeError):
    """A tensor's shape or identity differs from what the plan says (a bug, not a user error)."""


@dataclass(frozen=True)
class Transfer:
    """A tensor ``[1, tokens, hidden]`` of plan microbatch ``microbatch`` to send."""

    microbatch: int
    tokens: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Expect:
    """A tensor of plan microbatch ``microbatch`` with ``tokens`` tokens to receive."""

    microbatch: int
    tokens: int


class StageLink:
    """This stage's transfers with its neighbours in the pipeline.

    Args:
        layout: The process's place (neighbour ranks, pipeline group, device).
        hidden_size: Width of the activations.
        dtype: Dtype of activations and gradients.
    """

    def __init__(self, layout: Layout, hidden_size: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self.hidden_size = hidden_size
        self.dtype = dtype

    def _check_send(self, transfer: Transfer, what: str) -> None:
        want = (1, transfer.tokens, self.hidden_size)
        if tuple(transfer.tensor.shape) != want or transfer.tensor.dtype != self.dtype:
            raise PipelineMismatchError(
                f"stage {self.layout.stage}: {what} of microbatch {transfer.microbatch} has shape "
                f"{list(transfer.tensor.shape)} ({transfer.tensor.dtype}); the plan says {list(want)} ({self.dtype})"
            )

    def exchange(
        self,
        *,
        send_forward: Transfer | None = None,
        recv_backward: Expect | None = None,
        send_backward: Transfer | None = None,
        recv_forward: Expect | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Post the given transfers together and wait for all of them.

        Args:
            send_forward: Activations for the next stage.
            recv_backward: Gradients expected from the next stage.
            send_backward: Input gradients for the previous stage.
            recv_forward: Activations expected from the previous stage.

        Returns:
            ``(activations received, gradients received)``, ``None`` where nothing was expected.

        Raises:
            PipelineMismatchError: A tensor to send or a received header differs from the plan.
        """
        import torch
        import torch.distributed as dist

        layout = self.layout
        ops: list[dist.P2POp] = []
        arrivals: list[tuple[Expect, torch.Tensor, torch.Tensor, str]] = []

        def send(transfer: Transfer, peer: int | None, what: str) -> None:
            assert peer is not None, f"stage {layout.stage} has no neighbour to send {what} to"
            self._check_send(transfer, what)
            header = to_device(torch.tensor([transfer.microbatch, transfer.tokens], dtype=torch.int64), layout.device)
            payload = transfer.tensor.contiguous()
            ops.append(dist.P2POp(dist.isend, header, peer, layout.pipeline_group))
            ops.append(dist.P2POp(dist.isend, payload, peer, layout.pipeline_group))

        def receive(expect: Expect, peer: int | None, what: str) -> torch.Tensor:
            assert peer is not None, f"stage {layout.stage} has no neighbour to receive {what} from"
            header = torch.empty(2, dtype=torch.int64, device=layout.device)
            payload = torch.empty((1, expect.tokens, self.hidden_size), dtype=self.dtype, device=layout.device)
            ops.append(dist.P2POp(dist.irecv, header, peer, layout.pipeline_group))
            ops.append(dist.P2POp(dist.irecv, payload, peer, layout.pipeline_group))
            arrivals.append((expect, header, payload, what))
            return payload

        if send_forward is not None:
            send(send_forward, layout.next_rank, "activations")
        activations = receive(recv_forward, layout.prev_rank, "activations") if recv_forward is not None else None
        if send_backward is not None:
            send(send_backward, layout.prev_rank, "gradients")
        gradients = receive(recv_backward, layout.next_rank, "gradients") if recv_backward is not None else None
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for expect, header, _payload, what in arrivals:
            got = [int(v) for v in header.tolist()]
            if got != [expect.microbatch, expect.tokens]:
                raise PipelineMismatchError(
                    f"stage {layout.stage} expected {what} of microbatch {expect.microbatch} ({expect.tokens} tokens) "
                    f"and received those of microbatch {got[0]} ({got[1]} tokens): the stages disagree on the plan"
                )
        return activations, gradients
