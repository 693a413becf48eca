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


from tests.obs_fixtures import demo_run  # noqa: E402,F401  (session fixture: one demo run per framework)
