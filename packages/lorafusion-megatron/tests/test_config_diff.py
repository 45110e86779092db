from __future__ import annotations

from lorafusion_megatron.config_diff import changed_keys, join_changes


def _job(name: str, **changes) -> dict:
    return {"name": name, "r": 16, "dataset": {"path": f"{name}.jsonl", "shuffle": True}, **changes}


def test_nested_keys_are_dotted_paths_with_old_and_new_values() -> None:
    old = {"scheduler": {"capacity": 4096, "long_samples": "truncate"}, "runtime": {"device": "auto"}}
    new = {"scheduler": {"capacity": 8192, "long_samples": "drop"}, "runtime": {"device": "auto"}}
    assert changed_keys(old, new) == ["scheduler.capacity: 4096 -> 8192", "scheduler.long_samples: truncate -> drop"]


def test_jobs_are_named_by_name_not_index() -> None:
    old = {"jobs": [_job("a"), _job("b")]}
    new = {"jobs": [_job("a"), _job("b", r=32, dataset={"path": "b.jsonl", "shuffle": False})]}
    assert changed_keys(old, new) == ["jobs[b].r: 16 -> 32", "jobs[b].dataset.shuffle: true -> false"]


def test_added_removed_and_reordered_jobs() -> None:
    old = {"jobs": [_job("a"), _job("b"), _job("c")]}
    new = {"jobs": [_job("c"), _job("a"), _job("d")]}
    assert changed_keys(old, new) == ["jobs[d]: added", "jobs[b]: removed", "jobs: order a, c -> c, a"]


def test_absent_keys_lists_and_nulls() -> None:
    old = {"target_modules": ["q_proj"], "max_steps": None}
    new = {"target_modules": ["q_proj", "v_proj"], "max_steps": None, "use_dora": False}
    assert changed_keys(old, new) == [
        'target_modules: ["q_proj"] -> ["q_proj", "v_proj"]',
        "use_dora: (absent) -> false",
    ]
    assert changed_keys(new, old) == [
        'target_modules: ["q_proj", "v_proj"] -> ["q_proj"]',
        "use_dora: false -> (absent)",
    ]


def test_equal_data_has_no_changes() -> None:
    data = {"jobs": [_job("a")], "scheduler": {"capacity": 64}}
    assert changed_keys(data, data) == []
    assert join_changes(changed_keys(data, data)) == ""


def test_description_lists_five_then_counts_the_rest() -> None:
    old = {f"k{i}": i for i in range(8)}
    new = {f"k{i}": i + 1 for i in range(8)}
    lines = changed_keys(old, new)
    assert join_changes(lines) == "k0: 0 -> 1; k1: 1 -> 2; k2: 2 -> 3; k3: 3 -> 4; k4: 4 -> 5; and 3 more"
    assert join_changes(lines, limit=8).endswith("k7: 7 -> 8")
