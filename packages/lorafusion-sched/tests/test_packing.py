from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from lorafusion_sched.packing import highs
from lorafusion_sched.packing.formulation import min_bins_model, min_smallest_bin_model
from lorafusion_sched.packing.greedy import first_fit_decreasing, greedy_pack
from lorafusion_sched.packing.max_tree import MaxTree, Rooms, room_for
from lorafusion_sched.packing.problem import (
    PackingProblem,
    bin_size,
    canonical_order,
    round_up,
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


def _first_fit_by_scanning(problem: PackingProblem) -> list[list[int]]:
    """First-fit decreasing the plain way (every open bin tried in order): the reference."""
    order = sorted(range(problem.num_items), key=lambda i: (-problem.lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        for items in bins:
            if bin_size(problem, [*items, i]) <= problem.capacity:
                items.append(i)
                break
        else:
            bins.append([i])
    return bins


@pytest.mark.parametrize("padding", [1, 8, 64])
@pytest.mark.parametrize("seed", range(6))
def test_first_fit_finds_the_bins_a_full_scan_finds(padding: int, seed: int) -> None:
    rng = random.Random(seed)
    capacity = padding * rng.choice([16, 50, 64])
    n = rng.choice([1, 7, 200, 1500])
    lengths = tuple(rng.randint(1, capacity) for _ in range(n))
    adapters = tuple(rng.randrange(3) for _ in range(n))
    problem = PackingProblem(lengths=lengths, adapters=adapters, capacity=capacity, padding=padding)
    assert [b.items for b in first_fit_decreasing(problem)] == _first_fit_by_scanning(problem)


def test_max_tree_finds_the_first_position_with_enough() -> None:
    rng = random.Random(0)
    tree, values = MaxTree(), []
    for _ in range(300):
        if not values or rng.random() < 0.4:
            values.append(rng.randint(0, 50))
            tree.append(values[-1])
        else:
            index = rng.randrange(len(values))
            values[index] = rng.randint(0, 50)
            tree.set(index, values[index])
        need, start = rng.randint(0, 55), rng.randint(0, len(values))
        expected = next((i for i in range(start, len(values)) if values[i] >= need), None)
        assert tree.first_at_least(need, start) == expected


def test_rooms_find_the_first_microbatch_an_adapter_fits_in() -> None:
    """Against a scan of every microbatch with the padded-size rule itself."""
    rng = random.Random(1)
    capacity, padding = 512, 64
    rooms = Rooms([0, 1, 2], capacity, padding)
    contents: list[dict[int, int]] = []
    for _ in range(200):
        if not contents or rng.random() < 0.3:
            contents.append({})
            rooms.append(0, {})
        else:
            j = rng.randrange(len(contents))
            a, n = rng.randrange(3), rng.randint(1, 100)
            grown = {**contents[j], a: contents[j].get(a, 0) + n}
            if sum(round_up(v, padding) for v in grown.values()) <= capacity:
                contents[j] = grown
                rooms.set(j, sum(round_up(v, padding) for v in grown.values()), grown)
        a, length, start = rng.randrange(3), rng.randint(1, 200), rng.randint(0, len(contents))

        def fits(c: dict[int, int], a: int = a, length: int = length) -> bool:
            grown = {**c, a: c.get(a, 0) + length}
            return sum(round_up(v, padding) for v in grown.values()) <= capacity

        expected = next((j for j in range(start, len(contents)) if fits(contents[j])), None)
        assert rooms.first(a, length, start) == expected


def test_room_for_is_exactly_what_fits() -> None:
    capacity, padding = 256, 64
    for old in range(130):
        for other in (0, 64, 128):
            size = other + round_up(old, padding)
            if size > capacity:
                continue
            room = room_for(capacity, padding, size, old)
            fits = [
                n
                for n in range(1, capacity + 1)
                if size - round_up(old, padding) + round_up(old + n, padding) <= capacity
            ]
            assert room == max(fits, default=0)
