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


def _example_frameworks() -> dict[str, str]:
    """The shipped example job files and the framework each trains with (``digits-hybrid.yaml`` -> torch)."""
    import yaml

    return {path.name: yaml.safe_load(path.read_text())["framework"] for path in (REPO / "examples").glob("*.yaml")}


def pytest_collection_modifyitems(config, items):
    # A test whose id names a framework (a [torch] parameter, train_paddle.py, test_torch_...) or a
    # shipped example job of one needs that framework: mark it, so a CI pass on an interpreter with
    # one framework selects with -m "not torch". Other tests carry the marker explicitly.
    examples = _example_frameworks()
    for item in items:
        nodeid = item.nodeid.lower()
        needs = {f for f in ("torch", "paddle") if f in nodeid}
        needs |= {framework for name, framework in examples.items() if f"[{name}" in nodeid or f"-{name}" in nodeid}
        for framework in needs:
            item.add_marker(getattr(pytest.mark, framework))


@pytest.fixture(autouse=True, scope="session")
def _private_model_registry(tmp_path_factory):
    # Jobs with a `registry:` block publish at the end of a run; tests publish to a
    # registry of their own session, never to the project's .hfleet/registry. Session
    # scoped, so session and module fixtures that run jobs (before any test) see it too.
    if "HFLEET_REGISTRY" in os.environ:
        yield
        return
    os.environ["HFLEET_REGISTRY"] = str(tmp_path_factory.getbasetemp() / "registry" / "registry.db")
    try:
        yield
    finally:
        os.environ.pop("HFLEET_REGISTRY", None)


from tests.obs_fixtures import demo_run  # noqa: E402,F401  (session fixture: one demo run per framework)
