from __future__ import annotations

from pathlib import Path

import pytest

from lorafusion_megatron.config import (
    BaseModelConfig,
    DatasetConfig,
    JobConfig,
    LoggingConfig,
    RuntimeConfig,
    SchedulerConfig,
    TrainerConfig,
)
from lorafusion_megatron.pipeline.options import ParallelConfig

REFERENCE = Path(__file__).parents[3] / "docs" / "megatron" / "config.md"


@pytest.mark.skipif(not REFERENCE.is_file(), reason="docs/ is not next to the package (installed from a wheel)")
@pytest.mark.parametrize(
    "model",
    [
        TrainerConfig,
        BaseModelConfig,
        JobConfig,
        DatasetConfig,
        SchedulerConfig,
        RuntimeConfig,
        LoggingConfig,
        ParallelConfig,
    ],
)
def test_every_config_key_is_in_the_reference(model) -> None:
    text = REFERENCE.read_text()
    missing = [name for name in model.model_fields if f"| `{name}` |" not in text]
    assert not missing, f"docs/megatron/config.md lacks {model.__name__} keys {missing}"
