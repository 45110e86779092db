"""Where ``lorafusion-megatron plan -o PATH`` may write the plan JSON.

Never onto a file the run reads or writes: the config file, a job's dataset, the base model's or
tokenizer's folder, the run's output folder or a job's adapter folder (a path inside a folder counts
as the folder). And never over an existing file that is not a plan: a plan file is replaced (planning
again is the point of ``-o``), anything else is refused rather than lost.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from lorafusion_megatron.config import TrainerConfig
from lorafusion_megatron.errors import TrainerError

__all__ = ["check_plan_output"]


def _run_paths(config: TrainerConfig, config_path: Path) -> Iterator[tuple[str, Path]]:
    """``(what, path)`` of every file or folder of the run that a plan file must not replace."""
    yield "the config file", config_path
    for index, job in enumerate(config.jobs):
        for key, dataset in (("dataset", job.dataset), ("eval_dataset", job.eval_dataset)):
            if dataset is not None and dataset.path is not None:
                yield f"jobs.{index}.{key}.path", Path(dataset.path)
        yield f"the adapter folder of job {job.name!r}", config.job_output_dir(job)
    model = config.base_model
    if not model.is_preset:
        yield "base_model.model_name_or_path", Path(model.model_name_or_path)
    if model.tokenizer_name_or_path is not None:
        yield "base_model.tokenizer_name_or_path", Path(model.tokenizer_name_or_path)
    yield "the run's output_dir", Path(config.output_dir)


def _is_plan_file(path: Path) -> bool:
    """Whether ``path`` holds a plan JSON (an object with ``schema_version`` and ``microbatches``)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(document, dict) and {"schema_version", "microbatches"} <= document.keys()


def check_plan_output(output: Path, config: TrainerConfig, config_path: Path) -> None:
    """Refuse an ``-o`` path that would replace a file of the run, or a file that is not a plan.

    Checked before planning, which may take a while on a large dataset.

    Raises:
        TrainerError: ``output`` is a folder, lies in a missing folder, is (or lies inside) one of
            the run's files or folders, or is an existing file that is not a plan JSON.
    """
    target = output.resolve()
    if not target.parent.is_dir():
        raise TrainerError(f"plan -o {output}: the folder {output.parent} does not exist; create it or choose another")
    for what, path in _run_paths(config, config_path):
        where = path.resolve()
        if target == where or where in target.parents:
            inside = "is" if target == where else "lies inside"
            raise TrainerError(
                f"plan -o {output} {inside} {what} ({path}), which the plan would replace or the run writes; "
                f"write the plan elsewhere, e.g. -o plan.json"
            )
    if target.is_dir():  # after the run's own folders, so that the file suggested is not refused next
        raise TrainerError(f"plan -o {output}: it is a folder; name a file, e.g. -o {output / 'plan.json'}")
    if target.exists() and not _is_plan_file(target):
        raise TrainerError(
            f"plan -o {output}: the file exists and is not a plan JSON, so it is not replaced; "
            f"choose another path, or delete the file first"
        )
