"""Shared fixtures: a clean run directory and the repository root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    # Two cores here: keep each framework to one intra-op thread so parallel
    # processes in system tests do not oversubscribe the machine.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def pytest_collection_modifyitems(config, items):
    # A test whose id names a framework (a [torch] parameter, train_paddle.py, test_torch_...) needs it:
    # mark it, so a CI pass on an interpreter with one framework selects with -m "not torch".
    for item in items:
        for framework in ("torch", "paddle"):
            if framework in item.nodeid.lower():
                item.add_marker(getattr(pytest.mark, framework))
