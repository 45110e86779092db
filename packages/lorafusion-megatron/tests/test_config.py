from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafusion_megatron.config import (
    JobConfig,
    TrainerConfig,
    config_fingerprint,
    load_config,
    parse_config,
)
from lorafusion_megatron.errors import TrainerError

EXAMPLES = Path(__file__).parents[1] / "examples"


def _error(data: dict) -> str:
    with pytest.raises(TrainerError) as info:
        parse_config(data)
    return str(info.value)


def test_minimal_config_has_documented_defaults(config_dict) -> None:
    config = parse_config(config_dict())
    assert config.jobs[0].name == "first"
    assert config.scheduler.resolved_capacity == 256
    assert config.job_output_dir(config.jobs[0]) == Path(config.output_dir) / "adapters" / "first"
    for model in (TrainerConfig, JobConfig):
        undocumented = [name for name, field in model.model_fields.items() if not field.description]
        assert not undocumented, f"{model.__name__} fields without a docstring: {undocumented}"


def test_unknown_key_names_the_key_and_suggests(config_dict) -> None:
    data = config_dict()
    data["jobs"][1]["learning_rat"] = 1e-4
    data["base_model"]["dtyp"] = "float32"
    message = _error(data)
    assert "jobs.1.learning_rat: unknown key; did you mean 'learning_rate'?" in message
    assert "base_model.dtyp: unknown key; did you mean 'dtype'?" in message


def test_other_trainers_key_names_suggest_ours_not_a_close_spelling(config_dict) -> None:
    # difflib alone answered "did you mean 'r'?" for lr: following it would set the LoRA rank.
    data = config_dict()
    data["jobs"][0].update(lr=1e-4, batch_size=8)
    data["base_model"]["model"] = "tiny"
    message = _error(data)
    assert "jobs.0.lr: unknown key; did you mean 'learning_rate'?" in message
    assert "jobs.0.batch_size: unknown key; did you mean 'global_batch_size'?" in message
    assert "base_model.model: unknown key; did you mean 'model_name_or_path'?" in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"r": 0}, "jobs.0.r: Input should be greater than 0 (got 0)"),
        ({"lora_dropout": 1.0}, "jobs.0.lora_dropout"),
        ({"target_modules": []}, "target_modules is empty"),
        ({"name": "a b"}, "job name 'a b' must start with a letter or digit"),
        ({"name": "ora"}, "part of PEFT's parameter prefix"),
        ({"dataset": {"path": "x.jsonl", "synthetic": "xsum"}}, "give exactly one of `path`"),
        ({"dataset": {}}, "give exactly one of `path`"),
        ({"dataset": {"synthetic": "het"}}, "jobs.0.dataset.synthetic"),
        ({"val_size": 0}, "jobs.0.val_size: Input should be greater than 0 (got 0)"),
        ({"val_size": 1.5}, "val_size = 1.5 is neither a fraction below 1"),
        ({"val_size": 0.1, "eval_dataset": {"path": "e.jsonl"}}, "give either `val_size`"),
        ({"eval_steps": 5}, "jobs.0: eval_steps = 5 but job 'first' has no evaluation set: add `val_size`"),
        ({"eval_dataset": {"path": "e.jsonl", "split": "test"}}, "jobs.0.eval_dataset.split: unknown key"),
    ],
)
def test_bad_job_values_are_named(config_dict, change, expected) -> None:
    data = config_dict()
    data["jobs"][0].update(change)
    assert expected in _error(data)


def test_evaluation_keys_are_accepted(config_dict) -> None:
    data = config_dict()
    data["jobs"][0].update(val_size=0.1, eval_steps=5)
    data["jobs"][1].update(val_size=20, eval_dataset=None)
    config = parse_config(data)
    assert [job.evaluates for job in config.jobs] == [True, True]
    assert config.jobs[1].val_size == 20
    assert not parse_config(config_dict()).jobs[0].evaluates


@pytest.mark.parametrize(
    ("parallel", "reason"),
    [
        ({"pipeline_stages": 2}, "parallel.pipeline_stages = 2"),
        ({"data_parallel": 2}, "parallel.data_parallel = 2"),
        ({"schedule": "mlora"}, "parallel.schedule = mlora"),
    ],
)
def test_evaluation_is_refused_on_the_pipeline_runtime(config_dict, parallel, reason) -> None:
    data = config_dict(parallel=parallel)
    data["jobs"][1]["val_size"] = 0.2
    message = _error(data)
    assert (
        f"<top level>: job(s) second evaluate (val_size / eval_dataset), but {reason} runs on the pipeline" in message
    )
    assert "train on one process (pipeline_stages: 1, data_parallel: 1, schedule: lorafusion)" in message
    assert "(got {" not in message  # the whole config is not echoed back
    assert parse_config(config_dict(parallel=parallel)).parallel.schedule  # without evaluation: fine


def test_duplicate_job_names(config_dict) -> None:
    data = config_dict()
    data["jobs"][1]["name"] = "first"
    assert "jobs.1.name: job name 'first' appears twice" in _error(data)


def test_two_jobs_cannot_share_an_adapter_folder(config_dict) -> None:
    data = config_dict()
    data["jobs"][0]["output_dir"] = "/tmp/same"
    data["jobs"][1]["output_dir"] = "/tmp/same"
    assert "jobs.1.output_dir: jobs 'first' and 'second' both write their adapter to /tmp/same" in _error(data)


@pytest.mark.parametrize(
    ("place", "message"),
    [
        ("run", "and it holds output_dir"),
        (".", "and it holds output_dir"),
        ("data", "and it holds job 'first''s dataset"),
        ("other/nested", "write their adapters to"),
    ],
    ids=["the-run-folder", "above-the-run-folder", "the-data-folder", "inside-another-job"],
)
def test_an_adapter_folder_holds_nothing_the_run_needs(config_dict, tmp_path: Path, place: str, message: str) -> None:
    """A job's folder is replaced whole at its end: the run's own folder or its data there would be lost."""
    data = config_dict()
    data["output_dir"] = str(tmp_path / "run")
    data["jobs"][0]["dataset"] = {"path": str(tmp_path / "data" / "first.jsonl")}
    data["jobs"][0]["output_dir"] = str(tmp_path / "other")
    data["jobs"][1]["output_dir"] = str(tmp_path / place)
    if place == "data":
        data["jobs"][0]["output_dir"], data["jobs"][1]["output_dir"] = str(tmp_path / "data"), str(tmp_path / "b")
    error = _error(data)
    assert message in error
    key = "jobs.0.output_dir" if place == "data" else "jobs.1.output_dir"
    assert f"  - {key}: job" in error, "the key to change, not <top level>"


@pytest.mark.parametrize(
    "place",
    ["checkpoints", "checkpoints/mine", "summary.json", "plan.json", "pipeline_trace.json", ".lorafusion-run.lock"],
)
def test_an_adapter_folder_is_none_of_the_runs_own_outputs(config_dict, tmp_path: Path, place: str) -> None:
    """Regression: such a folder passed validation, then the whole run trained and failed at its end
    (a folder where ``summary.json`` goes; ``plan.json`` renamed away; checkpoints refused, the last
    steps lost). It is refused up front, naming the run's own file."""
    data = config_dict()
    data["jobs"][1]["output_dir"] = str(tmp_path / "run" / place)
    error = _error(data)
    assert f"the run writes its own {place.split('/')[0]} there (in output_dir)" in error
    assert str(tmp_path / "run" / "adapters" / "second") in error, "it names the default folder"


def test_an_adapter_folder_holds_no_tensorboard_logs(config_dict, tmp_path: Path) -> None:
    data = config_dict(logging={"progress_bar": False, "tensorboard_dir": str(tmp_path / "out" / "tb")})
    data["jobs"][0]["output_dir"] = str(tmp_path / "out")
    assert "and it holds logging.tensorboard_dir" in _error(data)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("jobs.0.r", True),
        ("jobs.0.max_steps", True),
        ("jobs.0.learning_rate", False),
        ("parallel.pipeline_stages", True),
    ],
)
def test_yaml_booleans_are_not_numbers(config_dict, where: str, value: bool) -> None:
    """Regression: ``max_steps: on`` (YAML's True) trained for one step; ``r: yes`` gave rank 1."""
    data = config_dict()
    node: Any = data
    *parents, key = where.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[key] = value
    assert f"{where}: a boolean, which this key does not take" in _error(data)


def test_a_job_name_too_long_for_a_file_name_is_refused(config_dict) -> None:
    """A 250-character name passed validate and crashed train (OSError: File name too long, status 3)."""
    data = config_dict()
    data["jobs"][0]["name"] = "j" * 100
    assert parse_config(data).jobs[0].name == "j" * 100
    data["jobs"][0]["name"] = "j" * 250
    assert "jobs.0.name: job name jjjjjjjjjjjjjjjjjjjj... is 250 characters long: use at most 100" in _error(data)


@pytest.mark.parametrize("inside", ["", "runs"])
def test_the_run_never_writes_into_the_model_folder(config_dict, tiny_base: Path, inside: str) -> None:
    """``output_dir`` could be the base model's folder: plan, summary, checkpoints and adapters went into it."""
    data = config_dict(base_model={"model_name_or_path": str(tiny_base)}, output_dir=str(tiny_base / inside))
    assert f"output_dir: {tiny_base / inside} is, or lies inside, the base model ({tiny_base})" in _error(data)


def test_boolean_keys_still_take_booleans(config_dict) -> None:
    data = config_dict(runtime={"device": "cpu", "seed": 0, "activation_checkpointing": True})
    data["scheduler"]["drop_last"] = True
    config = parse_config(data)
    assert config.runtime.activation_checkpointing is True
    assert config.scheduler.drop_last is True


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("target_modules", "q_proj", "jobs.0.target_modules: write a list, e.g. [q_proj]"),
        ("dataset", "data/x.jsonl", "jobs.0.dataset: write a mapping, e.g. dataset: {path: data/x.jsonl}"),
        ("base_model", "tiny", "base_model: write a mapping, e.g. base_model: {model_name_or_path: tiny}"),
    ],
)
def test_a_string_where_a_list_or_mapping_goes_says_how_to_write_it(
    config_dict, where: str, value: str, message: str
) -> None:
    data = config_dict()
    if where == "base_model":
        data["base_model"] = value
    else:
        data["jobs"][0][where] = value
    assert message in _error(data)


def test_capacity_must_be_a_multiple_of_padding(config_dict) -> None:
    message = _error(config_dict(scheduler={"capacity": 100, "padding_multiple": 64}))
    assert "capacity = 100 is not a multiple of padding_multiple = 64: use 64 or 128" in message
    message = _error(config_dict(scheduler={"capacity": 256, "padding_multiple": 1000}))
    assert "padding_multiple = 1000: use 1000 (or a smaller padding_multiple)" in message, "was: use 1000 or 1000"


@pytest.mark.parametrize("value", [16, 7.5, None])
def test_text_that_yaml_read_as_a_number_says_to_quote_it(config_dict, value: object) -> None:
    """``output_dir: 016`` or ``name: 007``: "Input should be a valid string (got 16)", no hint what to write."""
    message = _error(config_dict(output_dir=value))
    assert f"output_dir: Input should be a valid string (got {value!r}); put it in quotes to keep it as written" in (
        message
    )


def test_missing_required_keys(config_dict) -> None:
    data = config_dict()
    del data["output_dir"]
    assert "output_dir: required key is missing" in _error(data)
    assert "jobs: List should have at least 1 item" in _error(config_dict(jobs=[]))


def test_yaml_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: a\noutput_dir: b\n")
    with pytest.raises(TrainerError, match="key 'output_dir' appears twice"):
        load_config(path)


def test_integers_are_read_as_yaml_12_reads_them(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 read ``016`` as octal (14) and ``1:30`` as 90, silently."""
    path = tmp_path / "c.yaml"
    jobs = "jobs: [{name: one, dataset: {synthetic: xsum}, global_batch_size: 016, max_steps: 0x10}]\n"
    path.write_text("output_dir: out\nbase_model: {model_name_or_path: tiny}\n" + jobs)
    [job] = load_config(path).jobs
    assert (job.global_batch_size, job.max_steps) == (16, 16)
    path.write_text(path.read_text().replace("0x10", "1:30"))
    with pytest.raises(TrainerError, match=r"jobs\.0\.max_steps"):
        load_config(path)


def test_booleans_and_floats_are_read_as_yaml_12_reads_them(tmp_path: Path) -> None:
    """YAML 1.1 read ``no`` as false (a job named ``no`` was refused) and ``1.5e3`` as text."""
    path = tmp_path / "c.yaml"
    job = "{name: no, dataset: {synthetic: xsum, shuffle: off}, global_batch_size: 1.6e1, learning_rate: 2e-4}"
    path.write_text(
        f"output_dir: out\nbase_model: {{model_name_or_path: tiny}}\nscheduler: {{drop_last: yes}}\njobs: [{job}]\n"
    )
    config = load_config(path)
    [job_config] = config.jobs
    assert (job_config.name, job_config.global_batch_size, job_config.learning_rate) == ("no", 16, 2e-4)
    assert (job_config.dataset.shuffle, config.scheduler.drop_last) == (False, True)
    path.write_text(path.read_text() + "runtime: {activation_checkpointing: on}\n")
    with pytest.raises(TrainerError, match=r"activation_checkpointing: .*; on is text in a config file \(YAML 1\.2\)"):
        load_config(path)


def test_a_key_beside_a_merge_overrides_the_anchors(tmp_path: Path) -> None:
    """YAML's merge key: the mapping's own keys win. The duplicate check counted merged keys as its own."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "output_dir: out\nbase_model: {model_name_or_path: tiny}\nx-lora: &lora {r: 4, lora_alpha: 8}\n"
        "jobs:\n  - {name: one, <<: *lora, dataset: {path: one.jsonl}}\n"
        "  - name: two\n    <<: *lora\n    r: 8\n    dataset: {path: two.jsonl}\n"
    )
    config = load_config(path)
    assert [(job.r, job.lora_alpha) for job in config.jobs] == [(4, 8), (8, 8)]
    path.write_text(path.read_text() + "    r: 16\n")
    with pytest.raises(TrainerError, match="line 10: key 'r' appears twice"):
        load_config(path)


def test_an_override_inside_a_merged_anchor_wins_over_the_anchor_it_merges(tmp_path: Path) -> None:
    """PyYAML keeps merged keys by object identity: a one-letter ``r`` kept the inner anchor's value,
    and an anchor defined deeper than its use read as a key given twice."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "output_dir: out\nbase_model: {model_name_or_path: tiny}\n"
        "x-lora: &lora {r: 8, lora_alpha: 16}\nx-big: &big {<<: *lora, r: 64, lora_alpha: 128}\n"
        "x-sizes: {huge: &huge {<<: *big, r: 128}}\n"
        "jobs:\n  - &one {name: one, <<: *big, dataset: {synthetic: xsum}}\n  - {<<: *one, name: two}\n"
        "  - {<<: [*huge, *lora], name: three, dataset: {synthetic: xsum}}\n"
    )
    config = load_config(path)
    assert [(job.r, job.lora_alpha) for job in config.jobs] == [(64, 128), (64, 128), (128, 128)]


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "run.yaml").write_text(
        "output_dir: out\nbase_model: {model_name_or_path: tiny}\n"
        "jobs:\n  - name: one\n    dataset: {path: data/one.jsonl}\n"
    )
    config = load_config(folder / "run.yaml")
    assert config.output_dir == str(folder / "out")
    assert config.jobs[0].dataset.path == str(folder / "data" / "one.jsonl")
    assert config.base_model.model_name_or_path == "tiny"


def test_relative_paths_are_recorded_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config named by a relative path still gives absolute paths (adapters record the base model's)."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text(
        "output_dir: out\nbase_model: {model_name_or_path: models/base}\n"
        "jobs:\n  - name: one\n    dataset: {path: data/one.jsonl}\n"
    )
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("configs/run.yaml"))
    assert config.base_model.model_name_or_path == str(tmp_path / "configs" / "models" / "base")
    assert config.output_dir == str(tmp_path / "configs" / "out")


def test_overrides_set_dotted_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "output_dir: out\nbase_model: {model_name_or_path: tiny}\njobs:\n  - {name: one, dataset: {synthetic: xsum}}\n"
    )
    config = load_config(path, {"jobs.0.r": 4, "scheduler.capacity": 512})
    assert config.jobs[0].r == 4
    assert config.scheduler.capacity == 512


def test_overrides_name_a_job_by_index_or_name_and_say_what_is_wrong(tmp_path: Path) -> None:
    """``jobs.copy.r``, ``jobs.5`` and ``output_dir.x`` crashed with a traceback (status 3)."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "output_dir: out\nbase_model: {model_name_or_path: tiny}\n"
        "jobs:\n  - {name: one, dataset: {synthetic: xsum}}\n  - {name: two, dataset: {synthetic: xsum}}\n"
    )
    config = load_config(path, {"jobs.two.r": 4, "jobs.0.lora_alpha": 2})
    assert [(job.r, job.lora_alpha) for job in config.jobs] == [(16, 2), (4, 32)]
    for dotted, message in (
        ("jobs.copy.r", r"override jobs.copy.r: jobs has no entry 'copy': give an index from 0 to 1 or a name \(one"),
        ("jobs.5", r"jobs has no entry '5': give an index from 0 to 1"),
        ("jobs.².r", r"jobs has no entry '²': give an index from 0 to 1"),
        ("output_dir.x", r"override output_dir.x: output_dir is 'out' in .*, not a mapping or list, so it has no 'x'"),
    ):
        with pytest.raises(TrainerError, match=message):
            load_config(path, {dotted: 1})
    path.write_text(path.read_text().replace("name: two", "name: '0'"))
    with pytest.raises(TrainerError, match=r"jobs: '0' is both entry 0 and the name of entry 1; rename that job"):
        load_config(path, {"jobs.0.r": 4})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(TrainerError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_a_config_that_is_not_utf8_says_so(tmp_path: Path) -> None:
    """A Latin-1 byte crashed with a UnicodeDecodeError traceback (status 3)."""
    path = tmp_path / "run.yaml"
    path.write_bytes(b"output_dir: runs/caf\xe9\n")
    with pytest.raises(TrainerError, match=r"run.yaml is not UTF-8 text \(byte 20 is 0xe9\); save it as UTF-8"):
        load_config(path)


def test_a_union_key_gets_one_line_naming_its_alternatives(tmp_path: Path, config_dict) -> None:
    """pydantic's branch names (``capacity.constrained-int``, ``capacity.literal['auto']``) were two lines."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_dict()))
    with pytest.raises(TrainerError) as caught:
        load_config(path, {"scheduler.capacity": 0, "jobs.0.target_modules": 5})
    message = str(caught.value)
    assert "with --set scheduler.capacity, jobs.0.target_modules has 2 problem(s)" in message
    assert "scheduler.capacity: Input should be greater than 0, or be 'auto' (got 0)" in message
    assert "jobs.0.target_modules: Input should be a valid list, or be 'all-linear' (got 5)" in message
    assert "literal" not in message
    assert "constrained" not in message


def test_fingerprint_ignores_logging_and_outputs_only(config_dict) -> None:
    base = parse_config(config_dict())
    assert config_fingerprint(base) == config_fingerprint(
        parse_config(config_dict(logging={"tensorboard_dir": "tb"}, save_steps=3, output_dir="elsewhere"))
    )
    patient = config_dict(parallel={"collective_timeout_minutes": 90})  # how long a rank waits, not what it computes
    assert config_fingerprint(base) == config_fingerprint(parse_config(patient))
    changed = config_dict()
    changed["jobs"][0]["learning_rate"] = 5e-4
    assert config_fingerprint(base) != config_fingerprint(parse_config(changed))
    evaluated = config_dict()
    evaluated["jobs"][0].update(eval_dataset={"path": "eval.jsonl"}, eval_steps=3)
    assert config_fingerprint(base) == config_fingerprint(parse_config(evaluated))
    held_out = config_dict()
    held_out["jobs"][0]["val_size"] = 0.1  # decides which samples are trained on
    assert config_fingerprint(base) != config_fingerprint(parse_config(held_out))


def test_relative_eval_dataset_resolves_against_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(
        "output_dir: out\nbase_model: {model_name_or_path: tiny}\n"
        "jobs:\n  - {name: one, dataset: {path: a.jsonl}, eval_dataset: {path: data/b.jsonl}}\n"
    )
    assert load_config(tmp_path / "run.yaml").jobs[0].eval_dataset.path == str(tmp_path / "data" / "b.jsonl")


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_and_start_with_their_command(example: Path) -> None:
    first = example.read_text().splitlines()[0]
    assert first.startswith("# lorafusion-megatron ")
    assert example.name in first
    load_config(example)


def test_config_module_imports_no_torch() -> None:
    code = (
        "import sys, lorafusion_megatron.config, lorafusion_megatron.checks; "
        "heavy = {'torch', 'transformers', 'peft', 'megatron'} & set(sys.modules); "
        "assert not heavy, sorted(heavy)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fingerprint_is_the_hash_of_the_fingerprinted_data_unchanged_since_earlier_versions(config_dict) -> None:
    """Checkpoints store both; a change of either format would refuse every earlier checkpoint."""
    import hashlib
    import json

    from lorafusion_megatron.config import fingerprinted_config

    config = parse_config(config_dict())
    data = fingerprinted_config(config)
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    assert config_fingerprint(config) == hashlib.sha256(blob).hexdigest()[:16] == "7f65f2a84e89ef6a"
