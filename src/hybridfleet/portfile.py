"""Port files: how a process that bound port 0 tells others the port it got.

A launcher that picks a free port, releases it and hands it to a process leaves a window in
which another process (a gRPC server binding port 0, a connection's local port) can take it.
So the process binds port 0 itself and writes the port here; readers wait for the file.
"""

from __future__ import annotations

import os
from pathlib import Path


def read_port_file(path: str | os.PathLike) -> int | None:
    """The port ``path`` names; None when there is no such file or it holds no port number."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None


def write_port_file(path: str | os.PathLike, port: int) -> None:
    """Write ``port`` to ``path`` whole or not at all (a reader never sees a half-written number)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)
