"""A watchdog that cuts sockets whose deadline passed (the bulk plane's handshakes and frames).

Cutting is a TCP shutdown: whoever reads the socket (a pool thread inside a blocking read,
or the event loop) then sees end of stream, so reads stay plain calls.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.wire.admission import shutdown_fd

log = get_logger("ps.bulk")


class Deadlines:
    """Shuts a socket down when its deadline passes; the thread blocked reading it then gets EOF.

    Sockets are known by file descriptor, which stays the same when TLS wraps the socket; the
    shutdown happens under the lock, so once `disarm` returns the descriptor is never touched.
    """

    def __init__(self, tick_s: float = 0.25, on_tick: Callable[[], None] | None = None):
        """``on_tick``: also called every tick, outside the lock (the bulk server's parked pulls)."""
        self._on_tick = on_tick
        self._due: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tick_s = tick_s
        self._thread = threading.Thread(target=self._loop, name="ps-bulk-deadlines", daemon=True)
        self.expired = 0  # sockets cut so far

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def arm(self, fd: int, seconds: float) -> None:
        with self._lock:
            self._due[fd] = time.monotonic() + seconds

    def disarm(self, fd: int) -> None:
        with self._lock:
            self._due.pop(fd, None)

    def _loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            now = time.monotonic()
            with self._lock:
                for fd in [fd for fd, due in self._due.items() if due <= now]:
                    del self._due[fd]
                    self.expired += 1
                    shutdown_fd(fd)
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception as err:  # a bug must not stop the watchdog
                    log.error("bulk_tick_failed", error=f"{type(err).__name__}: {err}")
