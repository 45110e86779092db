"""An interrupt or an error while ``demo`` builds its files, and what an interrupt's message promises.

The demo is built in a hidden folder and renamed into place when whole, so a build cut short leaves
nothing that would make the same command refuse its ``--output``. The line an interrupt prints names
``--resume`` only where a checkpoint exists to resume from, and otherwise the command that starts again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import lorafusion_megatron.demo as demo_module
from lorafusion_megatron.checkpoint import latest_checkpoint
from lorafusion_megatron.cli import main
from lorafusion_megatron.demo import build_demo

_SMALL = ["--samples-per-job", "4", "--epochs", "1"]


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return " ".join(capsys.readouterr().err.split())


def _then_interrupt(real: Any) -> Any:
    """``real``, after which a Ctrl-C comes (the files it wrote are there when it does)."""

    def step(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        raise KeyboardInterrupt

    return step


def _interrupt(*args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("step", "interrupted"),
    [
        ("_write_jsonl", _then_interrupt(demo_module._write_jsonl)),  # after the first dataset
        ("_save_base", _then_interrupt(demo_module._save_base)),  # the model and the data written
        ("_place", _interrupt),  # everything written, demo.yaml included, not yet renamed
    ],
    ids=["data", "model", "config"],
)
def test_a_ctrl_c_while_the_demo_is_built_leaves_nothing_and_the_same_command_builds_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    step: str,
    interrupted: Any,
) -> None:
    """It left ``data/*.jsonl`` (then ``base/``, ``demo.yaml``), and the same command refused the folder."""
    output = tmp_path / "runs" / "demo"  # ``runs`` is created by the demo too
    monkeypatch.setattr(demo_module, step, interrupted)
    argv = ["demo", "--output", str(output), *_SMALL]
    assert main(argv) == 130
    assert list(tmp_path.iterdir()) == [], "no half-built demo, staging folder or parent folder left"
    err = _err(capsys)
    assert (
        f"before the demo was built: its half-built files were deleted, so `lorafusion-megatron {' '.join(argv)}`"
        in err
    )
    assert "--resume" not in err, "no checkpoint exists"
    monkeypatch.undo()
    build_demo(output, samples_per_job=4, epochs=1)
    assert sorted(p.name for p in output.iterdir()) == ["base", "data", "demo.yaml"]


def test_a_ctrl_c_leaves_an_empty_output_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "demo"
    output.mkdir()
    monkeypatch.setattr(demo_module, "_save_base", _interrupt)
    assert main(["demo", "--output", str(output), *_SMALL]) == 130
    assert list(tmp_path.iterdir()) == [output]
    assert list(output.iterdir()) == []


def test_an_error_while_the_demo_is_built_leaves_no_half_built_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full_disk(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo_module, "_save_base", full_disk)
    assert main(["demo", "--output", str(tmp_path / "demo"), *_SMALL]) == 3
    assert "No space left on device" in _err(capsys)
    assert list(tmp_path.iterdir()) == []


def test_files_written_into_the_output_meanwhile_are_kept_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "demo"
    save_base = demo_module._save_base

    def another_process_writes(directory: Path, texts: list[str], seed: int) -> None:
        output.mkdir()
        (output / "notes.txt").write_text("mine")
        save_base(directory, texts, seed)

    monkeypatch.setattr(demo_module, "_save_base", another_process_writes)
    assert main(["demo", "--output", str(output), *_SMALL]) == 2
    assert f"{output} came to hold files while the demo was built there" in _err(capsys)
    assert list(tmp_path.iterdir()) == [output], "no staging folder left"
    assert [p.name for p in output.iterdir()] == ["notes.txt"]


def test_a_ctrl_c_after_the_demo_is_built_names_its_train_command_without_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Interrupted while the data was tokenised: the folder is whole; `demo` refuses it, `train` starts it."""
    import lorafusion_megatron.trainer as trainer_module

    output = tmp_path / "demo"
    monkeypatch.setattr(trainer_module, "prepare_data", _interrupt)
    assert main(["demo", "--output", str(output), *_SMALL]) == 130
    err = _err(capsys)
    command = f"lorafusion-megatron train {output / 'demo.yaml'}"
    assert f"interrupted at once; no checkpoint was written, so there is nothing to resume: `{command}` starts" in err
    assert "--resume" not in err
    assert {"base", "data", "demo.yaml"} <= {p.name for p in output.iterdir()}


def test_a_pipeline_demo_interrupted_before_training_names_its_parallel_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lorafusion_megatron.pipeline.launch as launch_module

    output = tmp_path / "demo"
    monkeypatch.setattr(launch_module, "launch", _interrupt)
    assert main(["demo", "--output", str(output), *_SMALL, "--pipeline-stages", "2"]) == 130
    assert f"`lorafusion-megatron train {output / 'demo.yaml'} --pipeline-stages 2` starts the run again" in _err(
        capsys
    )


def _stop_at_a_checkpoint_then_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run stops at its first microbatch and writes a checkpoint; a second Ctrl-C comes right after."""
    import lorafusion_megatron.trainer as trainer_module
    from lorafusion_megatron.executor import StopSignal

    class StopAtOnce(StopSignal):
        def __call__(self) -> bool:
            return True

    monkeypatch.setattr(trainer_module, "StopSignal", StopAtOnce)
    monkeypatch.setattr(
        trainer_module._Session, "save_checkpoint", _then_interrupt(trainer_module._Session.save_checkpoint)
    )


def test_a_demo_interrupted_after_a_checkpoint_names_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "demo"
    _stop_at_a_checkpoint_then_interrupt(monkeypatch)
    assert main(["demo", "--output", str(output), *_SMALL]) == 130
    err = _err(capsys)
    assert f"so {latest_checkpoint(output / 'checkpoints')} is intact" in err
    assert f"`lorafusion-megatron train {output / 'demo.yaml'} --resume` continues from it" in err


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_train_interrupted_before_any_checkpoint_starts_again_with_the_same_command(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said `train ... --resume` continues, and `--resume` then found no checkpoint."""
    import lorafusion_megatron.trainer as trainer_module

    argv = ["train", str(_write(tmp_path / "run.yaml", config_dict()))]
    monkeypatch.setattr(trainer_module, "prepare_data", _interrupt)
    assert main(argv) == 130
    err = _err(capsys)
    assert f"no checkpoint was written, so there is nothing to resume: `lorafusion-megatron {' '.join(argv)}`" in err
    assert "--resume" not in err
    monkeypatch.undo()
    assert main(argv) == 0


def test_a_train_interrupted_after_a_checkpoint_names_it_and_resume(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = config_dict()
    argv = ["train", str(_write(tmp_path / "run.yaml", data))]
    _stop_at_a_checkpoint_then_interrupt(monkeypatch)
    assert main(argv) == 130
    err = _err(capsys)
    checkpoint = latest_checkpoint(Path(data["output_dir"]) / "checkpoints")
    assert checkpoint is not None
    assert f"so {checkpoint} is intact; `lorafusion-megatron {' '.join(argv)} --resume` continues from it" in err
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
