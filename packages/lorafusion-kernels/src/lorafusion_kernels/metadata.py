"""Per-microbatch routing metadata for FusedMultiLoRA (Contract 2: runtime -> kernels).

A multi-adapter microbatch is one packed token sequence ``x [T, K]`` made of consecutive segments;
segment ``j`` holds ``segment_lengths[j]`` tokens of adapter ``segment_adapters[j]``. An adapter may
own several segments and some adapters none. :class:`MultiLoRABatch` is built once per microbatch
(from the host-side lengths the scheduler already has) and reused by every LoRA layer of the model:
all its tables are copied to the device once, and the per-tile tables each kernel needs are derived
from the host lists (no device read-back, so no host synchronisation inside a layer).

Per-adapter rank, scaling and dropout p differ from layer to layer (PEFT's ``rank_pattern`` /
``alpha_pattern``), so they come with each call of the op, never with the batch.

Two tilings of the token dimension are used by the kernels, both without padding and both sized to
the microbatch (no fixed caps, nothing truncated):

* **row tiles** (``cdiv(T, BLOCK_M)`` tiles of consecutive rows, as the frozen GEMM tiles ``x``):
  for each tile the half-open range of segments it overlaps, so the base GEMM is tiled exactly as
  the frozen layer and only the LoRA term of a tile that straddles a boundary loops over segments;
* **segment tiles** (each segment cut into ``cdiv(length, BLOCK_M)`` tiles that never cross a
  segment boundary), ordered by adapter: every such tile has one adapter, which is what the
  rank-``r`` shrink and the ``dB``/``dS`` kernel need.

The per-adapter ``dA`` reduction takes **segment runs** instead: rows of one adapter in one stretch
(neighbouring segments of one adapter merged), cut into runs of at most a given number of rows, so
one program loops over consecutive rows with no table read per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lorafusion_kernels.errors import LoRAFusionKernelsError, ReadOnlyAttributeError
from lorafusion_kernels.integers import integer_or_none

__all__ = ["MultiLoRABatch", "RowTiles", "SegmentRuns", "SegmentTiles", "as_int_list"]


@dataclass(frozen=True, eq=False)
class RowTiles:
    """Row tiling of ``[T, *]`` (tile ``i`` = rows ``[i*block_m, min((i+1)*block_m, T))``).

    Attributes:
        block_m: Rows per tile.
        num_tiles: ``cdiv(T, block_m)``.
        seg_range: int32 ``[num_tiles, 2]`` on the batch's device: the half-open range
            ``[lo, hi)`` of (non-empty) segment indices overlapping each tile.
        max_segments: The most segments one tile overlaps (1: no tile straddles a segment boundary).
    """

    block_m: int
    num_tiles: int
    seg_range: torch.Tensor
    max_segments: int


@dataclass(frozen=True, eq=False)
class SegmentTiles:
    """Tiles that never cross a segment boundary, ordered by adapter then by position.

    Attributes:
        block_m: Rows per tile (the last tile of a segment may be shorter).
        num_tiles: Total tiles, ``sum_j cdiv(len_j, block_m)``.
        tiles: int32 ``[num_tiles, 3]`` on the batch's device: ``(row_start, row_end, adapter)``.
    """

    block_m: int
    num_tiles: int
    tiles: torch.Tensor


@dataclass(frozen=True, eq=False)
class SegmentRuns:
    """Stretches of consecutive rows of one adapter, cut into runs of at most ``max_rows`` rows.

    Attributes:
        max_rows: Longest run.
        num_runs: Number of runs.
        runs: int32 ``[num_runs, 3]`` on the batch's device: ``(row_start, row_end, adapter)``, in
            token order. Neighbouring segments of one adapter are one stretch.
    """

    max_rows: int
    num_runs: int
    runs: torch.Tensor


def as_int_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    """``values`` (a list or iterable of integers, or a 1-D integer tensor) read once into a list.

    Raises:
        LoRAFusionKernelsError: Naming ``name``: not a list (an int, a string), a tensor of another
            shape or dtype, or an entry that is no integer (a float, a bool).
    """
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise LoRAFusionKernelsError(f"{name} must be one-dimensional, got shape {tuple(values.shape)}")
        if values.is_floating_point() or values.is_complex():
            raise LoRAFusionKernelsError(f"{name} must hold integers, got dtype {values.dtype}")
        # A device tensor costs one read-back here, once per microbatch, never inside a layer.
        return [int(v) for v in values.tolist()]
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise LoRAFusionKernelsError(
            f"{name} must be a list of integers or a 1-D integer tensor, got {type(values).__name__} {values!r}"
        )
    out = []
    for v in values:
        number = integer_or_none(v)  # ints, numpy integers and 0-d integer tensors; never 4.0
        if number is None:
            raise LoRAFusionKernelsError(f"{name} must hold integers, got {v!r}")
        out.append(number)
    return out


def _as_num_adapters(value: object) -> int:
    """``num_adapters`` as an int: an integer (a NumPy integer too), never a float, a string or a bool."""
    number = integer_or_none(value)
    if number is None:
        raise LoRAFusionKernelsError(
            f"num_adapters must be an integer (or None for max(segment_adapters) + 1), "
            f"got {type(value).__name__} {value!r}"
        )
    return number


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host table to ``device`` without blocking the host (pinned staging on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class MultiLoRABatch:
    """Segments of one packed multi-adapter microbatch, with device-side routing tables.

    Build it once per microbatch with :meth:`from_segments` and pass it to every layer (directly to
    :func:`lorafusion_kernels.fused_multi_lora_linear` or through
    :func:`lorafusion_kernels.multi_lora_batch`). Empty segments are accepted and ignored.

    A batch is read-only: its routing tables (and the per-tile tables cached as kernels ask for
    them) are derived from the segments when it is built, so assigning a field raises
    :class:`~lorafusion_kernels.errors.ReadOnlyAttributeError` (a :class:`LoRAFusionKernelsError`
    and an ``AttributeError``); build a new batch with :meth:`from_segments` instead. Copies and
    pickles rebuild the batch from its segments.

    Attributes:
        segment_lengths: Host tuple, tokens per segment as given (empty segments included).
        segment_adapters: Host tuple, adapter index per segment as given.
        num_adapters: Number of adapters the op's weight lists must hold at least (itself at least
            ``max(segment_adapters) + 1``; lists may hold more, which own no tokens).
        total_tokens: ``T = sum(segment_lengths)``.
        adapter_tokens: Host tuple, tokens of each adapter ``0 .. num_adapters - 1``.
        device: Where the routing tables live (the device of ``x``).
        segments: int32 ``[S, 3]`` on ``device``: ``(start, length, adapter)`` of the ``S``
            non-empty segments, in token order.
    """

    segment_lengths: tuple[int, ...]
    segment_adapters: tuple[int, ...]
    num_adapters: int
    device: torch.device
    total_tokens: int
    adapter_tokens: tuple[int, ...]
    segments: torch.Tensor
    _starts: tuple[int, ...]
    _row_tiles: dict[int, RowTiles]
    _seg_tiles: dict[int, SegmentTiles]
    _runs: dict[int, SegmentRuns]
    _copies: dict[torch.device, MultiLoRABatch]

    __slots__ = (
        "_copies",
        "_row_tiles",
        "_runs",
        "_seg_tiles",
        "_starts",
        "adapter_tokens",
        "device",
        "num_adapters",
        "segment_adapters",
        "segment_lengths",
        "segments",
        "total_tokens",
    )

    def __init__(
        self,
        segment_lengths: tuple[int, ...],
        segment_adapters: tuple[int, ...],
        num_adapters: int,
        device: torch.device,
    ) -> None:
        starts = [0, *itertools.accumulate(segment_lengths)]
        segment_starts = tuple(starts[:-1])
        tokens = [0] * num_adapters
        for length, adapter in zip(segment_lengths, segment_adapters, strict=True):
            tokens[adapter] += length
        rows = [
            (start, length, adapter)
            for start, length, adapter in zip(segment_starts, segment_lengths, segment_adapters, strict=True)
            if length > 0
        ]
        host = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 3)
        # Set once, here only: __setattr__ refuses every later assignment (the fields are read-only).
        fields: dict[str, object] = {
            "segment_lengths": segment_lengths,
            "segment_adapters": segment_adapters,
            "num_adapters": num_adapters,
            "device": device,
            "total_tokens": starts[-1],
            "_starts": segment_starts,
            "adapter_tokens": tuple(tokens),
            "segments": _to_device(host, device),
            "_row_tiles": {},
            "_seg_tiles": {},
            "_runs": {},
            "_copies": {},
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise _read_only(name)

    def __delattr__(self, name: str) -> None:
        raise _read_only(name)

    def __reduce__(self) -> tuple[type[MultiLoRABatch], tuple[tuple[int, ...], tuple[int, ...], int, torch.device]]:
        # Rebuilt from its segments (copy, deepcopy, pickle): the default would set each slot, which
        # __setattr__ refuses; the tables and caches are derived data.
        return type(self), (self.segment_lengths, self.segment_adapters, self.num_adapters, self.device)

    @classmethod
    def from_segments(
        cls,
        segment_lengths: Sequence[int] | torch.Tensor,
        segment_adapters: Sequence[int] | torch.Tensor,
        *,
        num_adapters: int | None = None,
        device: torch.device | str | None = None,
    ) -> MultiLoRABatch:
        """Build the metadata of one microbatch.

        Args:
            segment_lengths: Tokens per segment, ``>= 0`` (host ints or a 1-D integer tensor).
            segment_adapters: Adapter index per segment, ``>= 0``; an adapter may appear in
                several segments.
            num_adapters: Number of adapters of the op (default ``max(segment_adapters) + 1``);
                adapters without segments are allowed. A call may give more adapters than this:
                those past it own no tokens of this batch.
            device: Device of the activations (default CPU).

        Returns:
            The batch metadata, with its segment table already on ``device``.

        Raises:
            LoRAFusionKernelsError: Mismatched lengths, negative lengths, an adapter index out of range,
                a ``num_adapters`` that is not an integer, or no segments at all.
        """
        lengths = as_int_list(segment_lengths, "segment_lengths")
        adapters = as_int_list(segment_adapters, "segment_adapters")
        if len(lengths) != len(adapters):
            raise LoRAFusionKernelsError(
                f"segment_lengths has {len(lengths)} entries but segment_adapters has {len(adapters)}; "
                "give one adapter index per segment"
            )
        if not lengths:
            raise LoRAFusionKernelsError("a multi-LoRA batch needs at least one segment")
        if any(n < 0 for n in lengths):
            raise LoRAFusionKernelsError(f"segment lengths must be >= 0, got {lengths}")
        if any(a < 0 for a in adapters):
            raise LoRAFusionKernelsError(f"adapter indices must be >= 0, got {adapters}")
        needed = max(adapters) + 1
        num_adapters = needed if num_adapters is None else _as_num_adapters(num_adapters)
        if num_adapters < needed:
            raise LoRAFusionKernelsError(
                f"segment_adapters refers to adapter {needed - 1} but num_adapters={num_adapters}; "
                f"pass num_adapters >= {needed}"
            )
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return cls(tuple(lengths), tuple(adapters), num_adapters, dev)

    @property
    def num_segments(self) -> int:
        """Number of segments as given (empty ones included)."""
        return len(self.segment_lengths)

    @property
    def segment_starts(self) -> tuple[int, ...]:
        """Host tuple: first token of each segment."""
        return self._starts

    @property
    def active_adapters(self) -> tuple[int, ...]:
        """Sorted indices of the adapters that own at least one token."""
        return tuple(a for a, n in enumerate(self.adapter_tokens) if n > 0)

    def single_adapter(self) -> int | None:
        """The adapter index if exactly one adapter owns tokens (the FusedLoRA path), else ``None``."""
        active = self.active_adapters
        return active[0] if len(active) == 1 else None

    def nonempty_segments(self) -> list[tuple[int, int, int]]:
        """Host list of ``(start, length, adapter)`` for the non-empty segments, in token order."""
        return [
            (s, n, a)
            for s, n, a in zip(self._starts, self.segment_lengths, self.segment_adapters, strict=True)
            if n > 0
        ]

    def to(self, device: torch.device | str) -> MultiLoRABatch:
        """The same segments with tables on ``device`` (``self`` if already there).

        The copy is kept: a batch built on the host and passed to every layer of a model on a GPU
        copies its tables once, not once per layer (build it on the activations' device to skip even that).
        """
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev == self.device:
            return self
        if dev not in self._copies:
            self._copies[dev] = MultiLoRABatch(self.segment_lengths, self.segment_adapters, self.num_adapters, dev)
        return self._copies[dev]

    def row_tiles(self, block_m: int) -> RowTiles:
        """Row tiling with ``block_m`` rows per tile (computed on the host once, then cached).

        Args:
            block_m: Rows per tile of the kernel that asks.

        Returns:
            The :class:`RowTiles` for this block size.
        """
        cached = self._row_tiles.get(block_m)
        if cached is not None:
            return cached
        segs = self.nonempty_segments()
        num_tiles = -(-self.total_tokens // block_m)
        ranges = []
        lo = 0
        for i in range(num_tiles):
            row0, row1 = i * block_m, min((i + 1) * block_m, self.total_tokens)
            while segs[lo][0] + segs[lo][1] <= row0:
                lo += 1
            hi = lo
            while hi < len(segs) and segs[hi][0] < row1:
                hi += 1
            ranges.append((lo, hi))
        host = torch.tensor(ranges, dtype=torch.int32).reshape(num_tiles, 2)
        tiles = RowTiles(
            block_m=block_m,
            num_tiles=num_tiles,
            seg_range=_to_device(host, self.device),
            max_segments=max((hi - lo for lo, hi in ranges), default=0),
        )
        self._row_tiles[block_m] = tiles
        return tiles

    def segment_tiles(self, block_m: int) -> SegmentTiles:
        """Segment-aligned tiling with at most ``block_m`` rows per tile, ordered by adapter.

        Args:
            block_m: Rows per tile of the kernel that asks.

        Returns:
            The :class:`SegmentTiles` for this block size.
        """
        cached = self._seg_tiles.get(block_m)
        if cached is not None:
            return cached
        per_adapter: list[list[tuple[int, int, int]]] = [[] for _ in range(self.num_adapters)]
        for start, length, adapter in self.nonempty_segments():
            per_adapter[adapter].extend(
                (row, min(row + block_m, start + length), adapter) for row in range(start, start + length, block_m)
            )
        rows = [t for tiles in per_adapter for t in tiles]
        host_tiles = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 3)
        tiles = SegmentTiles(block_m=block_m, num_tiles=len(rows), tiles=_to_device(host_tiles, self.device))
        self._seg_tiles[block_m] = tiles
        return tiles

    def segment_runs(self, max_rows: int) -> SegmentRuns:
        """Runs of at most ``max_rows`` consecutive rows of one adapter (computed on the host once, then cached).

        Args:
            max_rows: Longest run (``>= 1``).

        Returns:
            The :class:`SegmentRuns` for this length.
        """
        cached = self._runs.get(max_rows)
        if cached is not None:
            return cached
        stretches: list[list[int]] = []
        for start, length, adapter in self.nonempty_segments():
            if stretches and stretches[-1][2] == adapter and stretches[-1][1] == start:
                stretches[-1][1] = start + length
            else:
                stretches.append([start, start + length, adapter])
        rows = [
            (row, min(row + max_rows, end), adapter)
            for start, end, adapter in stretches
            for row in range(start, end, max_rows)
        ]
        host = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 3)
        runs = SegmentRuns(max_rows=max_rows, num_runs=len(rows), runs=_to_device(host, self.device))
        self._runs[max_rows] = runs
        return runs

    def __repr__(self) -> str:
        return (
            f"MultiLoRABatch(total_tokens={self.total_tokens}, num_segments={self.num_segments}, "
            f"num_adapters={self.num_adapters}, device={self.device})"
        )


def _read_only(name: str) -> ReadOnlyAttributeError:
    """The error for an assignment to (or deletion of) attribute ``name`` of a built batch."""
    return ReadOnlyAttributeError(
        f"MultiLoRABatch.{name} is read-only: the batch's device tables were derived from its segments when "
        "it was built, and would not follow a change; build a new batch with "
        "MultiLoRABatch.from_segments(segment_lengths, segment_adapters, num_adapters=..., device=...)"
    )
