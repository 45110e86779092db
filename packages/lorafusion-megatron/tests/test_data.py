from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from lorafusion_megatron.config import parse_config
from lorafusion_megatron.data.job_data import JobData, load_job_data, training_order
from lorafusion_megatron.data.records import first_record, read_records
from lorafusion_megatron.data.samples import IGNORE_INDEX, Sample, fit_to_capacity, tokenize_records
from lorafusion_megatron.data.tokenizer import byte_level_tokenizer, load_tokenizer
from lorafusion_megatron.errors import TrainerError

ROWS = [{"prompt": "ab", "response": "cd"}, {"prompt": "x", "response": "yz!"}]


def test_reads_jsonl_json_array_parquet_and_saved_dataset(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text('[{"prompt": "ab", "response": "cd"}, {"prompt": "x", "response": "yz!"}]')
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    for name in ("d.jsonl", "d.json", "d.parquet", "saved", "dict"):
        assert read_records(tmp_path / name) == ROWS, name
        assert first_record(tmp_path / name) == ROWS[0], name
    assert read_records(tmp_path / "d.jsonl", max_samples=1) == ROWS[:1]


def test_first_record_reads_only_up_to_it_and_none_when_empty(tmp_path: Path) -> None:
    import datasets

    (tmp_path / "later-bad.jsonl").write_text('\n{"prompt": "a", "response": "b"}\nnot json\n')
    assert first_record(tmp_path / "later-bad.jsonl") == {"prompt": "a", "response": "b"}
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert first_record(tmp_path / "blank.jsonl") is None
    assert read_records(tmp_path / "blank.jsonl") == []
    datasets.Dataset.from_dict({"prompt": [], "response": []}).save_to_disk(str(tmp_path / "saved-empty"))
    assert first_record(tmp_path / "saved-empty") is None
    assert read_records(tmp_path / "saved-empty") == []
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(TrainerError, match="not a readable Parquet file"):
        first_record(tmp_path / "broken.parquet")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("bad.jsonl", '{"prompt": 1}\nnot json\n', r"bad.jsonl:2 is not a JSON object: Expecting value \(column 1\)"),
        ("list.jsonl", "[1, 2]\n", r"list.jsonl record 1 of 2 is int"),
        ("lines.jsonl", '{"prompt": "a"}\n\n5\n', "lines.jsonl:3 is int, not an object"),
        ("data.csv", "a,b\n", "unknown kind '.csv'"),
        ("empty-folder", "", "not a folder written by datasets' save_to_disk"),
        ("latin1.jsonl", b'{"prompt": "caf\xe9"}\n', "latin1.jsonl is not UTF-8 text"),
    ],
)
def test_bad_dataset_files(tmp_path: Path, name: str, content: str | bytes | None, message: str) -> None:
    path = tmp_path / name
    if name == "empty-folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(TrainerError, match=message):
        read_records(path)
    if name not in ("bad.jsonl", "lines.jsonl"):  # their first record is fine
        with pytest.raises(TrainerError, match=message):
            first_record(path)


def test_prompt_tokens_are_masked_and_targets_shifted() -> None:
    tokenizer = byte_level_tokenizer()
    [sample, _] = tokenize_records(
        ROWS,
        tokenizer,
        prompt_field="prompt",
        response_field="response",
        text_field="text",
        messages_field="messages",
        source="t",
    )
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids = sample.input_ids.tolist()
    assert ids[0] == bos
    assert ids[-1] == eos
    assert len(ids) == 1 + 2 + 2 + 1
    # Positions 0..1 (BOS, 'a') predict prompt tokens: ignored; 'b' predicts 'c', ..., 'd' predicts EOS.
    assert sample.targets.tolist() == [IGNORE_INDEX, IGNORE_INDEX, ids[3], ids[4], eos, IGNORE_INDEX]
    assert sample.num_targets == 3


def test_text_records_train_on_everything_after_the_first_token() -> None:
    tokenizer = byte_level_tokenizer()
    [sample] = tokenize_records(
        [{"text": "hey"}],
        tokenizer,
        prompt_field="prompt",
        response_field="response",
        text_field="text",
        messages_field="messages",
        source="t",
    )
    assert sample.targets.tolist() == [*sample.input_ids.tolist()[1:], IGNORE_INDEX]


def _tokenize_default_fields(records: list[dict[str, object]]) -> object:
    return tokenize_records(
        records,
        byte_level_tokenizer(),
        prompt_field="prompt",
        response_field="response",
        text_field="text",
        messages_field="messages",
        source="t",
    )


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([{"q": "x"}], r"records need `messages`, `prompt` and `response`, or `text`; the first has \['q'\]"),
        (
            [{"prompt": "a", "response": "b"}, {"prompt": "a"}],
            r"record 2 of 2: has no `response` \(it has \['prompt'\]\)",
        ),
        ([{"prompt": "a", "response": "b"}, {"prompt": "a", "response": None}], "record 2 of 2: `response` is None"),
    ],
)
def test_records_without_the_fields_are_refused(records, expected) -> None:
    with pytest.raises(TrainerError, match=expected):
        _tokenize_default_fields(records)


def _sample(prompt: int, response: int) -> Sample:
    return Sample.from_tokens(list(range(prompt)), list(range(100, 100 + response)))


def test_fit_to_capacity_truncates_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    samples = [_sample(2, 3), _sample(2, 10), _sample(9, 3)]
    with caplog.at_level(logging.WARNING):
        kept, report = fit_to_capacity(samples, 8, "truncate", source="d")
    # The third sample's response starts after the capacity: nothing is left to train on.
    assert [len(s) for s in kept] == [5, 8]
    assert (report.truncated, report.dropped_long, report.dropped_empty) == (2, 0, 1)
    assert "2 sample(s) longer than the capacity of 8 tokens were truncated" in caplog.text


def test_fit_to_capacity_drops_by_switch_and_refuses_nothing_usable() -> None:
    kept, report = fit_to_capacity([_sample(2, 3), _sample(2, 10)], 8, "drop", source="d")
    assert [len(s) for s in kept] == [5]
    assert report.dropped_long == 1
    with pytest.raises(TrainerError, match="has no usable samples: 1 read, 1 longer than the capacity") as dropped:
        fit_to_capacity([_sample(2, 10)], 8, "drop", source="d")
    assert "or set scheduler.long_samples: truncate" in str(dropped.value)


def test_no_usable_samples_after_truncation_does_not_advise_truncating() -> None:
    """Regression: with long_samples: truncate (the default) already set, the error advised setting it."""
    with pytest.raises(TrainerError, match="1 truncated, 1 without a trained token") as cut:
        fit_to_capacity([_sample(10, 3)], 8, "truncate", source="d")
    assert "long_samples" not in str(cut.value)
    assert "raise scheduler.capacity" in str(cut.value)


def test_training_order_epochs_and_max_steps() -> None:
    order = training_order(5, global_batch_size=2, num_train_epochs=2, max_steps=None, shuffle=True, seed=3)
    assert sorted(order[:5].tolist()) == list(range(5))
    assert sorted(order[5:].tolist()) == list(range(5))
    assert order[:5].tolist() != order[5:].tolist()
    cycled = training_order(5, global_batch_size=4, num_train_epochs=1, max_steps=3, shuffle=False, seed=0)
    assert cycled.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_job_data_global_batches() -> None:
    samples = [_sample(1, n) for n in (2, 3, 4)]
    job = JobData(name="j", samples=samples, order=np.array([2, 0, 1]), global_batch_size=2)
    assert job.sample_tokens == (5, 3, 4)
    assert job.num_global_batches(drop_last=False) == 2
    assert job.num_global_batches(drop_last=True) == 1
    assert job.global_batch_targets(0) == 4 + 2
    assert job.global_batch_targets(1) == 3


def test_load_job_data_from_jsonl_and_synthetic(config_dict, jsonl_factory) -> None:
    path = jsonl_factory("words", 10)
    jobs = [
        {"name": "words", "dataset": {"path": str(path)}, "global_batch_size": 3},
        {"name": "synth", "dataset": {"synthetic": "cnndm", "num_samples": 7, "length_scale": 0.01}},
    ]
    config = parse_config(config_dict(jobs=jobs))
    tokenizer = load_tokenizer(config.base_model, vocab_size=512)
    words = load_job_data(config, config.jobs[0], tokenizer, 512)
    synth = load_job_data(config, config.jobs[1], None, 512)
    assert len(words) == 10
    assert words.num_global_batches(drop_last=False) == 4
    assert len(synth) == 7
    assert all(len(s) >= 2 for s in synth.samples)
    assert max(int(s.input_ids.max()) for s in synth.samples) < 512
    again = load_job_data(config, config.jobs[1], None, 512)
    assert synth.sample_tokens == again.sample_tokens


def test_tokenizer_must_fit_the_vocabulary(config_dict) -> None:
    config = parse_config(config_dict())
    with pytest.raises(TrainerError, match="the tokenizer has 259 tokens but the model's vocabulary only 100"):
        load_tokenizer(config.base_model, vocab_size=100)


def test_record_count_reads_no_more_than_it_needs(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lorafusion_megatron.data.records import record_count

    (tmp_path / "d.jsonl").write_text("\n" + "".join(json.dumps(r) + "\n\n" for r in ROWS) + "not json, counted\n")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(tmp_path / "saved-empty"))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    counts = {name: record_count(tmp_path / name) for name in ("d.json", "d.parquet", "saved", "dict")}
    assert counts == {"d.json": 2, "d.parquet": 2, "saved": 2, "dict": 2}
    assert record_count(tmp_path / "d.jsonl") == 3  # lines are counted, not parsed: training refuses the bad one
    assert record_count(tmp_path / "saved-empty") == record_count(tmp_path / "blank.jsonl") == 0
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(TrainerError, match="not a readable Parquet file"):
        record_count(tmp_path / "broken.parquet")


@pytest.mark.parametrize("name", ["a.jsonl", "a.json"])
def test_a_file_that_starts_with_a_byte_order_mark_is_read(tmp_path: Path, name: str) -> None:
    """Some editors save UTF-8 with a BOM: it was "Unexpected UTF-8 BOM" on the first record."""

    text = '{"text": "a"}\n{"text": "b"}\n' if name.endswith("l") else '[{"text": "a"}, {"text": "b"}]'
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_records(tmp_path / name) == [{"text": "a"}, {"text": "b"}]
