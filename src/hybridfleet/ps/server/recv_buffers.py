"""Receive buffers of pushes, kept for the next round instead of given back to the system.

A dense push lands in one buffer per key, of the same sizes every round. Allocated fresh, each
round's buffers are new pages that the kernel zeroes on first touch (and, on a virtual machine,
pages the host may have to back again): on the 1 GiB bench that was half of a round's CPU in
its first rounds and 5 % after. `ReceiveBuffers` hands out a buffer that no one holds any more
instead, and keeps no more idle bytes than were in use at once, so the shard's resident set
never grows beyond what its busiest moment needed.

Whether a buffer is free is read from its reference count: numpy views of it (the frame's
values, a round's sum adopted from it) hold its base array directly, and a memoryview holds the
array it was made from, so while anything can still reach its memory the count is above the
pool's own references. A buffer is never written while it can be reached.
"""

from __future__ import annotations

import threading

import numpy as np

from hybridfleet.ps.server.refs import held_elsewhere

# below this a fresh allocation is cheap (and not worth keeping): the push header, small keys
MIN_POOLED_BYTES = 4 << 20


class ReceiveBuffers:
    """Byte buffers for pushes' payloads (`take`), reused once nothing holds them."""

    def __init__(self, min_bytes: int | None = None):
        """``min_bytes``: smaller payloads get a fresh buffer each time (default `MIN_POOLED_BYTES`)."""
        self.min_bytes = MIN_POOLED_BYTES if min_bytes is None else min_bytes
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []
        self.peak_in_use = 0   # the most bytes of kept buffers in use at once
        self.reused = 0        # buffers handed out again
        self.made = 0          # buffers allocated

    def take(self, n: int) -> np.ndarray:
        """``n`` writable bytes (uint8, contents undefined): an idle kept buffer of ``n`` to ``2n``
        bytes when there is one, else a new one."""
        if n < self.min_bytes:
            return np.empty(n, np.uint8)
        with self._lock:
            idle = [i for i in range(len(self._buffers)) if not held_elsewhere(self._buffers, i)]
            fits = [i for i in idle if n <= self._buffers[i].size <= 2 * n]
            if fits:
                i = min(fits, key=lambda j: self._buffers[j].size)
                out = self._buffers[i][:n]
                self.reused += 1
                idle.remove(i)
            else:
                self._buffers.append(np.empty(n, np.uint8))
                out = self._buffers[-1][:n]
                self.made += 1
            in_use = sum(b.nbytes for b in self._buffers) - sum(self._buffers[i].nbytes for i in idle)
            self.peak_in_use = max(self.peak_in_use, in_use)
            self._trim(idle, in_use)
            return out

    def _trim(self, idle: list[int], in_use: int) -> None:
        """Let go of idle buffers, oldest first, until the kept bytes are at most the peak in use."""
        kept = in_use + sum(self._buffers[i].nbytes for i in idle)
        drop = set()
        for i in idle:
            if kept <= self.peak_in_use:
                break
            kept -= self._buffers[i].nbytes
            drop.add(i)
        if drop:
            self._buffers = [b for i, b in enumerate(self._buffers) if i not in drop]

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._buffers)
