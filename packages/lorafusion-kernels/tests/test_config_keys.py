"""The ops look each kernel's config up under :func:`config_key`, the key the tuner writes its entries under."""

from __future__ import annotations

import pytest
import torch

from lorafusion_kernels import fused_lora_linear, fused_multi_lora_linear, fused_multi_lora_siblings
from lorafusion_kernels._kernels import _common
from lorafusion_kernels._kernels._common import interpreting
from lorafusion_kernels.tuning import ShapeKey
from lorafusion_kernels.tuning.config import dtype_name
from lorafusion_kernels.tuning.launches import MULTI_ADAPTER_KERNELS, SINGLE_ADAPTER_KERNELS, LayerProblem, config_key

pytestmark = pytest.mark.interpret

TOKENS, K, RANK = 37, 40, 8


def looked_up(monkeypatch: pytest.MonkeyPatch, run) -> dict[str, ShapeKey]:
    """``kernel -> key`` of every config lookup while ``run()`` runs forward and backward."""
    calls: dict[str, ShapeKey] = {}
    lookup = _common.launch_lookup

    def recording(kernel, m, n, k, r, dtype, device):
        calls[kernel] = ShapeKey(m=m, n=n, k=k, r=r, dtype=dtype_name(dtype))
        return lookup(kernel, m, n, k, r, dtype, device)

    monkeypatch.setattr(_common, "launch_lookup", recording)
    run().sum().backward()
    return calls


@pytest.mark.parametrize("n", [48, 24], ids=["k<=n", "k>n"])
@pytest.mark.parametrize("adapters", [1, 2])
def test_ops_look_up_the_keys_the_tuner_writes(monkeypatch, n, adapters):
    if not interpreting():
        pytest.skip("set TRITON_INTERPRET=1 before starting pytest to run the kernels on CPU")
    torch.manual_seed(0)
    x = torch.randn(TOKENS, K, requires_grad=True)
    weight = torch.randn(n, K)
    a = [torch.randn(RANK, K, requires_grad=True) for _ in range(adapters)]
    b = [torch.randn(n, RANK, requires_grad=True) for _ in range(adapters)]
    if adapters == 1:
        calls = looked_up(monkeypatch, lambda: fused_lora_linear(x, weight, a[0], b[0], scaling=2.0, dropout_p=0.25))
        expected = set(SINGLE_ADAPTER_KERNELS)
    else:
        calls = looked_up(
            monkeypatch,
            lambda: fused_multi_lora_linear(
                x, weight, a, b, segment_lengths=[20, 17], segment_adapters=[0, 1], scaling=2.0, dropout_p=0.25
            ),
        )
        # Where k <= n the dA pass writes dx's LoRA term and cuBLAS adds dy W: no fused dx GEMM.
        expected = set(MULTI_ADAPTER_KERNELS) - ({"multi_dyw_dsa", "multi_dsx"} if n >= K else {"multi_dsx_dx"})
    assert set(calls) == expected
    problem = LayerProblem(m=TOKENS, n=n, k=K, r=RANK, dtype=torch.float32, p=0.25, adapters=adapters, device="cpu")
    for kernel, key in calls.items():
        assert key == config_key(kernel, problem), kernel


def test_sibling_calls_look_up_the_stacked_rank_for_the_x_passes(monkeypatch):
    """A sibling group of G members runs the shrink and the dA pass on the members' stacked A's
    (rank G r): to the config files that is a layer of rank G r. The GEMMs and the dy pass see the
    stacked layer with each member's rank."""
    if not interpreting():
        pytest.skip("set TRITON_INTERPRET=1 before starting pytest to run the kernels on CPU")
    torch.manual_seed(0)
    widths = [48, 16, 16]
    x = torch.randn(TOKENS, K, requires_grad=True)
    weight = torch.randn(sum(widths), K)
    a = [[torch.randn(RANK, K, requires_grad=True) for _ in widths] for _ in range(2)]
    b = [[torch.randn(n, RANK, requires_grad=True) for n in widths] for _ in range(2)]

    def run() -> torch.Tensor:
        outputs = fused_multi_lora_siblings(
            x, weight, a, b, out_features=widths, segment_lengths=[20, 17], segment_adapters=[0, 1],
            scaling=2.0, dropout_p=0.25,
        )  # fmt: skip
        return torch.cat([y.flatten() for y in outputs])

    calls = looked_up(monkeypatch, run)
    # The dA pass writes dx's LoRA term where the members' gradients come side by side (here: the
    # outputs are views of one tensor); on sm_90 with each member's output apart, it does not.
    (da_kernel,) = set(calls) & {"multi_dsx", "multi_dsx_dx"}
    assert set(calls) == {"multi_xa", "multi_xw_sb", "multi_dys_dyb", da_kernel}
    for kernel, key in calls.items():
        rank = RANK * len(widths) if kernel in ("multi_xa", da_kernel) else RANK
        problem = LayerProblem(
            m=TOKENS, n=sum(widths), k=K, r=rank, dtype=torch.float32, p=0.25, adapters=2, device="cpu"
        )
        assert key == config_key(kernel, problem), kernel
