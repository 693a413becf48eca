"""Bounding connections that have not authenticated yet (a shard's bulk plane, a site hub).

Before a peer has shown its token nothing tells a worker from a stranger, so a listener
cannot reserve slots for workers by identity. It can make holding a slot worthless: at
most ``per_source`` pending connections from one address and ``total`` in all, and a new
connection over either bound evicts the oldest pending one (of its own address first)
instead of being refused. A worker whose handshake completes before an attacker opens
``per_source`` (or ``total``) new connections therefore always gets in, however many idle
connections are held, and an idle connection costs its holder a slot only until the next
arrival or its handshake deadline. Authenticated connections are counted elsewhere, so
the pending ones never take their places.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict


def shutdown_fd(fd: int) -> None:
    """Shut down the TCP connection on ``fd`` (also under TLS) without closing the descriptor;
    the thread blocked reading it gets EOF."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def peer_open(fd: int) -> bool:
    """Whether the peer of the connected socket ``fd`` may still be there: False once it closed its
    end (end of stream, a reset) or sent bytes while it should be waiting for an answer."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed meanwhile (its pull was answered): nothing to say about it
        return True
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return False  # the end of the stream, or bytes it should not send now
    except (BlockingIOError, InterruptedError):
        return True  # nothing to read: it waits, as it should
    except OSError:
        return False
    finally:
        sock.detach()


class HandshakeSlots:
    """Pending (not yet authenticated) connections by descriptor, bounded per source and in all.

    `take` registers a connection and evicts (shuts down) older pending ones beyond the
    bounds; `release` forgets one and must be called before its descriptor is closed (the
    eviction happens under the same lock, so a released descriptor is never touched).
    """

    def __init__(self, total: int, per_source: int):
        if not 1 <= per_source <= total:
            raise ValueError(f"per_source: must be in 1..total ({total}) (got {per_source})")
        self.total, self.per_source = total, per_source
        self._pending: OrderedDict[int, str] = OrderedDict()  # fd -> source address, oldest first
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def take(self, fd: int, source: str) -> None:
        """Register ``fd`` from ``source``; evict the oldest pending connection of ``source`` when it
        holds ``per_source`` already, else the oldest of all when ``total`` are pending."""
        with self._lock:
            same = [f for f, s in self._pending.items() if s == source]
            if len(same) >= self.per_source:
                self._evict(same[0])
            elif len(self._pending) >= self.total:
                self._evict(next(iter(self._pending)))
            self._pending[fd] = source

    def release(self, fd: int) -> bool:
        """Forget ``fd`` (handshake done, refused or closed); True when it was still pending."""
        with self._lock:
            return self._pending.pop(fd, None) is not None

    def _evict(self, fd: int) -> None:
        del self._pending[fd]
        self.evicted += 1
        shutdown_fd(fd)
