"""The dropout RNG: the Triton tile function and the torch mirror agree bit for bit; the mask is unbiased."""

from __future__ import annotations

import math

import pytest
import torch

from lorafusion_kernels._kernels._common import interpreting
from lorafusion_kernels._kernels.dropout import dropout_keep_mask_triton
from lorafusion_kernels.dropout import dropout_keep_mask, keep_threshold, seed_tensor
from lorafusion_kernels.errors import LoRAFusionKernelsError

pytestmark = pytest.mark.interpret


@pytest.mark.skipif(not interpreting(), reason="the Triton RNG runs on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    ("seed", "m", "k", "p", "row_offset"),
    [(0, 37, 45, 0.1, 0), (123, 64, 130, 0.5, 3), (2**40 + 7, 5, 9, 0.9, 1000), (2**62 - 1, 33, 64, 0.25, 0)],
    ids=["seed0", "seed123-offset3", "seed2^40-offset1000", "seed2^62"],
)
def test_triton_mask_equals_torch_mirror(seed, m, k, p, row_offset):
    triton_mask = dropout_keep_mask_triton(seed_tensor(seed, "cpu"), m, k, keep_threshold(p), row_offset)
    torch_mask = dropout_keep_mask(seed, m, k, p, row_offset=row_offset)
    assert torch.equal(triton_mask, torch_mask)


def test_mask_statistics():
    m, k, p = 256, 512, 0.3
    keep = dropout_keep_mask(2024, m, k, p).float()
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    # No structure along rows, columns or the eight lanes of one Philox call (columns 8j + t).
    for dim in (0, 1):
        means = keep.mean(dim=dim)
        assert (means - (1 - p)).abs().max().item() < 6 * math.sqrt(p * (1 - p) / keep.shape[dim])
    lanes = keep.reshape(m, k // 8, 8).mean(dim=(0, 1))
    assert (lanes - (1 - p)).abs().max().item() < 5 * math.sqrt(p * (1 - p) / (n / 8))
    # Neighbouring elements are uncorrelated.
    centred = keep - keep.mean()
    for a, b in ((centred[:, 1:], centred[:, :-1]), (centred[1:], centred[:-1])):
        corr = (a * b).mean() / centred.var()
        assert abs(corr.item()) < 5 / math.sqrt(n)


def test_seed_and_row_offset_select_independent_masks():
    a = dropout_keep_mask(1, 64, 64, 0.5)
    b = dropout_keep_mask(2, 64, 64, 0.5)
    assert 0.4 < (a == b).float().mean().item() < 0.6
    whole = dropout_keep_mask(9, 40, 24, 0.5)
    assert torch.equal(whole[10:], dropout_keep_mask(9, 30, 24, 0.5, row_offset=10))


def test_threshold_and_seed_validation():
    assert keep_threshold(0.0) == 0
    assert keep_threshold(0.1) == math.ceil(0.1 * 2**16)
    with pytest.raises(LoRAFusionKernelsError):
        keep_threshold(1.0)
    with pytest.raises(LoRAFusionKernelsError):
        seed_tensor(-1, "cpu")
