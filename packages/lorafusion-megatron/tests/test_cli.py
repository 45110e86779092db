from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from lorafusion_megatron.cli import main

EXAMPLES = Path(__file__).parents[1] / "examples"


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_validate_accepts_a_good_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLES / "tiny-synthetic.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    assert "short-docs" in out
    assert "long-docs" in out


def test_validate_names_the_bad_keys(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    data = config_dict()
    data["jobs"][0]["r"] = -1
    data["jobs"][1]["target_modules"] = ["q_proj", "qkv"]
    data["jobs"][1]["dataset"] = {"path": "missing.jsonl"}
    path = _write(tmp_path / "bad.yaml", data)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "jobs.0.r: Input should be greater than 0 (got -1)" in err
    data["jobs"][0]["r"] = 4
    _write(path, data)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "jobs.1 (second).dataset.path:" in err
    assert "missing.jsonl does not exist" in err
    assert "jobs.1 (second).target_modules: ['qkv'] are not linear layers of this model" in err


def test_validate_checks_the_eval_dataset_path(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    data = config_dict()
    data["jobs"][0]["eval_dataset"] = {"path": str(tmp_path / "missing-eval.jsonl")}
    assert main(["validate", str(_write(tmp_path / "eval.yaml", data))]) == 2
    assert "jobs.0 (first).eval_dataset.path:" in capsys.readouterr().err


def test_validate_checks_the_dataset_fields(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    """The first record must have the fields the config names, as training requires."""
    rows = tmp_path / "qa.jsonl"
    rows.write_text('{"question": "2+2?", "answer": "4"}\n')
    data = config_dict()
    data["jobs"][0]["dataset"] = {"path": str(rows)}
    assert main(["validate", str(_write(tmp_path / "qa.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "jobs.0 (first).dataset: dataset" in err
    assert "the first has ['answer', 'question']" in err
    data["jobs"][0]["dataset"].update(prompt_field="question", response_field="answer")
    assert main(["validate", str(_write(tmp_path / "qa.yaml", data))]) == 0


def test_validate_checks_parquet_and_saved_datasets(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parquet files and save_to_disk folders get the same field check, and unreadable ones are named."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "2+2?", "answer": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "qa-saved"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    data = config_dict()
    data["jobs"][0]["dataset"] = {"path": str(tmp_path / "qa.parquet")}
    data["jobs"][1]["dataset"] = {"path": str(tmp_path / "qa-saved")}
    assert main(["validate", str(_write(tmp_path / "qa.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "jobs.0 (first).dataset: dataset" in err
    assert "jobs.1 (second).dataset: dataset" in err
    assert err.count("the first has ['answer', 'question']") == 2
    for job in data["jobs"]:
        job["dataset"].update(prompt_field="question", response_field="answer")
    assert main(["validate", str(_write(tmp_path / "qa.yaml", data))]) == 0
    data["jobs"][0]["dataset"]["path"] = str(tmp_path / "broken.parquet")
    assert main(["validate", str(_write(tmp_path / "qa.yaml", data))]) == 2
    assert "broken.parquet is not a readable Parquet file" in capsys.readouterr().err
    datasets.Dataset.from_dict({"question": [], "answer": []}).save_to_disk(str(tmp_path / "empty-saved"))
    (tmp_path / "empty.jsonl").write_text("\n")
    data["jobs"][0]["dataset"]["path"] = str(tmp_path / "empty-saved")
    data["jobs"][1]["dataset"]["path"] = str(tmp_path / "empty.jsonl")
    assert main(["validate", str(_write(tmp_path / "qa.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "empty-saved has no records" in err
    assert "empty.jsonl has no records" in err


@pytest.mark.parametrize("flags", [["--pipeline-stages", "2"], ["--schedule", "mlora"]])
def test_train_refuses_evaluation_moved_to_the_pipeline_by_flags(
    tmp_path: Path, config_dict, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    data = config_dict()
    data["jobs"][0]["val_size"] = 0.25
    path = _write(tmp_path / "eval.yaml", data)
    assert main(["train", str(path), *flags]) == 2
    assert "pipeline runtime, which does not evaluate yet" in capsys.readouterr().err


def test_validate_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from lorafusion_megatron.cli import main; "
        f"status = main(['validate', {str(EXAMPLES / 'tiny-synthetic.yaml')!r}]); "
        "heavy = {'torch', 'transformers', 'peft', 'megatron'} & set(sys.modules); "
        "assert status == 0 and not heavy, (status, sorted(heavy))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_set_overrides_and_bad_override(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(EXAMPLES / "tiny-synthetic.yaml")
    assert main(["validate", config, "--set", "jobs.0.r=0"]) == 2
    assert "jobs.0.r: Input should be greater than 0" in capsys.readouterr().err
    assert main(["validate", config, "--set", "oops"]) == 2
    assert "write KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("jobs.0.target_modules=[q_proj", "expected ',' or ']'"),
        ("output_dir=@runs", "found character '@' that cannot start any token"),
        ("output_dir=*runs", "found undefined alias 'runs'"),
    ],
)
def test_a_set_value_that_is_not_yaml_says_what_to_write(
    capsys: pytest.CaptureFixture[str], value: str, problem: str
) -> None:
    """A PyYAML traceback and status 3 ("crashed") before."""
    assert main(["validate", str(EXAMPLES / "tiny-synthetic.yaml"), "--set", value]) == 2
    err = " ".join(capsys.readouterr().err.split())
    key = value.partition("=")[0]
    assert f"--set {value!r}: the value is not valid YAML ({problem}" in err
    assert f"""put text in quotes (--set '{key}="..."')""" in err


def test_a_seed_the_scheduler_cannot_take_is_refused_by_validate(capsys: pytest.CaptureFixture[str]) -> None:
    """``validate`` passed 2**31; ``plan`` and ``train`` then crashed in the scheduler's options (status 3)."""
    config = str(EXAMPLES / "tiny-synthetic.yaml")
    assert main(["validate", config, "--set", f"runtime.seed={2**31}"]) == 2
    assert "runtime.seed: Input should be less than or equal to 2147483647" in capsys.readouterr().err
    assert main(["validate", config, "--set", f"runtime.seed={2**31 - 1}"]) == 0


def test_validate_refuses_more_stages_than_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan`` and ``train`` refused it; ``validate`` passed it."""
    config = str(EXAMPLES / "tiny-synthetic.yaml")
    assert main(["validate", config, "--set", "parallel.pipeline_stages=3"]) == 2
    assert (
        "parallel.pipeline_stages (or --pipeline-stages) = 3 must be between 1 and the model's 2 decoder layers"
        in capsys.readouterr().err
    )
    assert main(["validate", config, "--set", "parallel.pipeline_stages=2"]) == 0
    assert main(["validate", config, "--set", "parallel.pipeline_stages=010"]) == 2
    assert "parallel.pipeline_stages (or --pipeline-stages) = 10 must be between" in capsys.readouterr().err, (
        "YAML 1.2: decimal, not octal 8"
    )


def test_plan_prints_statistics_and_writes_json(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "run.yaml", config_dict())
    assert main(["plan", str(path), "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "microbatches" in out
    assert "bubble ratio" in out
    assert "first: samples / optimizer steps" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schema_version"] == 1
    assert plan["capacity"] == 256


def test_plan_output_never_replaces_a_file_of_the_run(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan -o`` wrote over whatever it was given: the config, a job's dataset, a run's files."""
    data_file = tmp_path / "data.jsonl"
    data_file.write_text('{"text": "hello world"}\n' * 8)
    jobs = [{"name": "own", "dataset": {"path": str(data_file)}, "global_batch_size": 2}]
    path = _write(tmp_path / "run.yaml", config_dict(jobs=jobs))
    keep = {p: p.read_bytes() for p in (path, data_file)}
    run = tmp_path / "run"
    run.mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for output, says in (
        (path, "is the config file"),
        (data_file, "is jobs.0.dataset.path"),
        (run / "plan.json", "lies inside the run's output_dir"),
        (notes, "exists and is not a plan JSON"),
        (tmp_path, "it is a folder"),
        (tmp_path / "missing" / "plan.json", "does not exist"),
    ):
        assert main(["plan", str(path), "-o", str(output)]) == 2, output
        assert says in " ".join(capsys.readouterr().err.split())
    assert {p: p.read_bytes() for p in keep} == keep
    assert notes.read_text() == "mine"
    assert not (run / "plan.json").exists()
    assert main(["plan", str(path), "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["plan", str(path), "-o", str(tmp_path / "plan.json")]) == 0, "a plan file is replaced"


@pytest.mark.parametrize(
    ("capacities", "says"),
    [
        (["0"], "argument --capacities: 0 is less than 1"),
        (["-64"], "argument --capacities: -64 is less than 1"),
        (["100"], "--capacities 100 is not a multiple of scheduler.padding_multiple = 16: use 96 or 112"),
        (["999999999"], "--capacities 999999999: give token counts from 1 to 1,048,576"),
    ],
)
def test_profile_capacities_are_checked_before_any_process_starts(
    tmp_path: Path, config_dict, monkeypatch, capsys: pytest.CaptureFixture[str], capacities, says
) -> None:
    """They failed in the rank processes after the model loaded (0, 100), or ran until killed."""
    import lorafusion_megatron.pipeline.launch as launch

    monkeypatch.setattr(launch, "launch_profile", lambda *a, **k: pytest.fail("no process may start"))
    path = _write(tmp_path / "run.yaml", config_dict())
    with contextlib.suppress(SystemExit):  # argparse's refusals exit with status 2
        assert main(["profile", str(path), "--capacities", *capacities]) == 2
    assert says in " ".join(capsys.readouterr().err.split())


def test_profile_capacities_are_measured_once_each_in_order(tmp_path: Path, config_dict, monkeypatch) -> None:
    import lorafusion_megatron.pipeline.launch as launch

    seen = []
    monkeypatch.setattr(launch, "launch_profile", lambda config, parallel, **options: seen.append(options))
    path = _write(tmp_path / "run.yaml", config_dict())
    assert main(["profile", str(path), "--capacities", "64", "32", "64"]) == 0
    assert seen == [{"candidates": (32, 64)}]


def test_plan_with_auto_capacity_uses_the_profile_or_says_it_has_none(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    data = config_dict(scheduler={"capacity": "auto", "padding_multiple": 16})
    path = _write(tmp_path / "run.yaml", data)
    assert main(["plan", str(path), "-o", str(tmp_path / "plan.json")]) == 0
    assert "holds no profile.json: planned at 4096 tokens" in " ".join(capsys.readouterr().err.split())
    assert json.loads((tmp_path / "plan.json").read_text())["capacity"] == 4096
    Path(data["output_dir"]).mkdir(parents=True)
    (Path(data["output_dir"]) / "profile.json").write_text(json.dumps({"chosen_capacity": 192}))
    assert main(["plan", str(path), "-o", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["capacity"] == 192


def test_train_with_auto_capacity_profiles_first_when_due(
    tmp_path: Path, config_dict, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where a profile is due (on GPUs), ``train`` runs ``profile`` first and trains at its choice."""
    from lorafusion_megatron.pipeline import commands
    from lorafusion_megatron.profiler import run

    profiled = []

    def fake_profile(config, parallel, console, **options) -> int:
        profiled.append(config.output_dir)
        (Path(config.output_dir) / "profile.json").write_text(json.dumps({"chosen_capacity": 128}))
        return 0

    monkeypatch.setattr(run, "profile_due", lambda config, *, device_type, resume: not resume)
    monkeypatch.setattr(commands, "profile", fake_profile)
    data = config_dict(scheduler={"capacity": "auto", "padding_multiple": 16})
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 0
    assert profiled == [data["output_dir"]]
    assert "profiling the model first" in " ".join(capsys.readouterr().err.split())
    assert json.loads((Path(data["output_dir"]) / "plan.json").read_text())["capacity"] == 128


def test_plan_of_a_pipeline_weighs_its_stages(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "run.yaml", config_dict())
    assert main(["plan", str(path), "--set", "parallel.pipeline_stages=2"]) == 0
    assert "partition" in capsys.readouterr().out  # the simulator runs the stages the runtime builds


def test_recomputed_layer_counts_are_checked_against_the_stages_the_run_uses(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """One count per stage, of the stages the command line gives; no count above a stage's layers."""
    data = config_dict()
    data["runtime"] = {"activation_checkpointing": [1, 1]}
    path = _write(tmp_path / "run.yaml", data)
    assert main(["validate", str(path)]) == 2
    assert "gives 2 counts for 1 pipeline stage(s)" in capsys.readouterr().err
    assert main(["plan", str(path), "--pipeline-stages", "2"]) == 0  # the tiny preset: 1 layer per stage
    capsys.readouterr()
    assert main(["plan", str(path), "--pipeline-stages", "2", "--set", "runtime.activation_checkpointing=[1, 2]"]) == 2
    assert "stage 1 holds 1 decoder layer(s) (layers 1 to 1), so it can recompute 0 to 1 of them, not 2" in (
        capsys.readouterr().err
    )


def test_train_then_export_merged_model(tmp_path: Path, config_dict, tiny_base: Path) -> None:
    data = config_dict(base_model={"model_name_or_path": str(tiny_base), "dtype": "float32"})
    path = _write(tmp_path / "run.yaml", data)
    assert main(["train", str(path)]) == 0
    adapter = Path(data["output_dir"]) / "adapters" / "first"
    assert main(["export", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    assert main(["export", str(adapter), "--output", str(tmp_path / "merged")]) == 2, "a merged model is there"
    assert main(["export", str(adapter), "--output", str(tmp_path / "merged"), "--overwrite"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".merged")) == [], "no staging left"


def test_export_never_overwrites_its_own_inputs(
    tmp_path: Path, config_dict, tiny_base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--overwrite`` replaced whatever ``--output`` named: a run folder holding the adapter, or the base."""
    data = config_dict(base_model={"model_name_or_path": str(tiny_base), "dtype": "float32"})
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 0
    run = Path(data["output_dir"])
    adapter = run / "adapters" / "first"
    for output, what in ((run, "the adapter"), (adapter, "the adapter"), (tiny_base, "the base model")):
        capsys.readouterr()
        assert main(["export", str(adapter), "--output", str(output), "--overwrite"]) == 2
        assert f"is or holds {what}" in " ".join(capsys.readouterr().err.split())
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (tiny_base / "config.json").is_file()


def test_export_names_a_damaged_adapter_or_a_base_of_other_shapes(
    tmp_path: Path, config_dict, tiny_base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated config, missing weights and a wider base gave tracebacks (status 3)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = config_dict(base_model={"model_name_or_path": str(tiny_base), "dtype": "float32"})
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 0
    adapter = Path(data["output_dir"]) / "adapters" / "first"

    def export(folder: Path, *extra: str) -> str:
        capsys.readouterr()
        assert main(["export", str(folder), "--output", str(tmp_path / "merged"), *extra]) == 2
        return " ".join(capsys.readouterr().err.split())

    truncated = shutil.copytree(adapter, tmp_path / "truncated")
    (truncated / "adapter_config.json").write_text('{"r": 4,')
    assert "adapter_config.json cannot be read (Expecting" in export(truncated)
    weightless = shutil.copytree(adapter, tmp_path / "weightless")
    (weightless / "adapter_model.safetensors").unlink()
    assert "holds no adapter weights (adapter_model.safetensors or adapter_model.bin)" in export(weightless)
    config = AutoConfig.from_pretrained(tiny_base)
    config.hidden_size *= 2
    wider = tmp_path / "wider"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(wider)
    assert f"does not fit base model {wider} (size mismatch" in export(adapter, "--base", str(wider))


def test_export_refuses_a_preset_base(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    data = config_dict()
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 0
    adapter = Path(data["output_dir"]) / "adapters" / "first"
    assert main(["export", str(adapter), "--output", str(tmp_path / "merged")]) == 2
    assert "presets have random weights" in capsys.readouterr().err


def test_demo_writes_base_config_and_adapters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--output", str(tmp_path / "demo"), "--samples-per-job", "16", "--epochs", "1"]) == 0
    err = capsys.readouterr().err
    assert "LoRAFusion training summary" in err
    for job in ("copy", "reverse", "sort", "shout"):
        assert (tmp_path / "demo" / "adapters" / job / "adapter_model.safetensors").is_file()
        assert job in err
    assert (tmp_path / "demo" / "base" / "tokenizer.json").is_file()
    first_line = (tmp_path / "demo" / "demo.yaml").read_text().splitlines()[0]
    assert first_line.startswith("# lorafusion-megatron train ")
    assert main(["validate", str(tmp_path / "demo" / "demo.yaml")]) == 0
    data = tmp_path / "demo" / "data" / "copy.jsonl"
    before = data.read_bytes()
    assert main(["demo", "--output", str(tmp_path / "demo")]) == 2, "a second demo into the same folder"
    assert "is not an empty folder" in capsys.readouterr().err
    assert data.read_bytes() == before, "refused before writing anything"


@pytest.mark.parametrize("flag", ["--samples-per-job", "--epochs"])
def test_demo_refuses_counts_below_one_before_writing(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--output", str(tmp_path / "demo"), flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: 0 is less than 1" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("command", ["plan", "train", "profile"])
@pytest.mark.parametrize("flag", ["--pipeline-stages", "--data-parallel", "--baseline-microbatch-samples"])
def test_parallel_flags_below_one_are_refused_by_the_parser(
    tmp_path: Path, config_dict, command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "run.yaml", config_dict())
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(config), flag, "0"])
    assert exit_info.value.code == 2, "a usage error, not a traceback (status 3)"
    assert f"argument {flag}: 0 is less than 1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_fresh_train_refuses_an_earlier_runs_results(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "run.yaml", config_dict())
    adapter = tmp_path / "run" / "adapters" / "second" / "adapter_config.json"
    adapter.parent.mkdir(parents=True)
    adapter.write_text("{}")
    assert main(["train", str(config)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "adapters/second holds results of an earlier run" in err
    assert "--overwrite" in err
    assert adapter.read_text() == "{}"
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert main(["train", str(config)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'run' / 'summary.json'}, {adapter.parent} hold results of an earlier run" in err


def test_a_file_where_a_folder_belongs_says_so(tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "cannot be created or written"."""
    (tmp_path / "tb").write_text("mine")
    config = _write(tmp_path / "run.yaml", config_dict(logging={"tensorboard_dir": str(tmp_path / "tb")}))
    assert main(["validate", str(config)]) == 2
    assert f"logging.tensorboard_dir: {tmp_path / 'tb'} is a file: name a folder" in capsys.readouterr().err


def test_a_job_folder_of_other_files_is_never_replaced(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite replaces adapters only: a folder without adapter_config.json (say, a dataset) is refused."""
    data = config_dict()
    data["jobs"][1]["output_dir"] = str(tmp_path / "shared")
    notes = tmp_path / "shared" / "notes.jsonl"
    notes.parent.mkdir()
    notes.write_text('{"text": "mine"}\n')
    config = _write(tmp_path / "run.yaml", data)
    for command in (["train", str(config)], ["train", str(config), "--overwrite"], ["validate", str(config)]):
        assert main(command) == 2, "validate said valid where train refused"
        err = " ".join(capsys.readouterr().err.split())
        assert "holds files that are not a PEFT adapter (no adapter_config.json)" in err
    assert notes.read_text() == '{"text": "mine"}\n'


def test_overwrite_says_which_earlier_adapters_it_leaves(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh run with fewer jobs kept the earlier run's other adapters beside its own, silently."""
    config = _write(tmp_path / "run.yaml", config_dict())
    earlier = tmp_path / "run" / "adapters" / "gone"
    earlier.mkdir(parents=True)
    (earlier / "adapter_config.json").write_text("{}")
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert main(["train", str(config), "--overwrite"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{earlier} hold(s) an earlier run's adapter that none of this run's jobs writes" in err
    assert (earlier / "adapter_config.json").read_text() == "{}"


def test_a_job_folder_that_is_a_file_is_refused_before_training(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the run trained to its end, then ``shutil.rmtree`` failed on the file."""
    data = config_dict()
    data["jobs"][1]["output_dir"] = str(tmp_path / "notes.txt")
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 2
    assert "notes.txt is a file; the job writes an adapter folder there" in " ".join(capsys.readouterr().err.split())
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "run" / "plan.json").exists(), "refused before planning"


def test_overwrite_names_the_checkpoints_it_keeps(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path / "run.yaml", config_dict())
    (tmp_path / "run" / "summary.json").parent.mkdir(parents=True)
    (tmp_path / "run" / "summary.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    assert main(["train", str(config)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "summary.json holds results of an earlier run" in err
    assert f"and {tmp_path / 'run' / 'checkpoints'} its checkpoints, which --overwrite never deletes" in err
    assert f"delete {tmp_path / 'run' / 'checkpoints'}, then pass --overwrite" in err


def test_an_interrupted_train_prints_the_users_own_command_to_continue(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With its --set overrides (a resume without them would look in another output_dir), not 'CONFIG'."""
    import lorafusion_megatron.trainer as trainer_module
    from lorafusion_megatron.executor import StopSignal

    class StopAtOnce(StopSignal):
        def __call__(self) -> bool:
            return True

    monkeypatch.setattr(trainer_module, "StopSignal", StopAtOnce)
    config = _write(tmp_path / "my run.yaml", config_dict())
    argv = ["train", str(config), "--set", f"output_dir={tmp_path / 'other'}", "--overwrite"]
    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    quoted = f"'{tmp_path / 'my run.yaml'}'"
    assert f"Continue with: lorafusion-megatron train {quoted} --set output_dir={tmp_path / 'other'} --resume" in err


def test_a_ctrl_c_outside_training_is_a_message_not_a_traceback(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lorafusion_megatron.trainer as trainer_module

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "prepare_data", interrupted)
    assert main(["train", str(_write(tmp_path / "run.yaml", config_dict()))]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert "interrupted at once; no checkpoint was written, so there is nothing to resume" in err
    assert "--resume" not in err, "no checkpoint to resume from"
    assert "Traceback" not in err


def test_a_ctrl_c_in_another_command_says_nothing_of_resuming(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lorafusion_megatron.cli as cli_module

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_cmd_export", interrupted)
    assert main(["export", str(tmp_path / "adapter"), "--output", str(tmp_path / "merged")]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert "interrupted: outputs are written whole or not at all" in err
    assert "--resume" not in err


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_validate_refuses_chats_for_a_tokenizer_without_a_chat_template(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """Training would stop at tokenizing; validate names the dataset and the tokenizer first."""
    from lorafusion_megatron.data.tokenizer import byte_level_tokenizer

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(CHAT) + "\n")
    data = config_dict()
    data["jobs"][0]["dataset"] = {"path": str(chats)}
    assert main(["validate", str(_write(tmp_path / "chat.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "jobs.0 (first).dataset: dataset" in err
    assert "chats.jsonl holds chats, but the tokenizer (a byte-level tokenizer) has no chat template" in err
    plain, templated = tmp_path / "plain-tokenizer", tmp_path / "chat-tokenizer"
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(plain)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(templated)
    data["base_model"]["tokenizer_name_or_path"] = str(plain)
    assert main(["validate", str(_write(tmp_path / "chat.yaml", data))]) == 2
    assert f"the tokenizer ({plain}) has no chat template" in " ".join(capsys.readouterr().err.split())
    data["base_model"]["tokenizer_name_or_path"] = str(templated)
    assert main(["validate", str(_write(tmp_path / "chat.yaml", data))]) == 0


def test_validate_refuses_a_val_size_that_leaves_nothing_to_train_on(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """Counted from the records (max_samples applied) or a synthetic dataset's num_samples, as training splits."""
    rows = tmp_path / "four.jsonl"
    rows.write_text("".join(json.dumps({"text": f"sample {i}"}) + "\n" for i in range(4)))
    data = config_dict()
    data["jobs"][0].update(dataset={"path": str(rows)}, val_size=4)
    data["jobs"][1]["val_size"] = 20
    assert main(["validate", str(_write(tmp_path / "val.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "four.jsonl: val_size = 4 holds out 4 of its 4 samples, leaving none to train on" in err
    assert "jobs.1 (second).val_size: dataset synthetic wikisum (num_samples: 12): val_size = 20 asks to" in err
    assert "hold out 20 samples, but it has 12, leaving none to train on: lower val_size (a count below 12" in err
    data["jobs"][0].update(val_size=3, dataset={"path": str(rows), "max_samples": 3})
    data["jobs"][1]["val_size"] = 0.5
    assert main(["validate", str(_write(tmp_path / "val.yaml", data))]) == 2
    assert "four.jsonl (max_samples: 3): val_size = 3 holds out 3 of its 3" in " ".join(capsys.readouterr().err.split())
    data["jobs"][0]["dataset"].pop("max_samples")
    assert main(["validate", str(_write(tmp_path / "val.yaml", data))]) == 0


@pytest.mark.parametrize("gpu", [False, True])
def test_validate_warns_that_device_cuda_has_no_gpu_here(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gpu: bool
) -> None:
    """A warning, not an error: validate runs on login nodes, which often have no GPU; train refuses it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    data = config_dict(runtime={"device": "cuda"})
    assert main(["validate", str(_write(tmp_path / "cuda.yaml", data))]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert ("warning: runtime.device is cuda but this host has no GPU that torch can use" in err) is not gpu


def test_validate_and_train_say_once_that_tensorboard_is_not_installed(
    tmp_path: Path,
    config_dict,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lorafusion_megatron import host_checks

    monkeypatch.setattr(host_checks, "_tensorboard_installed", lambda: False)
    path = _write(tmp_path / "tb.yaml", config_dict(logging={"progress_bar": False, "tensorboard_dir": "tb"}))
    assert main(["validate", str(path)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: logging.tensorboard_dir is set but TensorBoard is not installed" in err
    assert '`pip install "lorafusion-megatron[tensorboard]"`' in err
    assert main(["train", str(path)]) == 0
    assert " ".join(capsys.readouterr().err.split()).count("TensorBoard is not installed") == 1
    assert not [record for record in caplog.records if "TensorBoard" in record.getMessage()]
    assert not (tmp_path / "tb").exists()


def test_an_unexpected_error_exits_with_its_own_status(
    tmp_path: Path, config_dict, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Status 1 means "interrupted, checkpoint written" (a job scheduler resumes it); a crash was 1 too."""
    from lorafusion_megatron import trainer

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer, "prepare_data", crash)
    path = _write(tmp_path / "run.yaml", config_dict())
    assert main(["train", str(path)]) == 3
    err = " ".join(capsys.readouterr().err.split())
    assert "No space left on device" in err
    assert "crashed (status 3). Checkpoints are written whole or not at all: `train ... --resume`" in err
    assert main(["plan", str(path)]) == 3
    err = " ".join(capsys.readouterr().err.split())
    assert "crashed (status 3). Outputs are written whole or not at all" in err
    assert "--resume" not in err, "plan has no checkpoint to resume from"


@pytest.fixture
def sigterm_fallback():
    """A SIGTERM handler for the test's duration: one the CLI leaves unhandled fails the test, not pytest."""

    def unhandled(signum, frame):
        raise RuntimeError("the CLI left SIGTERM to the test's handler")

    previous = signal.signal(signal.SIGTERM, unhandled)
    yield unhandled
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_export_deletes_its_staging_folder(
    tmp_path: Path,
    tiny_base: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sigterm_fallback,
) -> None:
    """SIGTERM ended the process at once (status 143 from the shell), leaving a whole model in .merged.tmp-*."""
    import lorafusion_megatron.export as export_module
    from lorafusion_megatron.adapters_io import save_adapter
    from lorafusion_megatron.testing import tiny_peft_model

    model, _ = tiny_peft_model(["first"])
    save_adapter(model, "first", tmp_path / "adapter")

    def terminated(source: Path, target: Path) -> None:  # the staged model is complete, not yet renamed
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(export_module, "replace_dir", terminated)
    argv = ["export", str(tmp_path / "adapter"), "--output", str(tmp_path / "merged"), "--base", str(tiny_base)]
    assert main(argv) == 143
    err = " ".join(capsys.readouterr().err.split())
    assert "interrupted by SIGTERM: outputs are written whole or not at all" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "no staging folder, no merged model"
    assert signal.getsignal(signal.SIGTERM) is sigterm_fallback, "the handler before the command is back"


def test_a_sigterm_before_training_is_taken_like_ctrl_c(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], sigterm_fallback
) -> None:
    import lorafusion_megatron.trainer as trainer_module

    def terminated(config):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(trainer_module, "prepare_data", terminated)
    assert main(["train", str(_write(tmp_path / "run.yaml", config_dict()))]) == 143
    err = " ".join(capsys.readouterr().err.split())
    assert "interrupted by SIGTERM at once; no checkpoint was written" in err
    assert "Traceback" not in err


def test_a_ctrl_c_while_the_final_adapters_are_written_lets_every_one_be_written(
    tmp_path: Path,
    config_dict,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A first Ctrl-C there aborted at once: the jobs after the one being written had no final adapter."""
    import lorafusion_megatron.trainer as trainer_module
    from lorafusion_megatron.adapters_io import save_adapter

    def ctrl_c_then_save(model, adapter: str, directory: Path) -> None:
        if adapter == "first":
            os.kill(os.getpid(), signal.SIGINT)
        save_adapter(model, adapter, directory)

    monkeypatch.setattr(trainer_module, "save_adapter", ctrl_c_then_save)
    data = config_dict()
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 130
    run = Path(data["output_dir"])
    for job in ("first", "second"):
        assert (run / "adapters" / job / "adapter_model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["adapters"].keys() == {"first", "second"}
    assert "SIGINT: the run is done; writing the remaining adapters and summary.json, then exiting" in caplog.text
    assert "press Ctrl-C again to abort at once" in caplog.text
    err = " ".join(capsys.readouterr().err.split())
    assert "SIGINT came as the run ended: every job's adapter and summary.json were written first" in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_between_the_last_microbatch_and_the_final_adapters_lets_them_be_written(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], sigterm_fallback
) -> None:
    """The loop's stop handler used to be gone there (TensorBoard's flush): the run ended with no adapter at all."""
    import lorafusion_megatron.trainer as trainer_module

    close = trainer_module._Session.close

    def sigterm_then_close(session) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        close(session)

    monkeypatch.setattr(trainer_module._Session, "close", sigterm_then_close)
    data = config_dict()
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 143
    run = Path(data["output_dir"])
    for job in ("first", "second"):
        assert (run / "adapters" / job / "adapter_model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["adapters"].keys() == {"first", "second"}
    err = " ".join(capsys.readouterr().err.split())
    assert "SIGTERM came as the run ended: every job's adapter and summary.json were written first" in err
    assert signal.getsignal(signal.SIGTERM) is sigterm_fallback


def test_a_second_ctrl_c_while_the_final_adapters_are_written_aborts_at_once(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lorafusion_megatron.trainer as trainer_module

    def two_ctrl_cs(model, adapter: str, directory: Path) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second Ctrl-C did not abort")

    monkeypatch.setattr(trainer_module, "save_adapter", two_ctrl_cs)
    data = config_dict()
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 130
    assert not (Path(data["output_dir"]) / "summary.json").exists()
    err = " ".join(capsys.readouterr().err.split())
    assert "interrupted at once" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        (["-v", "validate", "run.yaml"], True),
        (["validate", "run.yaml", "-v"], True),
        (["export", "adapter", "--output", "merged", "--verbose"], True),
        (["validate", "run.yaml"], False),
    ],
)
def test_verbose_goes_before_or_after_the_command(argv: list[str], verbose: bool) -> None:
    from lorafusion_megatron.cli import _parser

    assert _parser().parse_args(argv).verbose is verbose
