from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from lorafusion_sched import AdapterJob, Plan, PlanOptions, SchedError, plan, verify
from lorafusion_sched.io import load_jobs, load_plan, read_lengths, save_plan


def make_job(name: str, lengths: list[int], gbs: int) -> AdapterJob:
    return AdapterJob(name=name, sample_tokens=tuple(lengths), global_batch_size=gbs)


def test_read_lengths_in_every_format(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("[5, 7.0, 9]")
    (tmp_path / "b.json").write_text('[{"tokens": 5}, {"tokens": 6}]')
    (tmp_path / "c.jsonl").write_text('{"length": 3, "id": 1}\n\n{"length": 4, "id": 2}\n')
    (tmp_path / "d.jsonl").write_text("8\n9\n")
    (tmp_path / "e.csv").write_text("n\n11\n12\n")
    (tmp_path / "f.csv").write_text("id,num_tokens,x\n1,13,a\n2,14,b\n")
    (tmp_path / "g.csv").write_text("id,size\n1,15\n")
    assert read_lengths(tmp_path / "a.json") == [5, 7, 9]
    assert read_lengths(tmp_path / "b.json") == [5, 6]
    assert read_lengths(tmp_path / "c.jsonl") == [3, 4]
    assert read_lengths(tmp_path / "d.jsonl") == [8, 9]
    assert read_lengths(tmp_path / "e.csv") == [11, 12]
    assert read_lengths(tmp_path / "f.csv") == [13, 14]
    assert read_lengths(tmp_path / "g.csv", "size") == [15]
    (tmp_path / "h.csv").write_text("100\n200\n")
    assert read_lengths(tmp_path / "h.csv") == [100, 200], "no header row: the first number is a sample"


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("x.json", "[5, -1]", r"x.json\[1\]: -1 is not a positive"),
        ("x.json", "[5, 2.5]", "2.5 is not a positive whole"),
        ("x.json", "{", "invalid JSON"),
        ("x.jsonl", '{"id": 1}\n', r"x.jsonl:1: none of the fields"),
        ("x.csv", "id,size\n1,15\n", "pass lengths_field"),
        ("x.txt", "5", "unknown suffix '.txt'"),
        ("x.json", "[]", "no lengths found"),
        ("x.json", '["many"]', "'many' is not a token count"),
        ("x.jsonl", '5\n{"tokens": 6,\n7\n', r"x.jsonl:2: invalid JSON"),
        ("x.csv", "5,6\n7,8\n", "without a header row must have one column"),
        ("x.csv", "id,tokens\n1,5\n2\n", r"x.csv:3: 1 cells under a header of 2 columns"),
        ("x.json", "[100, NaN]", r"x.json\[1\]: nan is not a positive whole"),
        ("x.json", "[100, 1e400]", r"x.json\[1\]: inf is not a positive whole"),
        ("x.csv", "100\ninf\n", r"x.csv:2: 'inf' is not a positive whole"),
        ("x.csv", "tokens\nnan\n", r"x.csv:2: 'nan' is not a positive whole"),
    ],
)
def test_bad_lengths_files_say_where(tmp_path: Path, name: str, text: str, needle: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(SchedError, match=needle):
        read_lengths(tmp_path / name)
    with pytest.raises(SchedError, match="does not exist"):
        read_lengths(tmp_path / "missing.json")


def test_lengths_are_read_exactly_and_a_byte_order_mark_is_no_header(tmp_path: Path) -> None:
    """Spreadsheets save CSV with a UTF-8 byte-order mark; big counts must not round through float."""
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf100\n200\n300\n")
    assert read_lengths(tmp_path / "bom.csv") == [100, 200, 300], "the first sample is kept"
    (tmp_path / "header.csv").write_bytes(b"\xef\xbb\xbftokens,text\n7,a\n")
    assert read_lengths(tmp_path / "header.csv", "tokens") == [7]
    big = 2**53 + 1
    (tmp_path / "big.csv").write_text(f"{big}\n")
    (tmp_path / "big.json").write_text(f"[{big}]")
    assert read_lengths(tmp_path / "big.csv") == [big]
    assert read_lengths(tmp_path / "big.json") == [big]


def test_a_file_that_is_not_utf8_is_refused_with_what_to_do(tmp_path: Path) -> None:
    for name in ("x.json", "x.csv"):
        (tmp_path / name).write_bytes(b"\xff\xfe{\x00")
        with pytest.raises(SchedError, match=f"{name}: not UTF-8 text .*save the file as UTF-8"):
            read_lengths(tmp_path / name)
    (tmp_path / "jobs.yaml").write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(SchedError, match="not UTF-8 text"):
        load_jobs(tmp_path / "jobs.yaml")
    with pytest.raises(SchedError, match="not UTF-8 text"):
        load_plan(tmp_path / "x.json")


def test_load_jobs_yaml_with_a_lengths_file(tmp_path: Path) -> None:
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"tokens": t}) for t in (100, 200, 300)))
    (tmp_path / "jobs.yaml").write_text(
        "adapters:\n"
        "  - {name: a, sample_tokens: [512, 1033], global_batch_size: 2}\n"
        "  - {name: b, lengths_file: b.jsonl, global_batch_size: 1}\n"
        "options: {capacity: 4096, pipeline_stages: 4, padding_multiple: 64}\n"
    )
    jobs, options = load_jobs(tmp_path / "jobs.yaml")
    assert [j.name for j in jobs] == ["a", "b"]
    assert jobs[1].sample_tokens == (100, 200, 300)
    assert options.pipeline_stages == 4


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"adapters": []}, "adapters must be a non-empty list"),
        ({"adapters": [{"name": "a", "sample_tokens": [0], "global_batch_size": 1}]}, r"adapters\[0\].sample_tokens"),
        (
            {
                "adapters": [{"name": "a", "sample_tokens": [5], "global_batch_size": 1}],
                "options": {"capacity": 100, "padding_multiple": 64},
            },
            "options.*capacity = 100 is not a multiple",
        ),
        (
            {"adapters": [{"name": "a", "sample_tokens": [5], "global_batch_size": 1}], "steps": 1},
            r"unknown top-level keys \['steps'\]",
        ),
        (
            {"adapters": [{"name": "a", "sample_tokens": [5], "global_batch_size": 1}], "options": {}},
            "capacity: missing",
        ),
        (
            {"adapters": [{"name": "a", "global_batch_size": 1}]},
            r"adapters\[0\] \('a'\): give sample_tokens \(the samples' token counts\) or lengths_file",
        ),
        (
            {"adapters": [{"name": "a", "sample_tokens": [5], "lengths_file": "a.json", "global_batch_size": 1}]},
            "has both sample_tokens and lengths_file",
        ),
        ({"adapters": [{"name": "a", "sample_tokens": [True, 5], "global_batch_size": 1}]}, "not a boolean"),
        (
            {
                "adapters": [{"name": "a", "sample_tokens": [5], "global_batch_size": 1}],
                "options": {"capacity": "4096"},
            },
            r"options.capacity = '4096': give a whole number \(4096\), not a string",
        ),
        (
            {"adapters": [{"name": "a", "sample_tokens": [5, 6.5], "global_batch_size": 1}]},
            r"adapters\[0\].sample_tokens\[1\] = 6.5: give a whole number, not a fraction",
        ),
        (
            {
                "adapters": [{"name": "a", "sample_tokens": [5], "global_batch_size": 1}],
                "options": {"capacity": 64, "pipeline_stages": 0},
            },
            "pipeline_stages = 0",
        ),
    ],
)
def test_bad_jobs_files_name_field_and_value(tmp_path: Path, doc: dict[str, object], needle: str) -> None:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SchedError, match=needle):
        load_jobs(path)


def test_a_csv_lengths_file_of_strings_makes_whole_numbers(tmp_path: Path) -> None:
    (tmp_path / "b.csv").write_text("tokens\n512\n1033\n")
    (tmp_path / "jobs.yaml").write_text(
        "adapters: [{name: b, lengths_file: b.csv, global_batch_size: 1}]\noptions: {capacity: 4096}\n"
    )
    jobs, _options = load_jobs(tmp_path / "jobs.yaml")
    assert jobs[0].sample_tokens == (512, 1033)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("capacity", "1024", r"capacity = '1024': give a whole number \(1024\), not a string"),
        ("capacity", 1024.5, r"capacity = 1024.5: give a whole number, not a fraction"),
        ("schema_version", "1", r"schema_version = '1': give a whole number \(1\), not a string"),
    ],
)
def test_a_plan_file_with_a_string_or_fractional_count_is_refused(
    tmp_path: Path, field: str, value: object, needle: str
) -> None:
    p = plan([make_job("a", [100, 900, 300, 50], gbs=2)], PlanOptions(capacity=1024, use_milp=False))
    doc = json.loads(p.model_dump_json())
    doc[field] = value
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(SchedError, match=needle):
        load_plan(tmp_path / "plan.json")


def test_plan_json_round_trip(tmp_path: Path) -> None:
    p = plan([make_job("a", [100, 900, 300, 50], gbs=2)], PlanOptions(capacity=1024, pipeline_stages=2))
    save_plan(p, tmp_path / "plan.json")
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["schema_version"] == 1
    assert load_plan(tmp_path / "plan.json") == p
    assert verify(load_plan(tmp_path / "plan.json")) == []
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind
    (tmp_path / "bad.json").write_text('{"schema_version": 2}')
    with pytest.raises(SchedError, match="schema_version"):
        load_plan(tmp_path / "bad.json")


def test_save_plan_follows_a_link_keeps_permissions_and_is_safe_across_threads(tmp_path: Path) -> None:
    import os
    import stat
    import threading

    p = plan([make_job("a", [100, 900, 300, 50], gbs=2)], PlanOptions(capacity=1024, pipeline_stages=2))
    real = tmp_path / "v1.json"
    save_plan(p, real)
    os.chmod(real, 0o640)
    (tmp_path / "plan.json").symlink_to(real.name)
    save_plan(p, tmp_path / "plan.json")
    assert (tmp_path / "plan.json").is_symlink(), "the link stays a link"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640, "the replaced file keeps its permissions"
    failures: list[BaseException] = []

    def save_often() -> None:
        try:
            for _ in range(50):
                save_plan(p, tmp_path / "shared.json")
        except BaseException as err:  # collected for the assertion below
            failures.append(err)

    threads = [threading.Thread(target=save_often) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert load_plan(tmp_path / "shared.json") == p
    assert sorted(f.name for f in tmp_path.iterdir()) == ["plan.json", "shared.json", "v1.json"]


def test_a_plan_file_cut_short_is_named_in_one_short_line(tmp_path: Path) -> None:
    """The JSON parser's error carried the whole document, which the message used to print."""
    p = plan([make_job("a", [100, 900, 300, 50] * 50, gbs=2)], PlanOptions(capacity=1024, use_milp=False))
    save_plan(p, tmp_path / "plan.json")
    text = (tmp_path / "plan.json").read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(SchedError, match=r"cut.json: not valid JSON \(EOF while parsing .*\); cut short") as info:
        load_plan(tmp_path / "cut.json")
    assert len(str(info.value)) < 200


def test_a_long_refused_value_is_shortened(tmp_path: Path) -> None:
    (tmp_path / "jobs.json").write_text(json.dumps({"adapters": [{"name": "a", "sample_tokens": "x" * 10_000}]}))
    with pytest.raises(SchedError) as info:
        load_jobs(tmp_path / "jobs.json")
    assert "xxx..." in str(info.value)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("load", [load_plan, load_jobs, read_lengths])
def test_a_folder_is_not_reported_missing(tmp_path: Path, load: Callable[[Path], object]) -> None:
    with pytest.raises(SchedError, match=r"is a folder; name a file"):
        load(tmp_path)


def test_a_jobs_file_takes_numbers_with_an_exponent_as_json_does(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads ``1e3`` as a string; a jobs file written as JSON means a number."""
    doc = '{"adapters": [{"name": "a", "sample_tokens": [3, 1e3, 1.5e3], "global_batch_size": 1}], '
    (tmp_path / "jobs.json").write_text(doc + '"options": {"capacity": 4.096e3}}')
    jobs, options = load_jobs(tmp_path / "jobs.json")
    assert jobs[0].sample_tokens == (3, 1000, 1500)
    assert options.capacity == 4096


def test_unknown_top_level_keys_of_any_type_are_named(tmp_path: Path) -> None:
    (tmp_path / "jobs.yaml").write_text("adapters: [{name: a, sample_tokens: [5], global_batch_size: 1}]\n1: x\nz: y\n")
    with pytest.raises(SchedError, match=r"unknown top-level keys \['1', 'z'\]"):
        load_jobs(tmp_path / "jobs.yaml")


def test_an_adapter_key_under_options_is_named_before_any_lengths_file_is_read(tmp_path: Path) -> None:
    # It used to surface as the lengths file's error (its field unknown), the misplaced key unmentioned.
    (tmp_path / "b.jsonl").write_text('{"text_tokens": 7}\n')
    (tmp_path / "jobs.yaml").write_text(
        "adapters: [{name: b, lengths_file: b.jsonl, global_batch_size: 1}]\n"
        "options: {capacity: 64, lengths_field: text_tokens}\n"
    )
    with pytest.raises(SchedError, match=r"options has \['lengths_field'\], which belong in an adapter's entry"):
        load_jobs(tmp_path / "jobs.yaml")


def test_a_plan_file_must_state_its_schema_version(tmp_path: Path) -> None:
    """Without it, the field's default made any document pass for schema 1."""
    p = plan([make_job("a", [100, 900, 300, 50], gbs=2)], PlanOptions(capacity=1024, use_milp=False))
    doc = json.loads(p.model_dump_json())
    del doc["schema_version"]
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    needle = r"plan.json: schema_version is missing: .* reads schema 1; add \"schema_version\": 1 if the file follows"
    with pytest.raises(SchedError, match=needle):
        load_plan(tmp_path / "plan.json")
    with pytest.raises(ValidationError, match="schema_version is missing"):
        Plan.model_validate_json(json.dumps(doc))
    assert Plan.model_validate(doc) == p, "built in Python, a plan may leave it to its default"


@pytest.mark.parametrize(
    ("version", "remedy"),
    [(2, "written by a newer lorafusion-sched: upgrade this one, or plan again with it"), (0, "plan again")],
)
def test_a_plan_of_another_schema_names_the_one_read_and_what_to_do(tmp_path: Path, version: int, remedy: str) -> None:
    p = plan([make_job("a", [100, 900, 300, 50], gbs=2)], PlanOptions(capacity=1024, use_milp=False))
    doc = json.loads(p.model_dump_json()) | {"schema_version": version}
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(SchedError) as info:
        load_plan(tmp_path / "plan.json")
    message = str(info.value)
    # "Input should be 1" first: a caller (lorafusion-megatron's checkpoint reader) matches it
    assert f"schema_version = {version}: Input should be 1, the plan schema lorafusion-sched " in message
    assert message.endswith(remedy)


def test_an_adapter_without_lengths_or_with_a_missing_lengths_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "jobs.yaml").write_text(
        "adapters:\n"
        "  - {name: a, sample_tokens: [5], global_batch_size: 1}\n"
        "  - {name: b, lengths_file: nope.jsonl, global_batch_size: 1}\n"
        "options: {capacity: 64}\n"
    )
    resolved = str((tmp_path / "data" / "nope.jsonl").resolve())
    with pytest.raises(SchedError) as info:
        load_jobs(tmp_path / "data" / "jobs.yaml")
    assert "adapters[1] ('b'): lengths_file 'nope.jsonl' does not exist" in str(info.value)
    assert f"(looked for {resolved!r}; a lengths_file is relative to the jobs file's folder)" in str(info.value)
    (tmp_path / "data" / "nope.jsonl").write_text("5\n0\n")
    with pytest.raises(SchedError, match=r"adapters\[1\] \('b'\): .*nope.jsonl:2: 0 is not a positive whole"):
        load_jobs(tmp_path / "data" / "jobs.yaml")


def test_a_plan_with_a_key_this_version_does_not_know_says_it_may_be_newer(tmp_path: Path) -> None:
    """``stats.new_stat = 3: Extra inputs are not permitted`` did not say why: a newer version wrote the plan."""
    from lorafusion_sched import __version__

    save_plan(
        plan([AdapterJob(name="a", sample_tokens=[5], global_batch_size=1)], PlanOptions(capacity=64)),
        tmp_path / "p.json",
    )
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["stats"]["new_stat"] = 3
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(
        SchedError, match=rf"stats.new_stat.*; a key this version \({__version__}\) does not know may come"
    ):
        load_plan(tmp_path / "p.json")


def test_save_plan_refuses_a_dict_as_the_other_functions_do(tmp_path: Path) -> None:
    """It raised ``AttributeError: 'dict' object has no attribute 'model_dump_json'``."""
    with pytest.raises(TypeError, match=r"plan has type dict, not Plan: .*Plan.model_validate"):
        save_plan({}, tmp_path / "p.json")  # type: ignore[arg-type]
    assert not (tmp_path / "p.json").exists()


def test_one_number_where_a_list_belongs_says_to_write_a_list(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text("adapters:\n  - {name: a, sample_tokens: 3, global_batch_size: 1}\noptions: {capacity: 64}\n")
    with pytest.raises(
        SchedError, match=r"adapters\[0\].sample_tokens = 3: Input should be a valid tuple; give a list, e.g. \[3\]"
    ):
        load_jobs(path)
