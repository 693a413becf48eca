"""Server-sent events for a live run's page: the figures the page shows, sent again whenever they change.

The stream reads what the page itself reads (the run folder and the workers' metrics endpoints it
names), polling every ``poll_s`` seconds; it sends a ``progress`` event when the figures differ from
the last ones sent, an ``end`` event once the run is no longer live, and stops when the client goes
(Starlette cancels a streaming response whose client disconnected).
The number of open streams is capped: `StreamSlots.take` refuses beyond it and the caller answers 503.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from hybridfleet.errors import ReportError
from hybridfleet.obs.runinfo import load_run
from hybridfleet.ui import runs_view
from hybridfleet.ui.pages import status_of

MAX_STREAMS = 16
POLL_S = 1.0


class StreamSlots:
    """At most ``limit`` open streams at once (thread-safe)."""

    def __init__(self, limit: int = MAX_STREAMS):
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """One slot, if any is free: True when taken (give it back with `release`)."""
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.open = max(0, self.open - 1)


def figures(run, snapshot) -> dict[str, Any]:
    """What the live page's figures say now: status, the progress line, the metric column and each site's row."""
    view = runs_view.run_view("", run, snapshot.sites if snapshot else None, [],
                              snapshot.metric_key if snapshot else None)  # fmt: skip
    return {"status": status_of(run), "live": run.live, "progress": view["progress"],
            "metric_key": view["metric_key"],
            "sites": [[s["name"], s["workers_text"] + (" · final" if s["final"] else ""), s["steps"], s["uplink"],
                       s["downlink"], s["metric"], s["final"]] for s in view["sites"]]}  # fmt: skip


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def read_figures(path: Path, snapshot_of: Callable[[Any], Any]) -> dict[str, Any] | None:
    """The figures of the run at ``path`` now; None when it can no longer be read as a run."""
    try:
        run = load_run(path)
    except ReportError:
        return None
    return figures(run, snapshot_of(run) if run.live else None)


async def stream(path: Path, snapshot_of: Callable[[Any], Any], sleep: Callable[[float], Awaitable[None]],
                 poll_s: float = POLL_S) -> AsyncIterator[str]:
    """The events of the run at ``path``: ``progress`` on each change, ``end`` (its final status) once it is
    not live. A client that goes away cancels the response, and with it this stream at its next wait."""
    last = None
    yield ": stream open\n\n"  # the headers and a first byte reach the client at once
    while True:
        now = await run_in_threadpool(read_figures, path, snapshot_of)
        if now is None:
            yield _event("end", {"status": "gone"})
            return
        if now != last:
            yield _event("progress", now)
            last = now
        if not now["live"]:
            yield _event("end", {"status": now["status"]})
            return
        await sleep(poll_s)
