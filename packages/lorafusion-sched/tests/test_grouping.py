from __future__ import annotations

from lorafusion_sched.grouping import AdapterProfile, group_adapters, plan_tasks


def profile(index: int, mean: float, gbs: int = 16, batches: int = 4) -> AdapterProfile:
    return AdapterProfile(index=index, mean=mean, std=0.0, global_batch_size=gbs, num_global_batches=batches)


def test_head_tail_pairs_longest_with_shortest() -> None:
    profiles = [profile(0, 500), profile(1, 1000), profile(2, 1700), profile(3, 1100)]
    assert group_adapters(profiles, 4096, 4, 0.25) == [(0, 2), (1, 3)]


def test_pairs_only_when_others_separate_them() -> None:
    # each adapter fills ~1 microbatch per global batch: pairing any two leaves 2 < S - 1 = 3
    profiles = [profile(i, 200.0 + i, gbs=16) for i in range(4)]
    assert all(len(g) == 1 for g in group_adapters(profiles, 4096, 4, 0.25))


def test_replicas_multiply_the_separation_needed() -> None:
    # conservative microbatches 2, 4, 7, 5 (18 in all); at d = 4 a group needs 4 x 3 = 12 outside it
    profiles = [profile(0, 500), profile(1, 1000), profile(2, 1700), profile(3, 1100)]
    assert group_adapters(profiles, 4096, 4, 0.25, replicas=3) == [(0, 2), (1, 3)]  # 9 >= 9
    assert group_adapters(profiles, 4096, 4, 0.25, replicas=4) == [(2,), (3,), (0, 1)]  # 12 >= 12


def test_one_adapter_is_one_group() -> None:
    assert group_adapters([profile(0, 800)], 4096, 4, 0.25) == [(0,)]


def test_many_adapters_all_grouped_once() -> None:
    profiles = [profile(i, 300.0 + 150 * i) for i in range(9)]
    groups = group_adapters(profiles, 4096, 4, 0.25)
    assert sorted(i for g in groups for i in g) == list(range(9))
    assert all(1 <= len(g) <= 2 for g in groups)


def test_adapters_leave_the_rotation_and_the_rest_regroup() -> None:
    profiles = [profile(0, 500, batches=2), profile(1, 1700, batches=5), profile(2, 1000, batches=5)]
    tasks, phases = plan_tasks(profiles, 4096, 2, 0.25)
    assert len(phases) == 2
    assert [t.global_batch for t in tasks] == sorted(t.global_batch for t in tasks)
    assert {i for t in tasks if t.global_batch >= 2 for i in t.group} == {1, 2}
    per_adapter = {a: [t.global_batch for t in tasks if a in t.group] for a in range(3)}
    assert per_adapter == {0: [0, 1], 1: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3, 4]}
