from __future__ import annotations

import statistics

import pytest

from lorafusion_sched import SchedError
from lorafusion_sched.workloads import WORKLOADS, synthetic_jobs, synthetic_lengths, workload_parameters


def test_same_seed_same_lengths_and_clipped() -> None:
    a = synthetic_lengths("wikisum", 2000, 3)
    assert a == synthetic_lengths("wikisum", 2000, 3)
    assert a != synthetic_lengths("wikisum", 2000, 4)
    assert min(a) >= 64
    assert max(a) == 4096  # a visible share hits the cap


@pytest.mark.parametrize("dataset", ["xsum", "cnndm", "wikisum"])
def test_medians_follow_the_parameter_file(dataset: str) -> None:
    median = workload_parameters()["datasets"][dataset]["median"]
    assert statistics.median(synthetic_lengths(dataset, 4000, 0)) == pytest.approx(median, rel=0.06)


def test_het_cycles_datasets_and_splits_samples() -> None:
    jobs = synthetic_jobs("het", 10, num_adapters=4, global_batch_size=2)
    assert [j.name for j in jobs] == ["xsum-0", "cnndm-1", "wikisum-2", "mixed-3"]
    assert [len(j.sample_tokens) for j in jobs] == [3, 3, 2, 2]
    assert set(WORKLOADS) == {"xsum", "cnndm", "wikisum", "mixed", "het"}


def test_unknown_workload_is_a_clear_error() -> None:
    with pytest.raises(SchedError, match="workload = 'arxiv' is unknown"):
        synthetic_jobs("arxiv", 10)
    with pytest.raises(SchedError, match="dataset = 'arxiv'"):
        synthetic_lengths("arxiv", 10, 0)
