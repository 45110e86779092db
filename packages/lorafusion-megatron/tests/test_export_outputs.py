"""What ``export --output`` may replace: an earlier merged model, never a run's folder, an adapter or other files.

``--overwrite`` used to replace whatever ``--output`` named: a run's folder with its checkpoints,
plan and summary (also under a run training there, whose lock it ignored), or another job's
trained adapter. A failed write (read-only file system) was a traceback with status 3.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from lorafusion_megatron.cli import main
from lorafusion_megatron.run_layout import LOCK_FILE
from lorafusion_megatron.run_lock import run_lock


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    """A tiny adapter (trained on the ``tiny`` preset's shapes: export it with ``--base`` the saved tiny model)."""
    from lorafusion_megatron.adapters_io import save_adapter
    from lorafusion_megatron.testing import tiny_peft_model

    model, _ = tiny_peft_model(["first"])
    save_adapter(model, "first", tmp_path / "adapter")
    return tmp_path / "adapter"


def _export(adapter: Path, output: Path, base: Path, *extra: str) -> list[str]:
    return ["export", str(adapter), "--output", str(output), "--base", str(base), *extra]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "marker",
    ["checkpoints/checkpoint-2/trainer_state.json", "summary.json", "pipeline_summary.json", "plan.json", LOCK_FILE],
)
@pytest.mark.parametrize("nested", [False, True], ids=["the-run-folder", "a-folder-holding-it"])
def test_export_never_replaces_a_run_folder(
    tmp_path: Path, adapter: Path, tiny_base: Path, capsys: pytest.CaptureFixture[str], marker: str, nested: bool
) -> None:
    output = tmp_path / "runs"
    run = output / "x" if nested else output
    (run / marker).parent.mkdir(parents=True, exist_ok=True)
    (run / marker).write_text("{}")
    before = _files(output)
    assert main(_export(adapter, output, tiny_base, "--overwrite")) == 2
    err = " ".join(capsys.readouterr().err.split())
    found = Path(marker).parts[0]
    assert f"(it holds {found})" in err
    assert "export never replaces a run's folder, --overwrite or not; choose another --output" in err
    assert ("holds a training run's folder" if nested else "is a training run's folder") in err
    assert _files(output) == before, "nothing replaced"


def test_export_never_replaces_a_trained_adapter(
    tmp_path: Path, adapter: Path, tiny_base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter would be lost to a merged model; --overwrite is for an earlier merged model."""
    import shutil

    other = tmp_path / "adapters" / "second"
    shutil.copytree(adapter, other)
    before = _files(tmp_path / "adapters")
    for output in (other, tmp_path / "adapters"):
        assert main(_export(adapter, output, tiny_base, "--overwrite")) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "(adapter_config.json), which the merged model would replace: export never replaces an adapter" in err
    assert _files(tmp_path / "adapters") == before


def test_an_earlier_merged_model_is_replaced_and_no_lock_file_stays(
    tmp_path: Path, adapter: Path, tiny_base: Path
) -> None:
    merged = tmp_path / "merged"
    assert main(_export(adapter, merged, tiny_base)) == 0
    assert main(_export(adapter, merged, tiny_base, "--overwrite")) == 0
    assert (merged / "config.json").is_file()
    assert not (merged / LOCK_FILE).exists(), "the export's lock went with the folder it replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]


def test_the_merged_model_comes_with_a_manifest_of_its_files(tmp_path: Path, adapter: Path, tiny_base: Path) -> None:
    import json

    from lorafusion_megatron.export import MANIFEST

    merged = tmp_path / "merged"
    assert main(_export(adapter, merged, tiny_base, "--dtype", "float32")) == 0
    manifest = json.loads((merged / MANIFEST).read_text())
    assert manifest["files"] == sorted(set(_files(merged)) - {MANIFEST})
    assert {"config.json", "model.safetensors"} <= set(manifest["files"])
    assert (manifest["adapter"], manifest["base"], manifest["dtype"]) == (
        str(adapter.resolve()),
        str(tiny_base.resolve()),
        "float32",
    )


@pytest.mark.parametrize("kind", ["a-project-folder", "another-model", "an-export-with-a-file-added"])
def test_overwrite_never_deletes_what_no_export_wrote(
    tmp_path: Path, adapter: Path, tiny_base: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """``--overwrite`` replaced any folder that was not a run's or an adapter's: a project's data, another model."""
    import shutil

    output = tmp_path / "out"
    if kind == "a-project-folder":
        output.mkdir()
        (output / "jobs.yaml").write_text("adapters: []\n")
        (output / "data").mkdir()
        (output / "data" / "train.jsonl").write_text("{}\n")
    elif kind == "another-model":
        shutil.copytree(tiny_base, output)
    else:
        assert main(_export(adapter, output, tiny_base)) == 0
        (output / "notes").mkdir()
        (output / "notes" / "README.md").write_text("mine")
    before = _files(output)
    capsys.readouterr()
    assert main(_export(adapter, output, tiny_base, "--overwrite")) == 2
    err = " ".join(capsys.readouterr().err.split())
    if kind == "an-export-with-a-file-added":
        assert "holds files its earlier export did not write (notes/README.md), which --overwrite would delete" in err
    else:
        assert "was not written by `lorafusion-megatron export` (it holds no readable lorafusion-export.json)" in err
    assert _files(output) == before


def test_a_run_that_starts_into_the_output_meanwhile_refuses_the_export(
    tmp_path: Path, adapter: Path, tiny_base: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folder was checked before the model loaded; a run starting then held its lock when the export wrote."""
    import lorafusion_megatron.export as export_module

    output = tmp_path / "merged"
    real = export_module.quiet_peft_deprecations
    run = ExitStack()

    @contextmanager
    def run_starts_meanwhile() -> Iterator[None]:
        run.enter_context(run_lock(output))  # what `train` into output_dir=merged takes first
        with real():
            yield

    monkeypatch.setattr(export_module, "quiet_peft_deprecations", run_starts_meanwhile)
    with run:
        assert main(_export(adapter, output, tiny_base)) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"--output {output} is in use by another run (process {os.getpid()})" in err
        assert "wait for it to end, or choose another --output" in err
        assert sorted(p.name for p in output.iterdir()) == [LOCK_FILE], "the run's lock file is left alone"


def test_a_read_only_file_system_is_a_clear_error(
    tmp_path: Path, adapter: Path, tiny_base: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """EROFS was a traceback (status 3); the folder the export's lock made is gone again."""
    import lorafusion_megatron.export as export_module

    def read_only(source: Path, target: Path) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(target))

    monkeypatch.setattr(export_module, "replace_dir", read_only)
    output = tmp_path / "merged"
    assert main(_export(adapter, output, tiny_base)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot write {output}: Read-only file system" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "no staging folder, no lock, no output"
