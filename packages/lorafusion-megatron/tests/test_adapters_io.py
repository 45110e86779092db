from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafusion_megatron.adapters_io import replace_adapter
from lorafusion_megatron.errors import TrainerError

SAVE_ONE_ADAPTER = """
import sys
from pathlib import Path
from lorafusion_megatron.adapters_io import save_adapter
from lorafusion_megatron.pipeline.adapters import stage_adapter_tensors, write_adapter
from lorafusion_megatron.testing import tiny_peft_model

model, _ = tiny_peft_model()
if sys.argv[2] == "single-process":
    save_adapter(model, "first", Path(sys.argv[1]))
else:
    write_adapter(model, "first", stage_adapter_tensors(model, "first"), Path(sys.argv[1]))
"""


def _save_with_hash_seed(folder: Path, seed: str, writer: str) -> bytes:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    command = [sys.executable, "-W", "ignore", "-c", SAVE_ONE_ADAPTER, str(folder), writer]
    subprocess.run(command, check=True, env=env)
    return (folder / "adapter_config.json").read_bytes()


def test_adapter_config_is_the_same_in_every_process(tmp_path: Path) -> None:
    # PEFT keeps target_modules in a set; string hashing differs per process, so without sorting
    # the same adapter's config was written in a different order by different runs or ranks (the
    # pipeline's writer did not sort until stop 41).
    written = [
        _save_with_hash_seed(tmp_path / f"{writer}-{seed}", seed, writer)
        for writer in ("single-process", "pipeline")
        for seed in ("1", "2")
    ]
    assert len(set(written)) == 1
    assert written[0].endswith(b"}\n")
    modules = json.loads(written[0])["target_modules"]
    assert len(modules) > 1
    assert modules == sorted(modules)


def test_a_file_where_an_adapter_folder_goes_is_never_replaced(tmp_path: Path) -> None:
    """Regression: a file that took the adapter folder's place during the run was renamed to ``.old``
    and then ``shutil.rmtree`` failed on it, after training: it is refused, and kept."""
    finished = tmp_path / "staging"
    finished.mkdir()
    (finished / "adapter_config.json").write_text("{}")
    target = tmp_path / "plan.json"
    target.write_text("mine")
    with pytest.raises(TrainerError, match=r"plan\.json, where job first writes its adapter folder, is a file"):
        replace_adapter(finished, target, "first")
    assert target.read_text() == "mine"
    assert not (tmp_path / "plan.json.old").exists()
