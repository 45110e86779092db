"""Fixtures shared by the kernel tests: the interpreter or the plain-torch path, NaN-poisoned allocations,
an empty memory of lowered launches."""

from __future__ import annotations

import math

import pytest
import torch

import lorafusion_kernels._kernels._common as common
from lorafusion_kernels._kernels._common import interpreting


@pytest.fixture
def nan_poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns NaN-filled float tensors, so an element the kernels never write fails."""
    real_empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture
def interpreter() -> None:
    """The Triton kernels on CPU: ``TRITON_INTERPRET=1`` must be set before pytest starts.

    Triton reads it when the kernels are defined (at import), not when they are launched.
    """
    if not interpreting():
        pytest.skip("set TRITON_INTERPRET=1 before starting pytest to run the kernels on CPU")


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def fresh_fitting_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch_fitting`` starts with no launch remembered as needing fewer stages (restored afterwards)."""
    monkeypatch.setattr(common, "_FITTING_STAGES", {})
    monkeypatch.setattr(common, "_KERNELS_WITH_FEWER_STAGES", set())
