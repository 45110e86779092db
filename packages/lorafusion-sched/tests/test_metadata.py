from __future__ import annotations

import importlib.metadata
import importlib.resources

import lorafusion_sched
from lorafusion_sched.__about__ import __version__


def test_installed_version_matches_about() -> None:
    assert importlib.metadata.version("lorafusion-sched") == __version__ == lorafusion_sched.__version__


def test_ships_py_typed() -> None:
    assert importlib.resources.files("lorafusion_sched").joinpath("py.typed").is_file()


def test_declares_no_torch() -> None:
    requirements = importlib.metadata.requires("lorafusion-sched") or []
    assert not [r for r in requirements if r.split(";")[0].strip().startswith("torch")]
