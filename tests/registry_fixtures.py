"""Fixtures for the registry suite: every test runs on SQLite AND on a real PostgreSQL server.

PostgreSQL comes from the machine's binaries (`.ci/install-postgresql.sh` installs them in
CI, where a missing server fails instead of skipping); each test gets an empty database.
"""

from __future__ import annotations

import pytest

from hybridfleet.registry import Registry
from tests.needs import missing
from tests.postgres import PostgresServer, server_binaries


@pytest.fixture(scope="session")
def postgres():
    if server_binaries() is None:
        missing("PostgreSQL server binaries not installed: run .ci/install-postgresql.sh")
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
