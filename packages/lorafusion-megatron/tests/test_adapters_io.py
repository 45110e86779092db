from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SAVE_ONE_ADAPTER = """
import sys
from pathlib import Path
from lorafusion_megatron.adapters_io import save_adapter
from lorafusion_megatron.testing import tiny_peft_model

model, _ = tiny_peft_model()
save_adapter(model, "first", Path(sys.argv[1]))
"""


def _save_with_hash_seed(folder: Path, seed: str) -> bytes:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    subprocess.run([sys.executable, "-W", "ignore", "-c", SAVE_ONE_ADAPTER, str(folder)], check=True, env=env)
    return (folder / "adapter_config.json").read_bytes()


def test_adapter_config_is_the_same_in_every_process(tmp_path: Path) -> None:
    # PEFT keeps target_modules in a set; string hashing differs per process, so without sorting
    # the same adapter's config was written in a different order by different runs or ranks.
    first = _save_with_hash_seed(tmp_path / "a", "1")
    second = _save_with_hash_seed(tmp_path / "b", "2")
    assert first == second
    modules = json.loads(first)["target_modules"]
    assert len(modules) > 1
    assert modules == sorted(modules)
