"""Fixtures for the registry suite: every test runs on SQLite AND on a real PostgreSQL server.

PostgreSQL comes from the machine's binaries (`.ci/install-postgresql.sh` installs them in
CI, where a missing server fails instead of skipping); each test gets an empty database.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridfleet.ckpt.run_model import ModelCheckpointer
from hybridfleet.registry import Registry
from tests.postgres import PostgresServer, server_binaries


@pytest.fixture(scope="session")
def postgres():
    if server_binaries() is None:
        message = "PostgreSQL server binaries not installed: run .ci/install-postgresql.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with PostgresServer() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """An empty registry database URL: SQLite in tmp_path, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture
def registry(db_url, tmp_path) -> Registry:
    """A registry owned by the caller (no token), artifacts in a file:// store."""
    return Registry(db_url, store=str(tmp_path / "artifacts"))


def save_model(root: Path | str, step: int = 10, framework: str = "torch", seed: int = 0, **metrics: float) -> str:
    """A run-style model checkpoint (a small MLP) of ``framework`` under ``root``; its URL."""
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    else:
        import paddle

        paddle.seed(seed)
        model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    ckpt = ModelCheckpointer(str(root), framework, keep_last=5)
    ckpt.final(step, model, metrics)
    return ckpt.store.url


def table_counts(reg: Registry) -> dict[str, int]:
    """Rows per registry table: what a refused operation must leave unchanged."""
    from sqlalchemy import func, select

    from hybridfleet.registry.schema import metadata

    with reg.engine.connect() as conn:
        return {name: conn.execute(select(func.count()).select_from(t)).scalar() for name, t in metadata.tables.items()}


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()
