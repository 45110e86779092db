"""GPU (marker ``gpu``): microbatches of new lengths compile no new kernel variants.

A training run's microbatches vary in length. A Triton kernel compiled for one token count must
serve the others: a compilation in the middle of a run stalls it (0.5 to 2.5 s on an H200, and in
a pipeline every stage waits). Triton's JIT hook reports each compilation with its specialisation
key, so a failure names what differed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lorafusion_kernels import fused_lora_linear, fused_multi_lora_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning"),
]

N, K, R = 1024, 512, 16


@pytest.fixture
def compilations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names and keys of the kernels Triton compiles (or loads from its disk cache) in this process from now on."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no JIT compile hook")
    seen: list[str] = []

    def hook(**kwargs: Any) -> None:
        seen.append(f"{str(kwargs.get('repr', '?')).split('[', 1)[0]} {kwargs.get('key')}")

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    return seen


def _single(tokens: int, bias: bool) -> None:
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    a = (torch.randn(R, K, device="cuda", dtype=torch.bfloat16) / K**0.5).requires_grad_()
    b = (torch.randn(N, R, device="cuda", dtype=torch.bfloat16) / R**0.5).requires_grad_()
    x.requires_grad_()
    bias_tensor = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
    y = fused_lora_linear(x, weight, a, b, scaling=2.0, dropout_p=0.1, bias=bias_tensor, seed=3)
    y.sum().backward()


def _multi(lengths: list[int], bias: bool) -> None:
    tokens = sum(lengths)
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    a = [(torch.randn(R, K, device="cuda", dtype=torch.bfloat16) / K**0.5).requires_grad_() for _ in range(3)]
    b = [(torch.randn(N, R, device="cuda", dtype=torch.bfloat16) / R**0.5).requires_grad_() for _ in range(3)]
    bias_tensor = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
    adapters = [i % 3 for i in range(len(lengths))]
    y = fused_multi_lora_linear(
        x, weight, a, b, segment_lengths=lengths, segment_adapters=adapters, scaling=2.0, dropout_p=0.1,
        bias=bias_tensor, seed=3,
    )  # fmt: skip
    y.sum().backward()


# Pairs of sizes with the same number of tiles for every block size from 16 to 256 (so the same
# launch decisions, e.g. how a reduction is split, which legitimately selects another variant);
# the second of each pair is divisible by 16 (or is 1), the specialisations Triton makes by default.
# The last multi-adapter pair flips the GEMMs' layout constexpr (ONE_SEGMENT): every row tile of the
# first straddles a segment boundary, none of the second does.
SINGLE = [(3, 1), (15, 16), (1007, 1008), (3999, 4000)]
MULTI = [([3, 5], [3, 13]), ([500, 507], [500, 508]), ([2000, 1999], [2000, 2000]), ([255, 129], [256, 128])]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_token_counts_divisible_by_16_compile_nothing_new(compilations: list[str], bias: bool) -> None:
    for tokens, _ in SINGLE:
        _single(tokens, bias)
    for lengths, _ in MULTI:
        _multi(lengths, bias)
    torch.cuda.synchronize()
    warmed = len(compilations)  # none if earlier tests compiled the same variants
    for _, tokens in SINGLE:
        _single(tokens, bias)
    for _, lengths in MULTI:
        _multi(lengths, bias)
    torch.cuda.synchronize()
    assert compilations[warmed:] == []
