"""MultiLoRABatch: validation and the routing tables (host-side, no kernels)."""

from __future__ import annotations

import copy
import itertools
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafusion_kernels.errors import LoRAFusionKernelsError, ReadOnlyAttributeError
from lorafusion_kernels.metadata import MultiLoRABatch


def expected_row_ranges(lengths: list[int], block_m: int) -> list[tuple[int, int]]:
    """Brute force: for each row tile, the non-empty segments holding at least one of its rows."""
    starts, owner = [], []
    for j, n in enumerate(x for x in lengths if x > 0):
        starts.append(len(owner))
        owner.extend([j] * n)
    out = []
    for row0 in range(0, len(owner), block_m):
        rows = owner[row0 : row0 + block_m]
        out.append((min(rows), max(rows) + 1))
    return out


@settings(max_examples=60, deadline=None)
@given(
    segments=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 5)), min_size=1, max_size=12).filter(
        lambda s: sum(n for n, _ in s) > 0
    ),
    block_m=st.sampled_from([16, 32, 64, 128]),
)
def test_tables_cover_every_row_exactly_once(segments: list[tuple[int, int]], block_m: int) -> None:
    lengths = [n for n, _ in segments]
    adapters = [a for _, a in segments]
    batch = MultiLoRABatch.from_segments(lengths, adapters, num_adapters=6)
    assert batch.total_tokens == sum(lengths)
    row_ranges = expected_row_ranges(lengths, block_m)
    assert [tuple(r) for r in batch.row_tiles(block_m).seg_range.tolist()] == row_ranges
    assert batch.row_tiles(block_m).max_segments == max(hi - lo for lo, hi in row_ranges)

    tiles = batch.segment_tiles(block_m)
    table = tiles.tiles.tolist()
    assert tiles.num_tiles == len(table)
    assert [adapter for _, _, adapter in table] == sorted(adapter for _, _, adapter in table)
    assert_one_owner_per_row(table, lengths, adapters, block_m)
    assert batch.adapter_tokens == tuple(sum(n for n, a in segments if a == i) for i in range(6))


def assert_one_owner_per_row(table: list[list[int]], lengths: list[int], adapters: list[int], longest: int) -> None:
    """Each row lies in exactly one ``(row0, row1, adapter)`` entry, of its own adapter, none over ``longest`` rows."""
    owner = [a for n, a in zip(lengths, adapters, strict=True) for _ in range(n)]
    seen = [0] * len(owner)
    for row0, row1, adapter in table:
        assert 0 < row1 - row0 <= longest
        for t in range(row0, row1):
            seen[t] += 1
            assert owner[t] == adapter
    assert seen == [1] * len(owner)


@settings(max_examples=60, deadline=None)
@given(
    segments=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 3)), min_size=1, max_size=12).filter(
        lambda s: sum(n for n, _ in s) > 0
    ),
    max_rows=st.integers(1, 100),
)
def test_runs_cover_every_row_exactly_once(segments: list[tuple[int, int]], max_rows: int) -> None:
    lengths = [n for n, _ in segments]
    adapters = [a for _, a in segments]
    runs = MultiLoRABatch.from_segments(lengths, adapters).segment_runs(max_rows)
    table = runs.runs.tolist()
    assert runs.num_runs == len(table)
    assert runs.max_rows == max_rows
    assert_one_owner_per_row(table, lengths, adapters, max_rows)
    # Runs follow each other in token order, and only the cut at max_rows separates two runs of one adapter.
    for (start, end, adapter), (next_start, _, next_adapter) in itertools.pairwise(table):
        assert end == next_start
        if next_adapter == adapter:
            assert end - start == max_rows


def test_runs_merge_neighbouring_segments_of_one_adapter() -> None:
    batch = MultiLoRABatch.from_segments([3, 0, 5, 4, 2], [1, 0, 1, 0, 0])
    assert batch.segment_runs(100).runs.tolist() == [[0, 8, 1], [8, 14, 0]]
    assert batch.segment_runs(4).runs.tolist() == [[0, 4, 1], [4, 8, 1], [8, 12, 0], [12, 14, 0]]
    assert batch.segment_runs(4) is batch.segment_runs(4)


def test_no_cap_on_tiles_or_tokens() -> None:
    """The authors capped pointer tables at 192 tiles (24,576 tokens) and truncated silently."""
    lengths = [40_000, 33_333, 1, 26_666]
    batch = MultiLoRABatch.from_segments(lengths, [0, 1, 2, 1])
    tiles = batch.segment_tiles(128)
    assert tiles.num_tiles == sum(-(-n // 128) for n in lengths) > 192
    assert batch.row_tiles(128).num_tiles == -(-100_000 // 128)
    assert tiles.tiles[:, 1].max().item() == 100_000


def test_single_adapter_and_empty_segments() -> None:
    batch = MultiLoRABatch.from_segments([3, 0, 5], [1, 0, 1], num_adapters=3)
    assert batch.single_adapter() == 1
    assert batch.active_adapters == (1,)
    assert batch.segments.tolist() == [[0, 3, 1], [3, 5, 1]]
    assert batch.segment_starts == (0, 3, 3)
    assert MultiLoRABatch.from_segments([3, 5], [1, 0]).single_adapter() is None


def test_tables_are_cached_and_moved() -> None:
    batch = MultiLoRABatch.from_segments(torch.tensor([4, 9]), torch.tensor([0, 1]))
    assert batch.row_tiles(32) is batch.row_tiles(32)
    assert batch.to("cpu") is batch
    assert "total_tokens=13" in repr(batch)


def test_numpy_and_tensor_integers_accepted() -> None:
    batch = MultiLoRABatch.from_segments([np.int64(3), torch.tensor(2)], [np.int32(0), 1])
    assert batch.segment_lengths == (3, 2)
    assert batch.segment_adapters == (0, 1)


@pytest.mark.parametrize(
    ("lengths", "adapters", "kwargs", "message"),
    [
        ([1, 2], [0], {}, "2 entries but segment_adapters has 1"),
        ([], [], {}, "at least one segment"),
        ([1, -2], [0, 1], {}, "must be >= 0"),
        ([1, 2], [0, -1], {}, "must be >= 0"),
        ([1, 2], [0, 3], {"num_adapters": 2}, "refers to adapter 3"),
        ([1.5], [0], {}, "must hold integers"),
        ([4.0], [0], {}, "must hold integers"),  # a float, even a whole one, is a caller's bug
        (["4"], [0], {}, "must hold integers"),
        ([True], [0], {}, "must hold integers"),
        (None, [0], {}, "segment_lengths must be a list of integers or a 1-D integer tensor, got NoneType"),
        ([3], 0, {}, "segment_adapters must be a list of integers or a 1-D integer tensor, got int"),
        ([1, 2], [0, 1], {"num_adapters": 2.5}, r"num_adapters must be an integer .* got float 2.5"),
        ([1, 2], [0, 1], {"num_adapters": "3"}, r"num_adapters must be an integer .* got str '3'"),
        ([1, 2], [0, 1], {"num_adapters": True}, r"num_adapters must be an integer .* got bool True"),
    ],
)
def test_invalid_segments_raise(lengths: list, adapters: list, kwargs: dict, message: str) -> None:
    with pytest.raises(LoRAFusionKernelsError, match=message):
        MultiLoRABatch.from_segments(lengths, adapters, **kwargs)


def test_num_adapters_may_be_a_numpy_integer() -> None:
    batch = MultiLoRABatch.from_segments([1, 2], [0, 1], num_adapters=np.int64(3))
    assert batch.num_adapters == 3
    assert type(batch.num_adapters) is int


FIELDS = ["segment_lengths", "segment_adapters", "num_adapters", "total_tokens", "adapter_tokens", "device", "segments"]


@pytest.mark.parametrize("field", FIELDS)
def test_a_built_batch_is_read_only(field: str) -> None:
    """Regression: ``batch.segment_lengths = ...`` was accepted, and the tables derived from the old
    segments (device tables, cached tiles) stayed, so the kernels read rows never written."""
    batch = MultiLoRABatch.from_segments([10, 20, 7], [0, 2, 1])
    batch.row_tiles(16)
    before = getattr(batch, field)
    with pytest.raises(ReadOnlyAttributeError, match=rf"MultiLoRABatch\.{field} is read-only.*from_segments"):
        setattr(batch, field, before)
    with pytest.raises(AttributeError, match="read-only"):  # Python's own contract for read-only attributes
        delattr(batch, field)
    with pytest.raises(LoRAFusionKernelsError):
        setattr(batch, field, before)
    assert getattr(batch, field) is before


def test_copies_and_pickles_rebuild_the_batch() -> None:
    """Copies and pickles still work (by default they would set each slot): the same batch, with its own tables."""
    batch = MultiLoRABatch.from_segments([10, 0, 20, 7], [0, 1, 2, 0], num_adapters=4)
    tiles = batch.segment_tiles(16).tiles.tolist()
    for other in (copy.copy(batch), copy.deepcopy(batch), pickle.loads(pickle.dumps(batch))):
        assert other is not batch
        assert type(other) is MultiLoRABatch
        for field in FIELDS:
            if field == "segments":
                assert torch.equal(other.segments, batch.segments)
            else:
                assert getattr(other, field) == getattr(batch, field), field
        assert other.segment_tiles(16).tiles.tolist() == tiles
        with pytest.raises(ReadOnlyAttributeError):
            other.segment_lengths = (1, 2, 3, 4)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::lorafusion_kernels.errors.LoRAFusionKernelsWarning")  # no config file for this GPU
def test_tables_live_on_the_device() -> None:
    batch = MultiLoRABatch.from_segments([5, 7], [0, 1], device="cuda")
    assert batch.segments.is_cuda
    assert batch.row_tiles(64).seg_range.is_cuda
    assert batch.segment_tiles(64).tiles.is_cuda
    assert batch.segment_runs(64).runs.is_cuda
