"""Development sessions for the LoRAFusion monorepo; `nox -l` lists them, `nox` runs the defaults.

One `Package` enum drives every session. "Alone" sessions prove that each package installs and
passes its tests in a fresh venv holding only that package and its declared dependencies (as its
users will install it); "together" puts all three in one venv with the integration tests.

The virtualenv + pip backend is deliberate: pip finds the CPU build of torch on local disk and
`constraints/cpu.txt` pins it, so no resolver pulls a multi-GB CUDA torch (uv does not look there).
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import assert_never

import nox
from packaging.specifiers import SpecifierSet
from packaging.version import Version

nox.needs_version = ">=2024.10.9"
nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
CPU_CONSTRAINTS = ("-c", str(ROOT / "constraints" / "cpu.txt"))


class Package(enum.StrEnum):
    """The three distributions, by their directory name under ``packages/``."""

    KERNELS = "lorafusion-kernels"
    SCHED = "lorafusion-sched"
    MEGATRON = "lorafusion-megatron"

    @property
    def path(self) -> Path:
        return ROOT / "packages" / self.value

    @property
    def import_name(self) -> str:
        return self.value.replace("-", "_")

    @property
    def siblings(self) -> tuple[Package, ...]:
        """In-repo packages this one depends on (installed from the tree, never from an index)."""
        match self:
            case Package.KERNELS | Package.SCHED:
                return ()
            case Package.MEGATRON:
                return (Package.KERNELS, Package.SCHED)
            case _:
                assert_never(self)

    @property
    def editable_spec(self) -> str:
        """Editable install spec for the together venv, with optional extras whose code is tested there."""
        match self:
            case Package.SCHED:
                return f"{self.path}[plot]"
            case Package.MEGATRON:
                return f"{self.path}[tensorboard]"
            case Package.KERNELS:
                return str(self.path)
            case _:
                assert_never(self)

    @property
    def test_env(self) -> dict[str, str]:
        """Environment for this package's test run."""
        match self:
            case Package.KERNELS:
                # CPU tensors go through the Triton kernels themselves (not the torch fallback);
                # must be set before triton is imported, hence per process.
                return {"TRITON_INTERPRET": "1"}
            case Package.SCHED:
                return {}
            case Package.MEGATRON:
                return {}
            case _:
                assert_never(self)


def _version(package: Package) -> Version:
    about = (package.path / "src" / package.import_name / "__about__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', about, flags=re.MULTILINE)
    if match is None:
        raise ValueError(f"no __version__ in {package.value}'s __about__.py")
    return Version(match.group(1))


@contextlib.contextmanager
def _venv_removed_afterwards(session: nox.Session) -> Iterator[None]:
    """Delete the session's virtualenv when the session ends, passed or failed.

    Four sessions hold torch + triton (about 2.5 GB each) and nox recreates every venv on the next
    run anyway, so keeping them only fills the disk: a CI run once died of "No space left on device".
    Set ``LORAFUSION_KEEP_NOX_VENVS=1`` to keep them for ``nox -r`` while iterating.
    """
    try:
        yield
    finally:
        if not os.environ.get("LORAFUSION_KEEP_NOX_VENVS"):
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


PARALLEL = ("-n", "auto")
"""pytest-xdist, one worker per CPU: the kernels' tests run Triton's interpreter, seconds per test."""


def _pytest(
    session: nox.Session,
    package: Package,
    *extra: str,
    env: dict[str, str] | None = None,
    success_codes: list[int] | None = None,
) -> None:
    """``package``'s tests with pytest-xdist; ``env`` defaults to the package's test environment."""
    session.run(
        "pytest",
        str(package.path / "tests"),
        *PARALLEL,
        *extra,
        *session.posargs,
        env=package.test_env if env is None else env,
        success_codes=success_codes,
    )


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


@nox.session(tags=["tests"])
@nox.parametrize("package", list(Package), ids=[p.value for p in Package])
def tests(session: nox.Session, package: Package) -> None:
    """One package alone: a fresh venv with only that package and its declared dependencies."""
    with _venv_removed_afterwards(session):
        _test_alone(session, package)


def _test_alone(session: nox.Session, package: Package) -> None:
    session.install(*CPU_CONSTRAINTS, *nox.project.dependency_groups(PYPROJECT, "test"))
    # Siblings come from the tree (they are not on an index in development); the package itself is
    # installed as a built wheel, not editable, so a file missing from the wheel fails here.
    sibling_paths = [str(s.path) for s in package.siblings]
    session.install(*CPU_CONSTRAINTS, *sibling_paths, str(package.path))
    session.run("python", "-m", "pip", "list", "--format=freeze")
    env = dict(package.test_env)
    if package is Package.SCHED:
        env["LORAFUSION_EXPECT_NO_TORCH"] = "1"
    _pytest(session, package, "-m", "not slow", env=env)


@nox.session(tags=["tests"])
def tests_together(session: nox.Session) -> None:
    """All three packages in one venv with their optional packages: integration tests, `together` tests.

    Each package's tests marked ``together`` need peft, transformers, matplotlib or tensorboard and so
    skip in its alone venv; the alone sessions ran the rest.
    """
    with _venv_removed_afterwards(session):
        session.install(*CPU_CONSTRAINTS, *nox.project.dependency_groups(PYPROJECT, "test"))
        session.install(*CPU_CONSTRAINTS, *[arg for p in Package for arg in ("-e", p.editable_spec)])
        # The HF Trainer (the kernels' PEFT drop-in under its bf16 autocast) needs accelerate.
        session.install(*CPU_CONSTRAINTS, "accelerate>=1.0")
        # Integration tests first: one of them explains a `together` marker that a test lacks.
        session.run("pytest", str(ROOT / "integration-tests"), *PARALLEL, "-m", "not slow", *session.posargs)
        for package in Package:
            # Exit status 5 ("no tests collected"): a package may have no test that needs more than it declares.
            _pytest(session, package, "-m", "together and not slow", success_codes=[0, 5])


# ------------------------------------------------------------------------------------------------
# Static checks
# ------------------------------------------------------------------------------------------------


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole repository."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Mypy over every package's ``src/`` (strict for the scheduler)."""
    with _venv_removed_afterwards(session):
        session.install(*CPU_CONSTRAINTS, *nox.project.dependency_groups(PYPROJECT, "typing"))
        session.install(*CPU_CONSTRAINTS, *[arg for p in Package for arg in ("-e", str(p.path))])
        session.run("mypy", *[str(p.path / "src") for p in Package])


@nox.session
def docs(session: nox.Session) -> None:
    """Build the user docs with ``mkdocs build --strict`` (warnings are errors)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(Path(session.create_tmp()) / "site"))


@nox.session(python=False)
def check_pins(session: nox.Session) -> None:
    """Every in-repo dependent's range on a sibling admits that sibling's in-repo version."""
    for package in Package:
        project = tomllib.loads((package.path / "pyproject.toml").read_text())["project"]
        requirements = {
            m.group(1): SpecifierSet(m.group(2) or "")
            for req in project.get("dependencies", [])
            if (m := re.match(r"^\s*([A-Za-z0-9_.-]+)\s*([^;]*)", req))
        }
        for sibling in package.siblings:
            if sibling.value not in requirements:
                session.error(f"{package.value} does not declare its sibling {sibling.value}")
            spec, version = requirements[sibling.value], _version(sibling)
            if version not in spec:
                session.error(f"{package.value} asks for {sibling.value}{spec}, but the tree holds {version}")
            session.log(f"{package.value}: {sibling.value}{spec} admits {version}")
