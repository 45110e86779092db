"""What ``lorafusion-tune`` sweeps: the real layer shapes and the candidate configs per kernel."""

from __future__ import annotations

from lorafusion_kernels.tuning.config import KernelConfig

SEARCH_SPACE_ID = "v6"
"""Recorded in each file's provenance; bump it when the candidates below change (v2: the multi_* kernels;
v3: 256-row tiles for the skinny passes; v4: multi_dsx_dx, the dA pass that writes dx's LoRA term; v5:
the dS/dB pass's own candidates, for its loop over the rows of a column block; v6: 2-stage wide GEMM
tiles, for rank tile 128)."""

MODEL_LAYERS: dict[str, list[tuple[str, int, int]]] = {
    # (layer, n = out_features, k = in_features); q/k/v fused into one qkv projection as LoRAFusion does.
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 14336, 4096), ("down", 4096, 14336)],
    "qwen2.5-32b": [("qkv", 7168, 5120), ("o", 5120, 5120), ("gate_up", 27648, 5120), ("down", 5120, 27648)],
    "llama-3.1-70b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 28672, 8192), ("down", 8192, 28672)],
}
M_VALUES = [1024, 2048, 4096, 8192, 16384]
RANKS = [16, 32, 64, 128]


def _gemm(bm: int, bn: int, bk: int, warps: int, stages: int, tma: bool) -> KernelConfig:
    return KernelConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=warps, num_stages=stages, tma=tma)


_GEMM = [
    _gemm(bm, bn, bk, warps, stages, tma)
    for tma in (False, True)
    for bm, bn, bk, warps, stages in [
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 5),
        (64, 256, 64, 4, 4),
        # At rank tile 128 the LoRA operands leave room for two stages of the wide tiles only.
        (128, 256, 64, 8, 2),
        (256, 128, 64, 8, 2),
    ]
]

_SHRINK = [
    KernelConfig(block_m=bm, block_n=16, block_k=bk, split=0, num_warps=4, num_stages=4)
    for bm in (32, 64, 128)
    for bk in (64, 128, 256)
]
_SKINNY = [
    *(
        KernelConfig(block_m=bm, block_n=bn, block_k=16, split=0, num_warps=4, num_stages=3)
        for bm in (32, 64, 128)
        for bn in (64, 128, 256)
    ),
    *(KernelConfig(block_m=256, block_n=bn, block_k=16, split=0, num_warps=8, num_stages=3) for bn in (32, 64)),
]
# The dS/dB pass: a program walks the rows of one column block, so wide blocks and short row steps
# (the best tiles of a scratch sweep over 64 on H100, 2026-11-26; 128 x 256 ran out of shared memory at r = 64).
_DY = [
    KernelConfig(block_m=bm, block_n=bn, block_k=16, split=0, num_warps=warps, num_stages=stages)
    for bm, bn in ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128))
    for warps in (4, 8)
    for stages in (2, 3)
]

CANDIDATES: dict[str, list[KernelConfig]] = {
    "xa": _SHRINK,
    "xw_sb": _GEMM,
    "dys_dyb": _DY,
    "dsx": _SKINNY,
    "dyw_dsa": _GEMM,
    # FusedMultiLoRA's kernels tile as FusedLoRA's (only the rank-r term is routed per segment).
    "multi_xa": _SHRINK,
    "multi_xw_sb": _GEMM,
    "multi_dys_dyb": _DY,
    "multi_dsx": _SKINNY,
    "multi_dsx_dx": _SKINNY,
    "multi_dyw_dsa": _GEMM,
}
"""Candidates per kernel; ``split=0`` lets the launcher size the split to the GPU."""

MULTI_ADAPTERS = 4
"""Adapters in the microbatch the FusedMultiLoRA kernels are timed on (the tokens split evenly)."""
