from __future__ import annotations

import importlib.metadata
import importlib.resources

import lorafusion_kernels
from lorafusion_kernels.__about__ import __version__


def test_installed_version_matches_about() -> None:
    assert importlib.metadata.version("lorafusion-kernels") == __version__ == lorafusion_kernels.__version__


def test_ships_py_typed() -> None:
    assert importlib.resources.files("lorafusion_kernels").joinpath("py.typed").is_file()
