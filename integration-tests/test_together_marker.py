"""Every package test that needs an optional package is marked ``together``, so some CI session runs it.

Each package's "alone" venv lacks some packages (peft and transformers for the kernels, matplotlib
for the scheduler, tensorboard for the trainer): tests that ``importorskip`` them skip there. The
``tests_together`` session, whose venv has them all, runs only the tests marked ``together`` of each
package, so an unmarked one would silently run nowhere. (A fixture cannot carry a mark: a fixture
that needs one of them belongs in a module marked ``together``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

# Modules that a package's alone venv does not have (they are not among its dependencies).
ABSENT_ALONE = {
    "lorafusion-kernels": {"accelerate", "matplotlib", "peft", "safetensors", "tensorboard", "transformers"},
    "lorafusion-sched": {"accelerate", "matplotlib", "peft", "safetensors", "tensorboard", "transformers"},
    "lorafusion-megatron": {"accelerate", "matplotlib", "tensorboard"},
}


def _marks_together(decorators: list[ast.expr]) -> bool:
    return any("pytest.mark.together" in ast.unparse(d) for d in decorators)


def _has_pytestmark_together(body: list[ast.stmt]) -> bool:
    """Whether a module or class body assigns a ``pytestmark`` holding ``pytest.mark.together``."""
    return any(
        isinstance(stmt, ast.Assign)
        and any(ast.unparse(t) == "pytestmark" for t in stmt.targets)
        and "pytest.mark.together" in ast.unparse(stmt.value)
        for stmt in body
    )


def _optional_skips(node: ast.AST, absent: set[str]) -> list[str]:
    """Top-level module names of the ``importorskip("...")`` calls under ``node`` that are in ``absent``.

    Calls as ``pytest.importorskip`` or a bare ``importorskip``; a module name held in a variable is
    not seen.
    """
    names = []
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) in {"pytest.importorskip", "importorskip"}
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            top = str(call.args[0].value).split(".")[0]
            if top in absent:
                names.append(top)
    return names


def _unmarked(body: list[ast.stmt], where: str, absent: set[str]) -> list[str]:
    """``where:test needs module`` for each optional import in ``body`` outside a ``together`` test or class."""
    if _has_pytestmark_together(body):
        return []
    found = []
    for stmt in body:
        if isinstance(stmt, ast.ClassDef):
            if not _marks_together(stmt.decorator_list):
                found += _unmarked(stmt.body, f"{where}:{stmt.name}", absent)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            if not _marks_together(stmt.decorator_list):
                found += [f"{where}:{stmt.name} needs {name}" for name in _optional_skips(stmt, absent)]
        else:
            found += [f"{where} (outside a test) needs {name}" for name in _optional_skips(stmt, absent)]
    return found


@pytest.mark.parametrize("package", sorted(ABSENT_ALONE))
def test_tests_needing_optional_packages_are_marked_together(package: str) -> None:
    tests = sorted((ROOT / "packages" / package / "tests").glob("test_*.py"))
    assert tests, f"no tests found for {package}"
    absent = ABSENT_ALONE[package]
    unmarked = [entry for path in tests for entry in _unmarked(ast.parse(path.read_text()).body, path.name, absent)]
    assert not unmarked, "mark these `pytest.mark.together` (tests_together runs only those): " + "; ".join(unmarked)
