"""The ops look each kernel's config up under :func:`config_key`, the key the tuner writes its entries under."""

from __future__ import annotations

import pytest
import torch

from lorafusion_kernels import fused_lora_linear, fused_multi_lora_linear
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
        expected = set(MULTI_ADAPTER_KERNELS) - ({"multi_dyw_dsa"} if n >= K else set())
    assert set(calls) == expected
    problem = LayerProblem(m=TOKENS, n=n, k=K, r=RANK, dtype=torch.float32, p=0.25, adapters=adapters, device="cpu")
    for kernel, key in calls.items():
        assert key == config_key(kernel, problem), kernel
