from __future__ import annotations

import importlib.metadata
import importlib.resources

import lorafusion_megatron
from lorafusion_megatron.__about__ import __version__


def test_installed_version_matches_about() -> None:
    assert importlib.metadata.version("lorafusion-megatron") == __version__ == lorafusion_megatron.__version__


def test_ships_py_typed() -> None:
    assert importlib.resources.files("lorafusion_megatron").joinpath("py.typed").is_file()


def test_sibling_versions_satisfy_declared_ranges() -> None:
    from packaging.requirements import Requirement

    requirements = [Requirement(r) for r in importlib.metadata.requires("lorafusion-megatron") or []]
    siblings = {r.name: r.specifier for r in requirements if r.name.startswith("lorafusion-")}
    assert set(siblings) == {"lorafusion-kernels", "lorafusion-sched"}
    for name, specifier in siblings.items():
        assert importlib.metadata.version(name) in specifier
