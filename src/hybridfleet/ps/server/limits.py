"""What one peer may hold of a shard: concurrent calls, in-flight push bytes, wait time.

Every request that names a worker is bound to that worker's identity first (see
`hybridfleet.security.credentials`), so these limits are per worker, not per
connection: opening more connections or streams buys a peer nothing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from hybridfleet.ps.wire.reject import Reject

# The longest a Pull may wait for its round, whatever the request asks for.
PULL_WAIT_CEILING_S = 120.0
# Calls one worker may have running at once on one shard (a worker needs one push, one
# pull and one heartbeat at a time; the rest is slack for a reconnect overlapping).
CALLS_PER_WORKER = 4
# Threads a shard keeps beyond its workers' share, for Status and refusals.
SPARE_THREADS = 8
# gRPC threads of a shard that serves Push and Pull on its bulk data plane, whatever the number
# of workers (Join, Heartbeat, Leave and Status are short calls; more of them queue).
GRPC_THREADS_WITH_BULK = 24
# The most bytes any codec's frame of an n-element block takes: 16 bytes per element
# (a top-k frame keeping every element with 8-byte indices and 4-byte values is 12)
# plus the frame header and field table.
_FRAME_BYTES_PER_ELEMENT = 16
_FRAME_OVERHEAD = 512


def max_encoded_bytes(numel: int) -> int:
    """An upper bound on the encoded size of a block of ``numel`` float32 elements."""
    return _FRAME_BYTES_PER_ELEMENT * numel + _FRAME_OVERHEAD


def delta_log_bound(slice_bytes: int, memory_budget_bytes: int) -> int:
    """Bytes a shard's compressed-downlink delta log may hold: no more than the slice's dense
    values (a pull needing more gets values instead), and at most half the shard's memory
    budget, which counts what the log holds (`ByteBudget`), so pushes always keep the other half."""
    return min(slice_bytes, memory_budget_bytes // 2)


def server_threads(num_workers: int) -> int:
    """gRPC threads (and ``maximum_concurrent_rpcs``) for a job of ``num_workers``: each worker's
    full share of calls plus spares, so no worker can be starved by another."""
    return CALLS_PER_WORKER * max(1, num_workers) + SPARE_THREADS


class CallGate:
    """At most ``per_identity`` concurrent calls per identity; the next is refused at once."""

    def __init__(self, per_identity: int = CALLS_PER_WORKER):
        self.per_identity = per_identity
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def enter(self, identity: str, what: str) -> Iterator[None]:
        with self._lock:
            n = self._active.get(identity, 0)
            if n >= self.per_identity:
                raise Reject("RESOURCE_EXHAUSTED", f"worker {identity} already has {n} calls running on this "
                                                   f"shard (at most {self.per_identity}); {what} refused")
            self._active[identity] = n + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._active[identity] - 1
                if left:
                    self._active[identity] = left
                else:
                    del self._active[identity]

    def active(self) -> int:
        with self._lock:
            return sum(self._active.values())


class ByteBudget:
    """Push bytes a shard holds in flight: ``total`` for everyone, one push at a time per identity.

    A push waits (up to ``wait_s``) for its worker's previous push and for room in the budget,
    so legitimate workers queue instead of failing; each identity holds at most one push, so
    no peer can take more than its own push's share. ``reserved()``: bytes of the budget the
    shard holds itself now (its compressed downlink's delta log, at most half the budget, see
    `delta_log_bound`), not available to pushes.
    """

    def __init__(self, total: int, wait_s: float = 30.0, reserved: Callable[[], int] | None = None):
        self.total = total
        self.wait_s = wait_s
        self._reserved = reserved or (lambda: 0)
        self._held: dict[str, int] = {}
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, identity: str, nbytes: int) -> Iterator[None]:
        """Reserve ``nbytes`` for ``identity``'s push while the block runs; Reject when it cannot."""
        with self._cond:
            reserved = self._reserved()
            room = self.total - reserved
            if nbytes > room:
                held = f" less the {reserved} bytes its compressed downlink's delta log holds" if reserved else ""
                raise Reject("RESOURCE_EXHAUSTED", f"push of {nbytes} bytes exceeds the shard's memory budget of "
                                                   f"{self.total} bytes{held} (ps.memory_budget_bytes)")
            # a worker's previous push may still be ending (e.g. on a connection it just dropped)
            if not self._cond.wait_for(lambda: identity not in self._held, self.wait_s):
                raise Reject("RESOURCE_EXHAUSTED", f"worker {identity} already has a push in flight on this shard; "
                                                   "one at a time")
            if not self._cond.wait_for(lambda: sum(self._held.values()) + nbytes <= room, self.wait_s):
                used = sum(self._held.values())
                raise Reject("RESOURCE_EXHAUSTED", f"push of {nbytes} bytes would exceed the shard's memory budget "
                                                   f"({used} of {room} bytes in flight for {self.wait_s:g} s); "
                                                   "retry")
            self._held[identity] = nbytes
        try:
            yield
        finally:
            with self._cond:
                self._held.pop(identity, None)
                self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return sum(self._held.values())
