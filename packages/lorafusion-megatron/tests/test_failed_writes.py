"""Writes that fail (a full disk, a read-only file system) and runs that fail among their final writes.

A full disk while a checkpoint or the final adapters were written was a traceback (status 3) whose
hint said that ``--resume`` continues from the newest checkpoint, also when there was none; and a
``train --overwrite`` that failed among its final adapter writes left the earlier run's
``summary.json``, so ``--resume`` called the folder complete over a mix of both runs' adapters.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml

from lorafusion_megatron.cli import main
from lorafusion_megatron.config import parse_config
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.trainer import Trainer
from lorafusion_megatron.write_errors import write_failure

_NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"
"""What safetensors raised on a full disk (a ``SafetensorError``, not an ``OSError``)."""


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_reason_of_a_failed_write_is_what_the_os_says(tmp_path: Path) -> None:
    from safetensors import SafetensorError

    assert write_failure(SafetensorError(_NO_SPACE)) == "No space left on device"
    assert write_failure(OSError(errno.EROFS, os.strerror(errno.EROFS))) == "Read-only file system"
    torch_full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    reason = write_failure(torch_full, tmp_path)
    assert reason is not None
    assert reason.startswith("torch.save failed ([enforce fail at inline_container.cc:672]")
    assert "KiB free on its file system" in reason
    assert write_failure(ValueError("not a write")) is None
    assert write_failure(RuntimeError("CUDA out of memory")) is None


@pytest.mark.parametrize("failing_save", [1, 2])
def test_a_checkpoint_on_a_full_disk_is_a_clear_error_naming_what_is_left(
    tmp_path: Path,
    config_dict,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failing_save: int,
) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file
    calls = []

    def fills_the_disk(tensors, filename, *args, **kwargs):  # checkpoint.py's lora.safetensors
        calls.append(filename)
        if len(calls) == failing_save:
            raise SafetensorError(_NO_SPACE)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    data = config_dict(save_steps=1)
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    checkpoints = Path(data["output_dir"]) / "checkpoints"
    assert f"cannot write {checkpoints}/checkpoint-" in err
    assert ": No space left on device (nothing of it is left)" in err
    if failing_save == 1:
        assert "no earlier checkpoint exists to resume from" in err
    else:
        assert "is intact: free space, then --resume continues from it" in err
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")], "no staging folder left"


@pytest.mark.parametrize("save_steps", [None, 2])
def test_final_adapters_on_a_full_disk_say_whether_a_checkpoint_is_left(
    tmp_path: Path,
    config_dict,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    save_steps: int | None,
) -> None:
    """Without a checkpoint, the old hint ("--resume continues from the newest one") was false."""
    import lorafusion_megatron.adapters_io as adapters_io

    real = adapters_io.replace_adapter

    def full_at_second(source: Path, target: Path, job: str) -> None:
        if job == "second" and "checkpoint" not in str(target):
            _no_space()
        real(source, target, job)

    monkeypatch.setattr(adapters_io, "replace_adapter", full_at_second)
    data = config_dict(save_steps=save_steps)
    assert main(["train", str(_write(tmp_path / "run.yaml", data))]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    run = Path(data["output_dir"])
    assert f"cannot write {run / 'adapters' / 'second'}: No space left on device" in err
    assert "The training finished, but not every adapter and summary.json were written" in err
    if save_steps is None:
        assert "no checkpoint exists to resume from" in err
        assert "the trained weights are lost" in err
        assert "--resume continues" not in err
        assert "then train again with --overwrite" in err
    else:
        assert "--resume` trains again from" in err
        assert f"{run / 'checkpoints'}/checkpoint-" in err
    assert not (run / "summary.json").exists()


def test_an_overwrite_run_that_fails_among_its_final_writes_is_not_taken_for_complete(
    tmp_path: Path, config_dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The earlier run's summary.json stayed beside one new adapter and one old; --resume said "complete"."""
    import lorafusion_megatron.trainer as trainer_module

    config = parse_config(config_dict())  # save_steps: null, so no checkpoint
    Trainer(config).train()
    assert (Path(config.output_dir) / "summary.json").is_file()
    real = trainer_module.save_adapter
    written = []

    def crash_after_the_first(model, adapter: str, directory: Path) -> None:
        if written:
            _no_space()  # a crash, a kill -9 or a full disk after the first adapter was replaced
        real(model, adapter, directory)
        written.append(adapter)

    monkeypatch.setattr(trainer_module, "save_adapter", crash_after_the_first)
    reseeded = config.model_copy(update={"runtime": config.runtime.model_copy(update={"seed": 7})})
    with pytest.raises(OSError, match="No space left on device"):
        Trainer(reseeded).train(overwrite=True)
    assert written == ["first"]
    assert not (Path(config.output_dir) / "summary.json").exists(), "set aside at the fresh start"
    for either in (config, reseeded):  # the old run's config or the new one's
        with pytest.raises(TrainerError, match="--resume: no checkpoint in"):
            Trainer(either).train(resume=True)


def test_a_pipeline_adapter_on_a_full_disk_is_a_clear_error_and_keeps_the_old_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline's writers raised the OS error itself: a traceback inside the launcher's failure message."""
    import safetensors.torch

    from lorafusion_megatron.pipeline.adapters import stage_adapter_tensors, write_adapter
    from lorafusion_megatron.testing import tiny_peft_model
    from lorafusion_megatron.write_errors import CannotWriteError

    model, _ = tiny_peft_model()
    folder = tmp_path / "adapters" / "first"
    write_adapter(model, "first", stage_adapter_tensors(model, "first"), folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    with pytest.raises(CannotWriteError, match=r"cannot write .*adapters/first: No space left on device"):
        write_adapter(model, "first", stage_adapter_tensors(model, "first"), folder)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    assert sorted(path.name for path in folder.parent.iterdir()) == ["first"], "no staging folder left"


def test_a_pipeline_rank_file_on_a_full_disk_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import torch
    import torch.distributed as dist

    from lorafusion_megatron.pipeline.checkpoint import save_pipeline_checkpoint
    from lorafusion_megatron.pipeline.options import ParallelConfig
    from lorafusion_megatron.write_errors import CannotWriteError

    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src: None)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch, "save", _no_space)
    layout = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(CannotWriteError, match=r"cannot write .*checkpoint-3: No space left on device"):
        save_pipeline_checkpoint(
            tmp_path / "checkpoints",
            layout=layout,
            total_steps=3,
            position=0,
            parameters={},
            optimizers={},
            engine_state={},
            plan_json="{}",
            fingerprint=None,
            run_id="r",
            parallel=ParallelConfig(),
            keep=None,
        )
