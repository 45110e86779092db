from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lorafusion_megatron import atomic_dirs
from lorafusion_megatron.adapters_io import check_fresh_run
from lorafusion_megatron.atomic_dirs import replace_dir, replaced_name, restore_interrupted_replace
from lorafusion_megatron.checkpoint import recover_interrupted_writes
from lorafusion_megatron.config import TrainerConfig
from lorafusion_megatron.errors import TrainerError
from lorafusion_megatron.testing import two_job_config


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text(content)
    return path


def _content(path: Path) -> str:
    return (path / "adapter_config.json").read_text()


def _without_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the two-rename fallback (macOS, file systems that cannot swap folders)."""
    monkeypatch.setattr(atomic_dirs, "_exchange", lambda first, second: False)


@pytest.mark.parametrize("exchange", [True, False], ids=["swap", "two-renames"])
def test_replace_dir_leaves_only_the_new_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        _without_exchange(monkeypatch)
    target = _folder(tmp_path / "job", "old")
    (tmp_path / "job.old").mkdir()  # the user's own: an earlier version deleted it
    (tmp_path / "job.old" / "notes.txt").write_text("mine")
    replace_dir(_folder(tmp_path / ".job.tmp-1", "new"), target)
    assert _content(target) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "job.old"]
    assert (tmp_path / "job.old" / "notes.txt").read_text() == "mine"
    replace_dir(_folder(tmp_path / ".job.tmp-2", "first write"), tmp_path / "fresh")
    assert _content(tmp_path / "fresh") == "first write"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_folder_gets_the_permissions_of_the_users_own_files(tmp_path: Path, umask: int) -> None:
    """``safetensors`` writes 0600 files: adapters, checkpoints and exports were unreadable to the user's group."""
    source = tmp_path / ".job.tmp"
    (source / "inner").mkdir(parents=True)
    weights = source / "inner" / "adapter_model.safetensors"
    weights.write_bytes(b"x")
    weights.chmod(0o600)
    source.chmod(0o700)
    old = os.umask(umask)
    try:
        replace_dir(source, tmp_path / "job")
    finally:
        os.umask(old)
    target = tmp_path / "job"
    assert (target.stat().st_mode & 0o777, (target / "inner").stat().st_mode & 0o777) == (0o777 & ~umask,) * 2
    assert (target / "inner" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_replace_dir_swaps_in_one_step_on_linux(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "probe-a").mkdir()
    (tmp_path / "probe-b").mkdir()
    if not atomic_dirs._exchange(tmp_path / "probe-a", tmp_path / "probe-b"):
        pytest.skip("this file system cannot swap folders (replace_dir takes its two renames)")

    def no_rename(*args: object) -> None:
        raise AssertionError("os.replace called: the swap was not taken")

    monkeypatch.setattr(atomic_dirs.os, "replace", no_rename)
    target = _folder(tmp_path / "job", "old")
    replace_dir(_folder(tmp_path / ".job.tmp-1", "new"), target)
    assert _content(target) == "new"


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_exchange(monkeypatch)
    target = _folder(tmp_path / "job", "old")
    source = _folder(tmp_path / ".job.tmp-1", "new")
    rename = os.replace

    def second_fails(src: Path, dst: Path) -> None:
        if Path(src) == source:
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(atomic_dirs.os, "replace", second_fails)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(source, target)
    assert _content(target) == "old"
    assert not replaced_name(target).exists()


def test_a_crash_between_the_renames_is_recovered(tmp_path: Path) -> None:
    # What a kill between the fallback's two renames leaves: no target, the old folder aside.
    target = tmp_path / "job"
    _folder(replaced_name(target), "old")
    replace_dir(_folder(tmp_path / ".job.tmp-1", "new"), target)
    assert _content(target) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]

    _folder(replaced_name(target), "old")  # a kill after both renames: the old copy is stale
    restore_interrupted_replace(target)
    assert _content(target) == "new"
    assert not replaced_name(target).exists()


def test_a_file_is_never_replaced_by_a_folder(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"plan\.json"):
        replace_dir(_folder(tmp_path / ".tmp-1", "new"), tmp_path / "plan.json")
    assert (tmp_path / "plan.json").read_text() == "mine"


def test_a_run_start_restores_what_a_crash_left_aside(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(two_job_config(tmp_path / "base", tmp_path / "run"))
    job_folder = config.job_output_dir(config.jobs[0])
    job_folder.parent.mkdir(parents=True, exist_ok=True)
    _folder(replaced_name(job_folder), "earlier run's adapter")
    checkpoint = config.checkpoint_dir / "checkpoint-4"
    config.checkpoint_dir.mkdir(parents=True)
    _folder(replaced_name(checkpoint), "checkpoint")
    (config.checkpoint_dir / ".checkpoint-6.tmp-x").mkdir()

    # Before the run's locks are held, the folder aside counts as an earlier run's results.
    with pytest.raises(TrainerError, match="holds results of an earlier run"):
        check_fresh_run(config, resume=False, overwrite=False)
    recover_interrupted_writes(config)
    assert _content(job_folder) == "earlier run's adapter"
    assert _content(checkpoint) == "checkpoint"
    assert sorted(p.name for p in config.checkpoint_dir.iterdir()) == ["checkpoint-4"]
