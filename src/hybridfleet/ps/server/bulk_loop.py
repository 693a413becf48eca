"""The bulk plane's event loop: one thread watches every connection that waits for its peer.

It accepts connections, drives their TLS handshakes without blocking
(`hybridfleet.ps.wire.tls.wrap_nonblocking`), collects each HELLO frame as its bytes
arrive, and watches authenticated connections that are idle between requests. A
connection with work (a complete HELLO, the first byte of a request) is handed to the
server (`hybridfleet.ps.server.bulk_server.BulkServer`), whose fixed pool serves it and
gives it back with `EventLoop.resume` once it waits for its peer again. Nothing here
waits on one peer, so the loop's single thread serves any number of connections; the
deadlines that cut slow peers stay the server's `Deadlines` watchdog (a cut socket reads
as end of stream here).
"""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
from typing import Any, Callable

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.wire.bulk import _U32, OP_HELLO
from hybridfleet.ps.wire.tls import handshake_step

log = get_logger("ps.bulk")

# A read that would wait raises one of these, depending on the transport (plain socket,
# the ssl module's SSLSocket, the native TLSConnection) once it is non-blocking.
WOULD_BLOCK = (BlockingIOError, TimeoutError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
FAILED = (OSError, EOFError, ssl.SSLError, ValueError)
_FRAME_START = 1 + _U32.size  # op and length of a request frame


class Conn:
    """One bulk connection: its transport and where it stands (``phase``: ``"handshake"``,
    ``"hello"``, ``"idle"`` while the loop watches it, ``"busy"`` while the server's pool has it)."""

    __slots__ = ("sock", "fd", "who", "phase", "hello", "token", "identity", "__weakref__")

    def __init__(self, sock: Any, peer) -> None:
        self.sock, self.fd, self.who = sock, sock.fileno(), f"{peer[0]}:{peer[1]}"
        self.phase, self.hello = "handshake", bytearray()
        self.token, self.identity = "", None


class EventLoop:
    """Accepts on ``listener`` and watches connections (see the module docstring).

    ``accepted(sock, peer)``: a `Conn` for a new connection, its TLS not started (or None when
    it is refused); ``tls``: wraps a socket for a non-blocking handshake (None: plaintext);
    ``hello_ready(conn, op, size, body)``: a HELLO frame is in (``body`` None when its first
    five bytes already break the rules: op, or a size over ``max_hello_bytes``);
    ``readable(conn)``: an idle connection has bytes (or was closed); ``close(conn)``: a
    connection ends while the loop holds it. Each runs in the loop's thread and must not block.
    """

    def __init__(self, listener: socket.socket, tls: Callable | None, accepted: Callable, hello_ready: Callable,
                 readable: Callable, close: Callable, max_hello_bytes: int):
        self._listener, self._tls = listener, tls
        self._accepted, self._hello_ready, self._readable, self._close = accepted, hello_ready, readable, close
        self._max_hello = max_hello_bytes
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._returned: list[Conn] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ps-bulk-loop", daemon=True)

    def start(self) -> None:
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()

    def stop(self) -> None:
        """End the loop; the connections it holds are closed (through ``close``)."""
        with self._lock:
            self._stopped = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def resume(self, conn: Conn) -> None:
        """Watch ``conn`` again for its next request (called by whoever held it, from any thread)."""
        with self._lock:
            if self._stopped:
                stopped = True
            else:
                stopped = False
                self._returned.append(conn)
        if stopped:
            self._close(conn)
            return
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already (or the loop has ended)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopped:
                        break
                for key, events in self._sel.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_returned()
                    else:
                        self._event(key.data)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, Conn):
                self._sel.unregister(key.fd)
                self._close(key.data)
        with self._lock:
            returned, self._returned = self._returned, []
        for conn in returned:
            self._close(conn)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _take_returned(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            returned, self._returned = self._returned, []
        for conn in returned:
            conn.phase = "idle"
            self._watch(conn, selectors.EVENT_READ)

    def _watch(self, conn: Conn, events: int) -> None:
        try:
            self._sel.modify(conn.fd, events, conn)
        except KeyError:
            self._sel.register(conn.fd, events, conn)

    def _drop(self, conn: Conn) -> None:
        """Stop watching ``conn``: it ends, or goes to the server's pool."""
        try:
            self._sel.unregister(conn.fd)
        except (KeyError, ValueError):
            pass

    def _accept(self) -> None:
        for _ in range(64):  # a burst of arrivals, then back to the others
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # e.g. out of descriptors: the next arrival is tried on the next event
                log.warning("bulk_accept_failed", error=str(err))
                return
            conn = self._accepted(sock, peer)
            if conn is None:
                continue
            try:
                if self._tls is not None:
                    conn.sock = self._tls(sock)
                else:
                    sock.setblocking(False)
                    conn.phase = "hello"
            except FAILED as err:
                log.info("bulk_connection_closed", peer=conn.who, reason=str(err) or type(err).__name__)
                self._close(conn)
                continue
            self._event(conn)

    def _event(self, conn: Conn) -> None:
        """``conn`` is ready (or just accepted): take its handshake, HELLO or request as far as it goes."""
        try:
            if conn.phase == "handshake":
                wants = handshake_step(conn.sock)
                if wants is not None:
                    self._watch(conn, selectors.EVENT_WRITE if wants == "write" else selectors.EVENT_READ)
                    return
                conn.phase = "hello"  # the HELLO may be buffered already: read on at once
            if conn.phase == "hello":
                self._read_hello(conn)
            elif conn.phase == "idle":
                self._drop(conn)
                conn.phase = "busy"
                self._readable(conn)
        except FAILED as err:
            log.info("bulk_connection_closed", peer=conn.who, reason=str(err) or type(err).__name__)
            self._drop(conn)
            self._close(conn)

    def _read_hello(self, conn: Conn) -> None:
        buf = conn.hello
        while True:
            need = _FRAME_START if len(buf) < _FRAME_START else _FRAME_START + _U32.unpack_from(buf, 1)[0]
            if len(buf) == _FRAME_START and (buf[0] != OP_HELLO or need - _FRAME_START > self._max_hello):
                return self._hand_over(conn, buf[0], need - _FRAME_START, None)  # refused before its body
            if len(buf) >= need:
                return self._hand_over(conn, buf[0], need - _FRAME_START, bytes(buf[_FRAME_START:need]))
            try:
                got = conn.sock.recv(need - len(buf))
            except WOULD_BLOCK:
                self._watch(conn, selectors.EVENT_READ)
                return
            if not got:
                raise EOFError(f"connection closed after {len(buf)} bytes of its HELLO")
            buf += got

    def _hand_over(self, conn: Conn, op: int, size: int, body: bytes | None) -> None:
        self._drop(conn)
        conn.phase, conn.hello = "busy", bytearray()
        self._hello_ready(conn, op, size, body)
