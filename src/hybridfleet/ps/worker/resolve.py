"""Where each shard is now: a worker re-reads a shard's address when the shard stops answering.

A shard lost for good is replaced by a new process that serves the same shard index from
its newest snapshot, usually at another address. The launcher (and `hfleet ps serve
--port-file`) writes each shard's ``host:port`` to ``<dir>/shard-<i>.port``; a worker given
that directory (``HFLEET_SHARD_PORT_DIR``) follows a shard to its new address at its next
call instead of retrying the old one until its retry time runs out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

PORT_DIR_ENV = "HFLEET_SHARD_PORT_DIR"
RETRY_ENV = "HFLEET_SHARD_RETRY_S"

Resolver = Callable[[int], "str | None"]


def port_file(directory: str | Path, shard: int) -> Path:
    """The file holding shard ``shard``'s ``host:port`` under ``directory``."""
    return Path(directory) / f"shard-{shard}.port"


def port_file_resolver(directory: str | Path) -> Resolver:
    """``resolve(shard) -> "host:port"`` read from ``directory``'s port files, or None while a shard's
    file is missing or not a ``host:port`` line (a replacement is still starting)."""

    def resolve(shard: int) -> str | None:
        try:
            text = port_file(directory, shard).read_text().strip()
        except OSError:
            return None
        host, sep, port = text.rpartition(":")
        return text if sep and host and port.isdigit() else None

    return resolve


def shard_retry_s() -> float:
    """How long a worker keeps retrying a shard that does not answer (``HFLEET_SHARD_RETRY_S``, default 60)."""
    return float(os.environ.get(RETRY_ENV, "60"))


PLAN_FILE = "shards.json"


def plan_file(directory: str | Path) -> Path:
    """The file naming the job's current shard count under ``directory`` (written when the count changes)."""
    return Path(directory) / PLAN_FILE


def current_plan(directory: str | Path) -> tuple[int, int | None]:
    """``(generation, shard count)`` the launcher last wrote to ``directory``'s plan file; ``(0, None)``
    while there is none (the count the job started with holds). Each change of the shard count
    while the job trains raises the generation by one."""
    try:
        doc = json.loads(plan_file(directory).read_text())
        return int(doc["generation"]), int(doc["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, None


def write_plan(directory: str | Path, generation: int, shards: int) -> None:
    """Atomically name ``shards`` as the job's shard count, at ``generation``."""
    path = plan_file(directory)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"generation": generation, "shards": shards}) + "\n")
    tmp.rename(path)
