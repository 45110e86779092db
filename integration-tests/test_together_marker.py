"""Every package test that needs an optional package is marked ``together``, so some CI session runs it.

Each package's "alone" venv lacks some packages (peft and transformers for the kernels, matplotlib
for the scheduler, tensorboard for the trainer): tests that ``importorskip`` them skip there. The
``tests_together`` session, whose venv has them all, runs only the tests marked ``together`` of each
package, so an unmarked one would silently run nowhere.
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


def _optional_skips(node: ast.AST, absent: set[str]) -> list[str]:
    """Top-level module names of the ``pytest.importorskip("...")`` calls under ``node`` that are in ``absent``."""
    names = []
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) == "pytest.importorskip"
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            top = str(call.args[0].value).split(".")[0]
            if top in absent:
                names.append(top)
    return names


def _unmarked(path: Path, absent: set[str]) -> list[str]:
    """``file:function needs module`` for each optional import outside a ``together`` test."""
    tree = ast.parse(path.read_text())
    module_marked = any(
        isinstance(stmt, ast.Assign)
        and any(ast.unparse(t) == "pytestmark" for t in stmt.targets)
        and "pytest.mark.together" in ast.unparse(stmt.value)
        for stmt in tree.body
    )
    if module_marked:
        return []
    found = []
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.ClassDef):
            if not _marks_together(stmt.decorator_list):
                found += [f"{path.name}:{stmt.name} needs {name}" for name in _optional_skips(stmt, absent)]
        else:
            found += [f"{path.name} (module level) needs {name}" for name in _optional_skips(stmt, absent)]
    return found


@pytest.mark.parametrize("package", sorted(ABSENT_ALONE))
def test_tests_needing_optional_packages_are_marked_together(package: str) -> None:
    tests = sorted((ROOT / "packages" / package / "tests").glob("test_*.py"))
    assert tests, f"no tests found for {package}"
    unmarked = [entry for path in tests for entry in _unmarked(path, ABSENT_ALONE[package])]
    assert not unmarked, "mark these `pytest.mark.together` (tests_together runs only those): " + "; ".join(unmarked)
