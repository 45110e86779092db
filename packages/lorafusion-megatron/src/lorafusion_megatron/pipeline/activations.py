"""Free a stage's output activations once they are sent, and run the backward through them anyway.

A stage that is not the last keeps each in-flight microbatch's output ``y = f(x)``, ``[1, T, hidden]``,
only as the root of the autograd graph that its backward starts from: once ``y`` went to the next
stage, its values are never read again (the decoder layer's last operation is the residual add,
whose backward needs no saved input or output). Megatron-LM's ``deallocate_output_tensor`` frees
that storage; so does :func:`release_storage`, replacing ``y``'s data by one element. The saving
per stage is ``T * hidden * bytes`` for each of the up to ``S - s`` microbatches stage ``s`` holds
between forward and backward.

The backward then cannot go through :func:`torch.autograd.backward`, which checks that the
incoming gradient ``dL/dy`` has ``y``'s shape (now ``[1]``); :func:`backward_from` hands ``(y,
dL/dy)`` to the autograd engine directly, as Megatron-LM does, which is what
:func:`torch.autograd.backward` does after its check, so the gradients are bit for bit the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["backward_from", "release_storage"]


def release_storage(tensor: torch.Tensor) -> None:
    """Replace ``tensor``'s data by a one-element placeholder, keeping its place in the autograd graph.

    Only for a tensor that owns its storage (a view shares it with its base, so nothing would be
    freed) and whose values no backward reads.

    Raises:
        ValueError: ``tensor`` is a view of another tensor.
    """
    import torch

    if tensor._base is not None:
        raise ValueError("release_storage: the tensor is a view; freeing it would free nothing")
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate ``d(grad . output)/d(leaves)`` into the leaves' ``.grad`` (``output`` may be released).

    Args:
        output: The root of the graph, ``[1, T, hidden]`` when computed (its storage may have been
            replaced by :func:`release_storage`).
        grad: ``dL/d output``, ``[1, T, hidden]``.
    """
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
