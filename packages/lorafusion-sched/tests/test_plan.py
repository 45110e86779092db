from __future__ import annotations

import sys

import pytest

from lorafusion_sched import AdapterJob, Plan, PlanOptions, plan, verify
from lorafusion_sched.workloads import synthetic_jobs


def make_job(name: str, lengths: list[int], gbs: int) -> AdapterJob:
    return AdapterJob(name=name, sample_tokens=tuple(lengths), global_batch_size=gbs)


def positions(p: Plan, adapter: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, mb in enumerate(p.microbatches):
        for s in mb.segments:
            if s.adapter == adapter:
                out.setdefault(s.global_batch, []).append(i)
    return out


def test_one_adapter_gets_noops_for_the_bubble_lemma(fast_options: PlanOptions) -> None:
    job = make_job("solo", [300] * 12, gbs=3)  # one microbatch per global batch
    p = plan([job], fast_options)
    assert verify(p) == []
    assert p.stats.num_noops == 3 * 3  # S - 1 = 3 no-ops between each of the 4 global batches
    pos = positions(p, "solo")
    assert all(pos[g + 1][0] - pos[g][-1] >= 4 for g in range(3))
    assert [mb.step_after for mb in p.microbatches if mb.step_after] == [("solo",)] * 4


def test_an_adapter_with_batches_to_go_is_not_delayed_at_a_phase_boundary() -> None:
    """The README's example: chat's batch 1 ends chat, summarize's batch 1 leads to batch 2.

    Both wait for round S; running summarize's first lets its batch 2 start a round earlier
    (9 microbatches; the groups' fixed order gave 10).
    """
    jobs = [
        make_job("summarize", [512, 1033, 870, 2400, 333, 760], gbs=2),
        make_job("chat", [90, 140, 3100, 615], gbs=2),
    ]
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=4, padding_multiple=64))
    assert verify(p) == []
    assert p.stats.num_microbatches == 9
    assert [(s.adapter, s.global_batch) for mb in p.microbatches[4:6] for s in mb.segments] == [
        ("summarize", 1),
        ("chat", 1),
    ]


def test_the_unmerged_sequence_is_kept_where_the_list_schedule_makes_it_shorter() -> None:
    """Merged, b's sample shares a's first microbatch and a's batch 0 spills into a second one,
    which nothing can fill before a's batch 1 (4 slots); unmerged, b's microbatch fills that wait (3)."""
    jobs = [make_job("a", [300, 1500, 1500], gbs=2), make_job("b", [2500], gbs=3)]
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=2, padding_multiple=64, use_milp=False))
    assert verify(p) == []
    assert p.stats.num_microbatches == 3
    assert p.stats.merged_samples == 0
    assert [[(s.adapter, s.global_batch) for s in mb.segments] for mb in p.microbatches] == [
        [("a", 0)],
        [("b", 0)],
        [("a", 1)],
    ]


def test_step_after_marks_the_last_microbatch_of_each_global_batch(fast_options: PlanOptions) -> None:
    jobs = synthetic_jobs("het", 192, num_adapters=4, global_batch_size=8, seed=1)
    p = plan(jobs, fast_options.model_copy(update={"capacity": 4096}))
    assert verify(p) == []
    for job in jobs:
        pos = positions(p, job.name)
        for g, where in pos.items():
            assert job.name in p.microbatches[where[-1]].step_after, g
            assert all(job.name not in p.microbatches[i].step_after for i in where[:-1])


def test_different_batch_sizes_and_dataset_sizes(fast_options: PlanOptions) -> None:
    jobs = [
        make_job("a", [100 + 7 * i for i in range(50)], gbs=8),  # 7 batches, last one partial (2)
        make_job("b", [400 + 3 * i for i in range(13)], gbs=4),  # 4 batches, last partial (1)
        make_job("c", [900] * 6, gbs=1),  # 6 single-sample batches
    ]
    p = plan(jobs, fast_options)
    assert verify(p) == []
    assert [a.num_global_batches for a in p.adapters] == [7, 4, 6]
    assert p.stats.dropped_samples == 0
    dropped = plan(jobs, fast_options.model_copy(update={"drop_last": True}))
    assert verify(dropped) == []
    assert [a.num_global_batches for a in dropped.adapters] == [6, 3, 6]
    assert dropped.stats.dropped_samples == 2 + 1
    scheduled = {s for mb in dropped.microbatches for seg in mb.segments if seg.adapter == "a" for s in seg.samples}
    assert scheduled == set(range(48))


def test_eight_adapters(fast_options: PlanOptions) -> None:
    jobs = synthetic_jobs("mixed", 8 * 24, num_adapters=8, global_batch_size=6, seed=2)
    p = plan(jobs, fast_options.model_copy(update={"capacity": 4096}))
    assert verify(p) == []
    assert p.stats.num_groups >= 4


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.filterwarnings("ignore::lorafusion_sched.SchedWarning")  # two adapters cannot fill d x (S - 1) slots
def test_data_parallel_lemma_holds_across_replicas(fast_options: PlanOptions, replicas: int) -> None:
    jobs = synthetic_jobs("het", 96, num_adapters=2, global_batch_size=8, seed=3)
    p = plan(jobs, fast_options.model_copy(update={"capacity": 4096, "data_parallel": replicas}))
    assert verify(p) == []
    assert len(p.microbatches) % replicas == 0
    assert [mb.replica for mb in p.microbatches[:replicas]] == list(range(replicas))
    for i in range(0, len(p.microbatches), replicas):
        rounds = {mb.step_after for mb in p.microbatches[i : i + replicas]}
        assert len(rounds) == 1  # every replica steps the same adapters after the same round


def test_plan_is_deterministic_without_the_milp(fast_options: PlanOptions) -> None:
    jobs = synthetic_jobs("het", 400, num_adapters=4, global_batch_size=16, seed=4)
    options = fast_options.model_copy(update={"capacity": 4096, "use_milp": False})
    a, b = plan(jobs, options), plan(jobs, options)
    assert a.microbatches == b.microbatches


def test_merge_never_adds_microbatches(fast_options: PlanOptions) -> None:
    jobs = synthetic_jobs("het", 512, num_adapters=4, global_batch_size=16, seed=5)
    base = fast_options.model_copy(update={"capacity": 4096, "use_milp": False})
    merged = plan(jobs, base)
    unmerged = plan(jobs, base.model_copy(update={"merge": False}))
    assert verify(merged) == []
    assert merged.stats.merged_samples > 0
    assert merged.stats.num_microbatches <= unmerged.stats.num_microbatches


@pytest.mark.parametrize("stages", [1, 4])
def test_merge_packs_many_small_tasks_together(stages: int) -> None:
    """50 one-sample jobs form 25 one-microbatch tasks; the merge pass keeps filling one microbatch."""
    jobs = [make_job(f"j{i}", [100], gbs=1) for i in range(50)]
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=stages, use_milp=False))
    assert verify(p) == []
    assert p.stats.num_microbatches == p.stats.lower_bound == 2


def test_data_parallel_grouping_leaves_fewer_noops() -> None:
    """With d = 8 a pair of adapters is not separated by the other pair's microbatches; singletons are."""
    jobs = synthetic_jobs("het", 640, num_adapters=4, global_batch_size=32)
    options = PlanOptions(capacity=4096, pipeline_stages=4, padding_multiple=64, data_parallel=8, use_milp=False)
    p = plan(jobs, options)
    assert verify(p) == []
    assert all(len(group) == 1 for group in p.stats.groups)
    assert p.stats.num_noops <= 24  # 56 when grouping counted microbatches, not rounds of 8


def test_milp_in_worker_processes_matches_the_contract(fast_options: PlanOptions) -> None:
    jobs = synthetic_jobs("het", 640, num_adapters=4, global_batch_size=16, seed=6)
    seen: list[tuple[int, int]] = []
    p = plan(
        jobs,
        fast_options.model_copy(update={"capacity": 4096, "workers": 2}),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert verify(p) == []
    assert p.stats.workers == 2
    assert p.stats.milp_runs >= 16
    assert seen[0] == (0, p.stats.num_tasks)
    assert seen[-1] == (p.stats.num_tasks, p.stats.num_tasks)
    assert p.stats.num_microbatches - p.stats.num_noops >= p.stats.lower_bound


@pytest.mark.parametrize("workers", [1, 2])
def test_planning_writes_nothing_to_stdout(workers: int) -> None:
    """HiGHS 1.16 prints a banner from C when a process builds its first solver: never on our stdout
    (a command's stdout may carry JSON; a worker's carries its results)."""
    import subprocess

    code = (
        "from lorafusion_sched import PlanOptions, plan\n"
        "from lorafusion_sched.workloads import synthetic_jobs\n"
        "jobs = synthetic_jobs('het', 640, num_adapters=4, global_batch_size=16, seed=6)\n"
        f"p = plan(jobs, PlanOptions(capacity=4096, time_limit=0.02, workers={workers}))\n"
        "assert p.stats.milp_runs > 0 and p.stats.workers == " + str(workers) + "\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == b""
    assert b"MILP tasks kept their greedy packing" not in done.stderr


def test_padding_is_per_adapter_segment(fast_options: PlanOptions) -> None:
    jobs = [make_job("a", [10, 20, 30], gbs=3), make_job("b", [40], gbs=1)]
    p = plan(jobs, fast_options.model_copy(update={"pipeline_stages": 1}))
    assert verify(p) == []
    seg = {s.adapter: s for mb in p.microbatches for s in mb.segments}
    assert (seg["a"].tokens, seg["a"].padded_tokens) == (60, 64)
    assert (seg["b"].tokens, seg["b"].padded_tokens) == (40, 64)


@pytest.mark.slow
def test_paper_scale_plan_verifies_clean() -> None:
    jobs = synthetic_jobs("het", 25_600, num_adapters=4, global_batch_size=32, seed=0)
    p = plan(jobs, PlanOptions(capacity=4096, pipeline_stages=4, padding_multiple=64))
    assert verify(p) == []
    assert p.stats.fill_ratio >= 0.95


def test_no_worker_outlives_an_interrupted_plan(fast_options: PlanOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt (here: the progress callback raising) kills the MILP workers before it propagates."""
    import subprocess

    from lorafusion_sched.packing import pool

    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    def interrupt(done: int, total: int) -> None:
        if done > 0:
            raise KeyboardInterrupt

    monkeypatch.setattr(pool.subprocess, "Popen", recording_popen)
    jobs = synthetic_jobs("het", 640, num_adapters=4, global_batch_size=16, seed=6)
    options = fast_options.model_copy(update={"capacity": 4096, "workers": 2, "time_limit": None})
    with pytest.raises(KeyboardInterrupt):
        plan(jobs, options, progress=interrupt)
    assert len(started) == 2
    assert all(proc.poll() is not None for proc in started), "every worker has ended"


def test_failed_workers_fall_back_to_greedy(fast_options: PlanOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = synthetic_jobs("het", 640, num_adapters=4, global_batch_size=16, seed=7)
    options = fast_options.model_copy(update={"capacity": 4096, "workers": 2})
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.warns(UserWarning, match="kept their greedy packing"):
        p = plan(jobs, options)
    assert verify(p) == []
    assert p.stats.milp_runs == 0
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.warns(UserWarning, match="could not start"):
        p = plan(jobs, options)
    assert verify(p) == []
    assert p.stats.workers == 1


def test_a_milp_plan_longer_than_the_greedy_plan_keeps_the_greedy_sequence() -> None:
    """Regression: every task's MILP packing here is no worse than greedy's, but after the no-ops and
    the merge the plan had 56 microbatches against greedy's 55. ``time_limit=None``: the same solves
    on every machine."""
    lengths = {
        "a0": ((1534, 536, 274, 1807, 2199, 466, 399, 629, 674, 1385, 1700), 4),
        "a1": ((1029, 1442, 1450, 1041, 2080, 45, 2129, 259, 1723, 456, 1723, 1882, 304, 409, 1867, 601, 1565, 757), 7),
        "a2": (
            (2300, 140, 1410, 1744, 1141, 1158, 578, 343, 1817, 2237, 1285, 773, 2295, 181, 902, 1821, 2077, 1673, 559,
             2269, 2212, 140, 807, 1163, 2277, 844, 1087, 226),
            6,
        ),
        "a3": (
            (1166, 1574, 539, 151, 791, 1231, 848, 1836, 1206, 14, 173, 1754, 1788, 2255, 43, 683, 423, 1504, 1717, 945,
             1101, 1645, 2050),
            6,
        ),
        "a4": (
            (636, 374, 1342, 881, 172, 1612, 1539, 1141, 1350, 800, 2065, 969, 150, 2013, 1012, 842, 1151, 659, 755),
            8,
        ),
    }  # fmt: skip
    jobs = [AdapterJob(name=n, sample_tokens=t, global_batch_size=g) for n, (t, g) in lengths.items()]
    options = PlanOptions(
        capacity=2304, pipeline_stages=2, padding_multiple=64, neighbourhood=None, time_limit=None, node_limit=50,
        workers=1,
    )  # fmt: skip
    with_milp = plan(jobs, options)
    greedy = plan(jobs, options.model_copy(update={"use_milp": False}))
    assert greedy.stats.num_microbatches == 55
    assert with_milp.stats.num_microbatches == 55
    assert with_milp.stats.milp_runs > 0
    assert with_milp.stats.milp_wins == 0, "the plan uses no MILP packing"
    assert verify(with_milp) == []


def test_workers_above_the_cpus_are_capped_with_one_warning(
    fast_options: PlanOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 workers on 2 CPUs planned 10x slower than 2 (fresh interpreters competing for the CPUs)."""
    from lorafusion_sched import SchedWarning, planner

    started: list[int] = []

    def record(work: object, settings: object, neighbourhood: object, workers: int, on_result: object) -> None:
        started.append(workers)  # no process started: every task keeps its greedy packing

    monkeypatch.setattr(planner, "default_workers", lambda: 2)
    monkeypatch.setattr(planner, "solve_in_workers", record)
    jobs = synthetic_jobs("het", 320, num_adapters=4, global_batch_size=8, seed=0)
    options = fast_options.model_copy(update={"capacity": 4096, "workers": 64})
    with pytest.warns(SchedWarning, match="workers = 64 is more than the 2 CPUs") as caught:
        p = plan(jobs, options)
    assert len([w for w in caught if "CPUs" in str(w.message)]) == 1
    assert "set workers to at most 2, or leave it unset" in str(caught[0].message)
    assert started == [2], "the pool got as many processes as CPUs"
    assert p.stats.workers == 2


def test_a_lone_adapter_tail_warns_naming_it_and_what_helps(fast_options: PlanOptions) -> None:
    from lorafusion_sched import SchedWarning

    jobs = [make_job("big", [300] * 40, gbs=2), make_job("small", [300] * 4, gbs=2)]
    with pytest.warns(SchedWarning) as caught:
        p = plan(jobs, fast_options)
    assert p.stats.num_noops / p.stats.num_microbatches > 0.2
    message = str(caught[0].message)
    assert message.startswith(f"{p.stats.num_noops} of {p.stats.num_microbatches} microbatches")
    assert "after the other adapters have finished and 'big' runs alone" in message
    assert "pipeline_stages = 4 positions after the last microbatch of its previous one" in message
    assert "give 'big' a larger global_batch_size" in message


def test_a_plan_with_few_noops_does_not_warn(fast_options: PlanOptions) -> None:
    """The docs' ten-line example has 5 no-ops in 9 microbatches: a small plan always ends with a few."""
    jobs = [make_job("a", [300] * 4, gbs=2), make_job("b", [300] * 4, gbs=2)]
    p = plan(jobs, fast_options)  # filterwarnings = error: a warning would fail the test
    assert 0 < p.stats.num_noops < 16


def test_segments_are_in_job_order_and_their_samples_ascend(fast_options: PlanOptions) -> None:
    """The documented row order: segments by the jobs' order, each segment's samples by index."""
    jobs = synthetic_jobs("het", 400, num_adapters=4, global_batch_size=16, seed=7)
    p = plan(jobs, fast_options.model_copy(update={"capacity": 4096}))
    order = {job.name: i for i, job in enumerate(jobs)}
    for mb in p.microbatches:
        assert [order[s.adapter] for s in mb.segments] == sorted(order[s.adapter] for s in mb.segments)
        assert all(list(s.samples) == sorted(s.samples) for s in mb.segments)
