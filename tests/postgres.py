"""A real PostgreSQL server for tests, started on 127.0.0.1 from the machine's binaries.

`.ci/install-postgresql.sh` installs them in CI. The server runs as the ``postgres``
system user when the tests run as root (PostgreSQL refuses to run as root), with
trust authentication on loopback only, in a temporary data directory removed at exit.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def server_binaries() -> Path | None:
    """The folder holding initdb/pg_ctl (newest Debian version first), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PostgresServer:
    """``with PostgresServer() as pg: pg.url`` - a throwaway server; `new_database` gives each test its own."""

    def __init__(self) -> None:
        self.bin = server_binaries()
        if self.bin is None:
            raise FileNotFoundError("PostgreSQL server binaries not found; run .ci/install-postgresql.sh")
        self.tmp = Path(tempfile.mkdtemp(prefix="hfleet-pg-"))
        self.data = self.tmp / "data"
        self.port = 0
        self._as_user: list[str] = []
        self._count = 0

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self._as_user, *argv], capture_output=True, text=True, timeout=120, check=True)

    def __enter__(self) -> PostgresServer:
        if os.geteuid() == 0:
            shutil.chown(self.tmp, "postgres")
            os.chmod(self.tmp, 0o700)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        options = f"-h 127.0.0.1 -p {self.port} -k {self.tmp} -c fsync=off -c max_connections=50"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.tmp / "log"), "-w", "start")
        return self

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        self._count += 1
        name = f"t{self._count}_{int(time.time() * 1000) % 100000}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def __exit__(self, *exc: object) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
