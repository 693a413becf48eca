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


@pytest.fixture(autouse=True)
def _private_model_registry(tmp_path_factory, monkeypatch):
    # Jobs with a `registry:` block publish at the end of a run; tests publish to a
    # registry of their own session, never to the user's ~/.hfleet/registry.
    if "HFLEET_REGISTRY" not in os.environ:
        monkeypatch.setenv("HFLEET_REGISTRY", str(tmp_path_factory.getbasetemp() / "registry" / "registry.db"))
