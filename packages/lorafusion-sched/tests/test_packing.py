from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lorafusion_sched.packing import highs
from lorafusion_sched.packing.formulation import min_bins_model, min_smallest_bin_model
from lorafusion_sched.packing.greedy import greedy_pack
from lorafusion_sched.packing.problem import (
    PackingProblem,
    bin_size,
    canonical_order,
    smallest_bin_bound,
    volume_bound,
)
from lorafusion_sched.packing.solve import is_valid_packing, pack_greedy, pack_with_milp
from lorafusion_sched.workloads import synthetic_lengths

SETTINGS = highs.SolverSettings(time_limit=2.0, node_limit=10_000, mip_rel_gap=0.0, seed=0)

# First-fit decreasing needs 3 bins of 10 here; {5, 3, 2} and {4, 4, 2} need 2.
FFD_TRAP = PackingProblem(adapters=(0,) * 6, lengths=(5, 4, 4, 3, 2, 2), capacity=10, padding=1)


def test_bin_size_pads_each_adapter_segment() -> None:
    p = PackingProblem(adapters=(0, 0, 1), lengths=(10, 20, 5), capacity=128, padding=64)
    assert bin_size(p, [0, 1]) == 64
    assert bin_size(p, [0, 1, 2]) == 128
    assert p.padded_volume() == 128
    assert volume_bound(p) == 1


def test_greedy_is_valid_and_sorted_largest_first() -> None:
    lengths = synthetic_lengths("mixed", 60, 1)
    p = PackingProblem(adapters=tuple(i % 3 for i in range(60)), lengths=tuple(lengths), capacity=4096, padding=64)
    packing = greedy_pack(p)
    assert is_valid_packing(p, packing)
    sizes = [bin_size(p, b) for b in packing]
    assert sizes == sorted(sizes, reverse=True)
    assert len(packing) >= volume_bound(p)


def test_stage1_beats_first_fit_decreasing_on_a_known_trap() -> None:
    p = PackingProblem(adapters=(0,) * 6, lengths=(6, 6, 4, 4, 4, 4), capacity=14, padding=1)
    greedy = greedy_pack(p)
    assert len(greedy) == 3  # FFD: {6,6}, {4,4,4}, {4}
    assert volume_bound(p) == 2
    result = pack_with_milp(p, greedy, SETTINGS, neighbourhood=None)
    assert result.milp_won
    assert len(result.packing) == 2
    assert is_valid_packing(p, result.packing)


def test_stage2_makes_the_smallest_bin_smaller() -> None:
    p = PackingProblem(adapters=(0, 0, 0, 0, 0), lengths=(7, 5, 3, 3, 2), capacity=10, padding=1)
    greedy = greedy_pack(p)  # FFD: {7,3}, {5,3,2}: smallest 10
    assert len(min_smallest_bin_model(p, 2).z) == 0  # no big-M selector: the last bin is the smallest
    result = pack_with_milp(p, greedy, SETTINGS, neighbourhood=None)
    assert is_valid_packing(p, result.packing)
    assert min(bin_size(p, b) for b in result.packing) <= min(bin_size(p, b) for b in greedy)


def test_warm_start_is_the_incumbent_even_with_no_time() -> None:
    lengths = synthetic_lengths("mixed", 64, 3)
    p = PackingProblem(adapters=(0,) * 32 + (1,) * 32, lengths=tuple(lengths), capacity=4096, padding=64)
    greedy = greedy_pack(p)
    model = min_smallest_bin_model(p, len(greedy))
    start = model.encode(canonical_order(p, greedy, smallest_last=True))
    tiny = highs.SolverSettings(time_limit=0.001, node_limit=1, mip_rel_gap=0.0, seed=0)
    result = highs.solve(model, tiny, start)
    assert result.status in (highs.SolveStatus.FEASIBLE, highs.SolveStatus.OPTIMAL)
    assert result.values is not None
    assert result.objective <= float(np.dot(model.col_cost, start)) + 1e-9
    assert is_valid_packing(p, model.decode(result.values))


def test_greedy_at_the_bounds_skips_the_milp() -> None:
    p = PackingProblem(adapters=(0, 0, 0, 0), lengths=(64, 64, 64, 64), capacity=128, padding=64)
    result = pack_greedy(p)
    assert result.at_bound
    assert smallest_bin_bound(p, 2) == 128


def test_stage1_bins_are_bounded_by_greedy_and_symmetry_is_broken() -> None:
    p = FFD_TRAP
    assert len(greedy_pack(p)) == 3
    model = min_bins_model(p, 3, 2)
    assert len(model.z) == 3
    # the longest item may only open bin 0; the second longest bins 0-1
    assert {b for (i, b) in model.x if i == 0} == {0}
    assert {b for (i, b) in model.x if i == 1} == {0, 1}
    assert model.col_lower[model.z[0]] == 1
    assert model.col_lower[model.z[1]] == 1
    with pytest.raises(ValueError, match="symmetry"):
        model.encode([[1], [0, 2, 3, 4, 5]])


def test_infeasible_model_reports_its_own_status() -> None:
    p = PackingProblem(adapters=(0, 0, 0), lengths=(8, 8, 8), capacity=10, padding=1)
    model = min_smallest_bin_model(p, 2)  # three items of 8 cannot fit two bins of 10
    result = highs.solve(model, SETTINGS, None)
    assert result.status is highs.SolveStatus.INFEASIBLE
    assert result.values is None


def test_models_can_be_written_with_readable_names(tmp_path: Path) -> None:
    path = tmp_path / "stage1.lp"
    highs.write_model(min_bins_model(FFD_TRAP, 3, 2), str(path))
    text = path.read_text()
    assert "x_0_0" in text
    assert "z_2" in text
