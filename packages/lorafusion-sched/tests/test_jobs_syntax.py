"""Jobs files: a key given twice is refused with its lines; .json is JSON; YAML booleans and integers are YAML 1.2's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafusion_sched import SchedError
from lorafusion_sched.io import load_jobs

ADAPTER = "{name: a, sample_tokens: [10, 20, 30], global_batch_size: 1}"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_second_options_block_is_refused_with_both_lines(tmp_path: Path) -> None:
    """It used to replace the first whole: the plan was made for 1 stage and capacity 128."""
    path = write(
        tmp_path,
        "jobs.yaml",
        f"adapters: [{ADAPTER}]\noptions: {{capacity: 4096, pipeline_stages: 4}}\noptions: {{capacity: 128}}\n",
    )
    with pytest.raises(SchedError, match=r"jobs.yaml:3: 'options' is given twice in one mapping \(first on line 2\)"):
        load_jobs(path)


def test_a_key_given_twice_inside_an_adapter_is_refused(tmp_path: Path) -> None:
    text = "adapters:\n  - name: a\n    sample_tokens: [10]\n    global_batch_size: 1\n    name: b\n"
    with pytest.raises(SchedError, match=r"jobs.yaml:5: 'name' is given twice in one mapping \(first on line 2\)"):
        load_jobs(write(tmp_path, "jobs.yaml", text))


def test_a_merge_key_is_not_a_repeated_key(tmp_path: Path) -> None:
    text = f"adapters: [{ADAPTER}]\noptions:\n  <<: {{capacity: 4096, pipeline_stages: 4}}\n  pipeline_stages: 2\n"
    _jobs, options = load_jobs(write(tmp_path, "jobs.yaml", text))
    assert (options.capacity, options.pipeline_stages) == (4096, 2), "the mapping's own key overrides the merged one"


def test_a_key_given_twice_in_a_json_jobs_file_is_refused_with_its_lines(tmp_path: Path) -> None:
    text = (
        '{\n "adapters": [{"name": "a", "sample_tokens": [10], "global_batch_size": 1}],\n'
        ' "options": {"capacity": 4096,\n  "pipeline_stages": 4,\n  "capacity": 128}\n}\n'
    )
    with pytest.raises(SchedError, match=r"jobs.json:5: 'capacity' is given twice in one mapping \(first on line 3\)"):
        load_jobs(write(tmp_path, "jobs.json", text))


def test_the_same_key_in_two_mappings_is_fine(tmp_path: Path) -> None:
    text = (
        '{"adapters": [{"name": "a", "sample_tokens": [10], "global_batch_size": 1},'
        ' {"name": "b", "sample_tokens": [10], "global_batch_size": 1}], "options": {"capacity": 64}}'
    )
    jobs, _options = load_jobs(write(tmp_path, "jobs.json", text))
    assert [j.name for j in jobs] == ["a", "b"]


@pytest.mark.parametrize(
    "text",
    [
        '{"adapters": [{"name": "a", "sample_tokens": [10], "global_batch_size": 1},], "options": {"capacity": 64}}',
        "{'adapters': [{'name': 'a', 'sample_tokens': [10], 'global_batch_size': 1}], 'options': {'capacity': 64}}",
        '# a comment\n{"adapters": [{"name": "a", "sample_tokens": [10], "global_batch_size": 1}]}',
        '{"adapters": [{"name": "a", "sample_tokens": [10], "global_batch_size": 1}], "options": {"capacity": 6',
    ],
    ids=["trailing-comma", "single-quotes", "comment", "cut-short"],
)
def test_a_json_jobs_file_is_read_as_json_with_a_one_line_error(tmp_path: Path, text: str) -> None:
    """Read as YAML, the first three were accepted and a cut-short file got PyYAML's multi-line message."""
    with pytest.raises(SchedError, match=r"jobs.json: not valid JSON \(.+ at line \d+ column \d+\); cut short") as info:
        load_jobs(write(tmp_path, "jobs.json", text))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("word", ["yes", "on", "Off", "no"])
def test_yaml_11_booleans_are_not_switches(tmp_path: Path, word: str) -> None:
    path = write(tmp_path, "jobs.yaml", f"adapters: [{ADAPTER}]\noptions: {{capacity: 64, drop_last: {word}}}\n")
    with pytest.raises(SchedError, match=rf"options.drop_last = '{word}': .*; write true or false \(yes, no, on"):
        load_jobs(path)


@pytest.mark.parametrize(("word", "value"), [("true", True), ("True", True), ("FALSE", False)])
def test_true_and_false_are_switches(tmp_path: Path, word: str, value: bool) -> None:
    path = write(tmp_path, "jobs.yaml", f"adapters: [{ADAPTER}]\noptions: {{capacity: 64, truncate: {word}}}\n")
    assert load_jobs(path)[1].truncate is value


@pytest.mark.parametrize(("text", "value"), [("1e1", 10), ("1.5e1", 15), ("+2.0E1", 20), ("3.", 3)])
def test_floats_with_an_unsigned_exponent_or_no_digits_after_the_dot_are_numbers(
    tmp_path: Path, text: str, value: int
) -> None:
    """YAML 1.1 needs a dot and a signed exponent: ``1.5e1`` was text, refused as a sample length."""
    adapter = f"{{name: a, sample_tokens: [{text}], global_batch_size: 1}}"
    path = write(tmp_path, "jobs.yaml", f"adapters: [{adapter}]\noptions: {{capacity: 64}}\n")
    assert load_jobs(path)[0][0].sample_tokens == (value,)


@pytest.mark.parametrize("word", ["no", "yes", "on", "off"])
def test_an_adapter_may_be_named_no(tmp_path: Path, word: str) -> None:
    """YAML 1.1 read these names as booleans and refused them as 'not a valid string'."""
    adapter = f"{{name: {word}, sample_tokens: [5], global_batch_size: 1}}"
    path = write(tmp_path, "jobs.yaml", f"adapters: [{adapter}]\noptions: {{capacity: 64}}\n")
    assert load_jobs(path)[0][0].name == word


@pytest.mark.parametrize(("word", "quoted"), [("null", '"null"'), ("123", '"123"'), ("true", '"true"')])
def test_a_name_that_is_not_text_says_to_quote_it(tmp_path: Path, word: str, quoted: str) -> None:
    path = write(tmp_path, "jobs.yaml", f"adapters: [{{name: {word}, sample_tokens: [5], global_batch_size: 1}}]\n")
    with pytest.raises(
        SchedError, match=rf"adapters\[0\].name = .*: Input should be a valid string; .*quotes \({quoted}\)"
    ):
        load_jobs(path)


@pytest.mark.parametrize(("text", "value"), [("016", 16), ("+010", 10), ("1_024", 1024), ("0o20", 16), ("0x10", 16)])
def test_integers_are_yaml_12s(tmp_path: Path, text: str, value: int) -> None:
    """YAML 1.1 read a leading zero as octal: ``016`` was 14, silently."""
    adapter = f"{{name: a, sample_tokens: [5, {text}], global_batch_size: 1}}"
    path = write(tmp_path, "jobs.yaml", f"adapters: [{adapter}]\noptions: {{capacity: 2048}}\n")
    assert load_jobs(path)[0][0].sample_tokens == (5, value)


def test_a_base_60_number_is_text_and_refused(tmp_path: Path) -> None:
    """YAML 1.1 read ``1:30`` as 90."""
    path = write(tmp_path, "jobs.yaml", f"adapters: [{ADAPTER}]\noptions: {{capacity: 1:30}}\n")
    with pytest.raises(SchedError, match=r"options.capacity = '1:30': give a whole number, not a string"):
        load_jobs(path)
