"""JSON-lines logging used by every component.

One object per line: ``{"ts", "component", "level", "event", ...fields}``.
Lines go to stderr unless `configure` points them elsewhere; the level comes
from ``HFLEET_LOG_LEVEL`` (debug, info, warning, error; default info).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import IO, Any, Iterator

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}

_lock = threading.Lock()
_sink: IO[str] | None = None
_min_level = LEVELS.get(os.environ.get("HFLEET_LOG_LEVEL", "info").lower(), 20)


def configure(sink: IO[str] | None = None, level: str | None = None) -> None:
    """Send log lines to ``sink`` (default stderr) at ``level`` and above."""
    global _sink, _min_level
    _sink = sink
    if level is not None:
        if level not in LEVELS:
            raise ValueError(f"log level must be one of {sorted(LEVELS)} (got {level!r})")
        _min_level = LEVELS[level]


@contextlib.contextmanager
def redirect_log(sink: IO[str]) -> Iterator[None]:
    """While active, log lines go to ``sink``; the previous sink is restored afterwards."""
    global _sink
    with _lock:
        previous, _sink = _sink, sink
    try:
        yield
    finally:
        with _lock:
            _sink = previous


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


class Logger:
    """A component's logger: ``log.info("pushed", step=3, bytes=1024)``."""

    def __init__(self, component: str):
        self.component = component

    def log(self, level: str, event: str, **fields: Any) -> None:
        if LEVELS[level] < _min_level:
            return
        record = {"ts": round(time.time(), 6), "component": self.component, "level": level, "event": event}
        record.update(fields)
        line = json.dumps(record, default=_default, separators=(",", ":"))
        with _lock:
            out = _sink or sys.stderr
            out.write(line + "\n")
            out.flush()

    def debug(self, event: str, **fields: Any) -> None:
        self.log("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self.log("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.log("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.log("error", event, **fields)


def get_logger(component: str) -> Logger:
    """The JSON-lines logger for ``component`` (e.g. ``ps.server``)."""
    return Logger(component)
