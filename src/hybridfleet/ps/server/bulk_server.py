"""The shard side of the bulk data plane (framing in `hybridfleet.ps.wire.bulk`).

Every peer's share is bounded: at most ``max_connections`` authenticated connections
(`CONNECTIONS_PER_IDENTITY` per worker), and apart from them at most
`MAX_PENDING_HANDSHAKES` before their HELLO is accepted, `PENDING_PER_SOURCE` of them from
one address, a new arrival evicting the oldest pending one rather than being refused
(`hybridfleet.ps.wire.admission`): idle connections from anywhere never lock a worker out; the TLS handshake and HELLO together
must finish within `HANDSHAKE_TIMEOUT_S`, and each request frame within a deadline
set by its size (`frame_deadline`), however the bytes trickle in. A `Deadlines`
watchdog enforces both by shutting the socket down, so the reads stay plain blocking
calls through `recv_exact`.

Threads do not grow with the number of workers: one event loop (`bulk_loop.EventLoop`)
accepts, runs the TLS handshakes without blocking, collects each HELLO and watches
every idle connection; a connection with a request goes to a fixed pool of
`POOL_THREADS` threads, which reads the frame (a whole frame per call on the native TLS
path, without the GIL), serves it and hands the connection back to the loop; one
worker's requests are served one at a time (`_as_identity`), so however slowly it sends or
reads it holds at most one pool thread. A pull
that must wait for its round holds no thread: it is parked with the shard
(`Downlink.pull_now`), the event that makes it ready queues it on the pool again, and
the watchdog's tick answers it once its time is up.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np

from hybridfleet.errors import PortInUseError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire.bulk import (
    _OPS, _U32, FRAME_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, MAGIC, MAX_HEADER_BYTES, OP_HEARTBEAT, OP_HELLO, OP_LEAVE,
    OP_PULL, OP_PUSH, _discard, _reject, _response, recv_exact, recv_exact_into,
)
from hybridfleet.ps.wire.protocol import METHOD_ROLES, SERVICE, WIRE_VERSION
from hybridfleet.obs.metrics import count_rejected_push
from hybridfleet.ps.server.bulk_loop import FAILED, WOULD_BLOCK, Conn, EventLoop
from hybridfleet.ps.server.deadlines import Deadlines
from hybridfleet.ps.server.downlink import send_values
from hybridfleet.ps.server.recv_buffers import ReceiveBuffers
from hybridfleet.ps.server.identity import tls_peer_site
from hybridfleet.ps.wire.admission import HandshakeSlots, peer_open
from hybridfleet.ps.wire.reject import Reject
from hybridfleet.ps.wire.tls import remember_files, wrap, wrap_nonblocking

log = get_logger("ps.bulk")

MAX_PENDING_HANDSHAKES = 32
PENDING_PER_SOURCE = 8
CONNECTIONS_PER_IDENTITY = 2
# A request frame may take FRAME_DEADLINE_S plus one second per MIN_FRAME_RATE bytes it carries.
FRAME_DEADLINE_S = 30.0
MIN_FRAME_RATE = 256 << 10
# A refused push up to this size is read and dropped so the connection stays in step; a
# larger one closes the connection.
DISCARD_LIMIT = 64 << 20
# Threads that serve requests, whatever the number of workers (each request holds one only
# while its bytes move or the shard applies it; a waiting pull holds none).
POOL_THREADS = 8
# How often parked pulls are looked at together: rounds that close on the clock (late
# joiners), ssp clock waits, and pulls whose time is up.
PARK_POLL_S = 0.5
MAX_HELLO_BYTES = 1 << 16
_PARKED = object()  # a request answered later, by whoever completes its parked pull
_DONE = object()  # a parked pull someone else has completed


def frame_deadline(nbytes: int) -> float:
    """Seconds a peer has to deliver a frame of ``nbytes`` payload bytes."""
    return FRAME_DEADLINE_S + nbytes / MIN_FRAME_RATE


class _ParkedPull:
    """A bulk pull waiting for its round without a thread; registered with the shard as a waiter."""

    __slots__ = ("server", "conn", "request", "deadline", "release", "blocked", "lock", "done", "expiring")

    def __init__(self, server: "BulkServer", conn: Conn, request, deadline: float, release: Callable[[], None]):
        self.server, self.conn, self.request, self.deadline, self.release = server, conn, request, deadline, release
        self.blocked = None  # what it waits for, set by the shard
        self.lock = threading.Lock()
        self.done = self.expiring = False

    def notify(self) -> None:
        """The shard's event that may make this pull ready (called under the shard's lock): ask again
        on the pool, never here."""
        self.server._submit(self.server._as_identity, self.conn, lambda: self.server._resume_pull(self, False))


class BulkServer:
    """Serves the bulk plane of one shard: a listening socket, one event loop and a fixed pool.

    ``push(header, payloads, claims)`` and ``pull(request)`` do the work (see
    `hybridfleet.ps.server.service.ShardServicer`) and raise `hybridfleet.ps.wire.reject.Reject`;
    ``verify(token, roles)`` returns the claims or raises (None: no auth, explicit). ``pulls``:
    what lets a waiting pull park instead of holding a thread (``open_pull``, ``try_pull``,
    ``unpark``, ``poll_parked`` of `ShardServicer`); None: pulls wait in a pool thread.
    ``heartbeat(request, claims, peer_site)`` and ``leave(...)`` answer the control calls a
    worker sends here once its bulk connection is up (None: refused as unknown operations).
    """

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 verify: Callable[[str | None, set[str]], Any] | None, max_push_bytes: int,
                 push: Callable, pull: Callable, admit: Callable | None = None, max_connections: int = 64,
                 pulls: Any = None, pool_threads: int | None = None, heartbeat: Callable | None = None,
                 leave: Callable | None = None):
        """``admit(header, claims, peer_site)``: a context manager that checks a push header before
        its payload is read and holds the push's share of the shard (None: no check)."""
        self.ssl_context, self.verify, self.max_push_bytes = ssl_context, verify, max_push_bytes
        self._push, self._pull, self._pulls = push, pull, pulls
        self._control = {op: (fn, parse) for op, fn, parse in (
            (OP_HEARTBEAT, heartbeat, ps_pb2.HeartbeatRequest.FromString),
            (OP_LEAVE, leave, ps_pb2.LeaveRequest.FromString)) if fn is not None}
        self._pushing: dict[str, int] = {}  # workers whose push is arriving now (admitted), how many
        self.receive_buffers = ReceiveBuffers()  # the pushes' payloads land in buffers kept across rounds
        self._admit = admit or (lambda header, claims, peer_site: nullcontext())
        self.max_connections = max_connections
        try:
            self._listener = socket.create_server((host, port), backlog=1024)
        except OSError as err:
            raise PortInUseError(f"cannot serve the bulk data plane on {host}:{port}: {err.strerror}") from err
        self.port = self._listener.getsockname()[1]
        self._conns: set = set()  # transports of the connections past their handshake
        self._authenticated = 0  # connections past HELLO
        self._slots = HandshakeSlots(MAX_PENDING_HANDSHAKES, PENDING_PER_SOURCE)  # the others
        self._by_identity: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._parked: set[_ParkedPull] = set()
        self._last_poll = 0.0
        self.pool_threads = pool_threads or POOL_THREADS
        self._pool = ThreadPoolExecutor(max_workers=self.pool_threads, thread_name_prefix="ps-bulk")
        self._serving: set[str] = set()  # identities a pool thread is serving now
        self._queued: dict[str, deque[Callable[[], None]]] = {}  # their further work, in order
        self.deadlines = Deadlines(on_tick=self._tick)
        tls = None if ssl_context is None else (lambda sock: wrap_nonblocking(ssl_context, sock))
        self._loop = EventLoop(self._listener, tls, self._accepted, self._hello_ready, self._readable,
                               self._close, MAX_HELLO_BYTES)

    def start(self) -> "BulkServer":
        self.deadlines.start()
        self._loop.start()
        log.info("bulk_serving", port=self.port, tls=self.ssl_context is not None, pool_threads=self.pool_threads)
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.deadlines.stop()
        self._loop.stop()  # closes the connections it watches
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
            parked, self._parked = list(self._parked), set()
        for p in parked:
            if self._pulls is not None:
                self._pulls.unpark(p)
        for c in conns:  # the ones a pool thread (or a parked pull) holds: their calls fail and end
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in parked:
            self._close(p.conn)

    def busy_workers(self) -> set[str]:
        """Workers the bulk plane is serving now: a push of theirs arriving (past its admission
        check) or a pull of theirs parked on a connection that is still open. Their connection
        carries no heartbeat meanwhile, so the shard counts them as alive."""
        with self._lock:
            return set(self._pushing) | {p.request.worker_id for p in self._parked if not p.done}

    @property
    def parked_pulls(self) -> int:
        """Pulls waiting for their round now, none of them holding a thread."""
        with self._lock:
            return len(self._parked)

    def _submit(self, fn: Callable, *args) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the server is stopping: the connection is closed by stop()
            pass

    # ------------------------------------------------------------------ the event loop's callbacks
    def _accepted(self, sock: socket.socket, peer) -> Conn | None:
        if self._stopped.is_set():
            sock.close()
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # the peer is gone already: its first read says so
        self._slots.take(sock.fileno(), peer[0])  # may evict an older pending connection
        self.deadlines.arm(sock.fileno(), HANDSHAKE_TIMEOUT_S)  # TLS handshake and HELLO together
        return Conn(sock, peer)

    def _hello_ready(self, c: Conn, op: int, size: int, body: bytes | None) -> None:
        with self._lock:
            self._conns.add(c.sock)
        self._submit(self._serve_hello, c, op, size, body)

    def _readable(self, c: Conn) -> None:
        self._submit(self._as_identity, c, lambda: self._next(c))

    def _as_identity(self, c: Conn, job: Callable[[], None]) -> None:
        """Run ``job`` (work on ``c``) now, unless a pool thread serves the same identity already:
        then that thread runs it next. One worker so holds at most one pool thread, however slowly
        its bytes come or go on its connections; the others' requests go on in the rest."""
        identity = c.identity
        with self._lock:
            if identity in self._serving:
                self._queued.setdefault(identity, deque()).append(job)
                return
            self._serving.add(identity)
        while job is not None:
            try:
                job()
            except Exception as err:  # a bug: the connection's own handlers log and close on failures
                log.error("bulk_request_failed", peer=c.who, error=f"{type(err).__name__}: {err}")
            with self._lock:
                waiting = self._queued.get(identity)
                job = waiting.popleft() if waiting else None
                if waiting is not None and not waiting:
                    del self._queued[identity]
                if job is None:
                    self._serving.discard(identity)

    def _close(self, c: Conn) -> None:
        with self._lock:
            if c.phase == "closed":
                return
            c.phase = "closed"
        identity, c.identity = c.identity, None
        self._release(c.sock, c.fd, identity)

    def _release(self, conn, fd: int, identity: str | None) -> None:
        """Forget a connection that ends (its deadline, slot, identity count) and close it."""
        self.deadlines.disarm(fd)
        self._slots.release(fd)
        with self._lock:
            self._conns.discard(conn)
            if identity is not None:
                self._authenticated -= 1
                left = self._by_identity.get(identity, 1) - 1
                if left > 0:
                    self._by_identity[identity] = left
                else:
                    self._by_identity.pop(identity, None)
        try:
            conn.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ the pool's work
    def _serve_hello(self, c: Conn, op: int, size: int, body: bytes | None) -> None:
        try:
            c.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            hello = self._check_hello(c.sock, c.who, op, size, body)
            self.deadlines.disarm(c.fd)
            if hello is None:
                return self._close(c)
            c.token, identity = hello
            c.identity = self._take_identity(c.sock, c.fd, identity, c.who)
            if c.identity is None:
                return self._close(c)
        except FAILED as err:
            if not self._stopped.is_set():
                log.info("bulk_connection_closed", peer=c.who, reason=str(err) or type(err).__name__)
            return self._close(c)
        self._as_identity(c, lambda: self._next(c))

    def _next(self, c: Conn) -> None:
        """Serve the requests that are there on ``c``, then hand it back to the loop (or close it,
        or leave it to its parked pull)."""
        while not self._stopped.is_set():
            try:
                c.sock.settimeout(0.0)
                first = c.sock.recv(1)
            except WOULD_BLOCK:
                return self._loop.resume(c)
            except FAILED as err:
                log.info("bulk_connection_closed", peer=c.who, reason=str(err) or type(err).__name__)
                return self._close(c)
            if not first:
                return self._close(c)
            c.sock.settimeout(FRAME_TIMEOUT_S)
            self.deadlines.arm(c.fd, frame_deadline(0))  # until the header is in
            try:
                outcome = self._request(c.sock, c.fd, first[0], c.token, c.who, park=c)
            except FAILED as err:
                if not self._stopped.is_set():
                    log.info("bulk_connection_closed", peer=c.who, reason=str(err) or type(err).__name__)
                outcome = False
            finally:
                self.deadlines.disarm(c.fd)
            if outcome is _PARKED:
                return
            if not outcome:
                return self._close(c)
        self._close(c)

    # ------------------------------------------------------------------ parked pulls
    def _attempt(self, p: _ParkedPull, expired: bool):
        """The pull's answer, None while it stays parked, `_DONE` when another thread completed it;
        raises Reject (the pull is then over)."""
        with p.lock:
            if p.done:
                return _DONE
            self._pulls.unpark(p)
            try:
                answer = self._pulls.try_pull(p.request, p, expired)
            except BaseException:
                self._finish(p)
                raise
            if answer is not None:
                self._finish(p)
            return answer

    def _finish(self, p: _ParkedPull) -> None:
        p.done = True
        p.release()
        with self._lock:
            self._parked.discard(p)

    def _resume_pull(self, p: _ParkedPull, expired: bool) -> None:
        c = p.conn
        keep = True
        try:
            try:
                answer = self._attempt(p, expired)
            except Reject as rej:
                log.warning("bulk_rejected", peer=c.who, code=rej.code, reason=rej.message)
                c.sock.settimeout(FRAME_TIMEOUT_S)
                c.sock.sendall(_response(rej.code, rej.message.encode()))
                keep = not getattr(rej, "close", False)
            except Exception as err:  # a bug, not the peer's fault (as in _request)
                log.error("bulk_request_failed", peer=c.who, op="Pull", error=f"{type(err).__name__}: {err}")
                c.sock.settimeout(FRAME_TIMEOUT_S)
                c.sock.sendall(_response("INTERNAL", f"shard failed to serve the request: {type(err).__name__}"
                                         .encode()))
                keep = False
            else:
                if answer is None or answer is _DONE:
                    return
                c.sock.settimeout(FRAME_TIMEOUT_S)
                self._send_pull(c.sock, *answer)
        except FAILED as err:
            if not self._stopped.is_set():
                log.info("bulk_connection_closed", peer=c.who, reason=str(err) or type(err).__name__)
            keep = False
        if keep:
            self._next(c)
        else:
            self._close(c)

    def _tick(self) -> None:
        """Every `PARK_POLL_S` (from the watchdog's thread): what a waiting pull thread did on its
        own half-second wake-up, once for all parked pulls; pulls whose time is up are answered."""
        now = time.monotonic()
        if self._pulls is None or now - self._last_poll < PARK_POLL_S:
            return
        self._last_poll = now
        with self._lock:
            due = [p for p in self._parked if p.deadline <= now and not p.expiring]
            parked = list(self._parked)
        for p in parked:
            if not p.expiring and not peer_open(p.conn.fd):
                self._drop_parked(p)
        if parked:
            self._pulls.poll_parked()
        for p in due:
            p.expiring = True
            self._submit(self._as_identity, p.conn, lambda p=p: self._resume_pull(p, True))

    def _drop_parked(self, p: _ParkedPull) -> None:
        """The worker of a parked pull closed its connection (it exited or was killed): the pull is
        over and the connection closes, so the worker no longer counts as busy here."""
        with p.lock:
            if p.done:
                return
            self._pulls.unpark(p)
            self._finish(p)
        log.info("bulk_connection_closed", peer=p.conn.who, reason="closed by the peer while its pull waited")
        self._close(p.conn)

    # ------------------------------------------------------------------ one connection, blocking
    def _serve(self, conn: socket.socket, peer) -> None:
        """Serve one accepted connection to its end in the calling thread with blocking reads (what
        the pool does request by request; a fuzzing harness drives this directly)."""
        who = f"{peer[0]}:{peer[1]}"
        fd, identity = conn.fileno(), None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            self.deadlines.arm(fd, HANDSHAKE_TIMEOUT_S)  # TLS handshake and HELLO together
            if self.ssl_context is not None:
                conn = wrap(self.ssl_context, conn, server_side=True)
            with self._lock:
                self._conns.add(conn)
            op = int(recv_exact(conn, 1)[0])
            size = _U32.unpack(recv_exact(conn, 4))[0]
            ok = op == OP_HELLO and size <= MAX_HELLO_BYTES
            hello = self._check_hello(conn, who, op, size, recv_exact(conn, size).tobytes() if ok else None)
            self.deadlines.disarm(fd)
            if hello is None:
                return
            token, identity = hello
            identity = self._take_identity(conn, fd, identity, who)
            if identity is None:
                return
            while not self._stopped.is_set():
                conn.settimeout(None)  # a worker may stay idle between steps
                first = conn.recv(1)
                if not first:
                    return
                conn.settimeout(FRAME_TIMEOUT_S)
                self.deadlines.arm(fd, frame_deadline(0))  # until the header is in
                try:
                    if not self._request(conn, fd, first[0], token, who):
                        return
                finally:
                    self.deadlines.disarm(fd)
        except FAILED as err:
            if not self._stopped.is_set():
                log.info("bulk_connection_closed", peer=who, reason=str(err) or type(err).__name__)
        finally:
            self._release(conn, fd, identity)

    # ------------------------------------------------------------------ requests
    def _take_identity(self, conn, fd: int, identity: str, who: str) -> str | None:
        """Count an authenticated connection for ``identity`` and answer its HELLO; None after a
        refusal (over the shard's or the identity's connections, or evicted meanwhile)."""
        with self._lock:
            if not self._slots.release(fd):
                return None  # evicted while its HELLO was being checked
            n = self._by_identity.get(identity, 0)
            full = self._authenticated >= self.max_connections
            if n < CONNECTIONS_PER_IDENTITY and not full:
                self._by_identity[identity] = n + 1
                self._authenticated += 1
        if n >= CONNECTIONS_PER_IDENTITY:
            msg = f"worker {identity} already has {n} bulk connections to this shard (at most {CONNECTIONS_PER_IDENTITY})"
        elif full:
            msg = f"the shard's bulk plane serves {self.max_connections} connections already"
        else:
            conn.sendall(_response("OK"))
            return identity
        log.warning("bulk_rejected", peer=who, code="RESOURCE_EXHAUSTED", reason=msg)
        conn.sendall(_response("RESOURCE_EXHAUSTED", msg.encode()))
        return None

    def _check_hello(self, conn, who: str, op: int, size: int, body: bytes | None) -> tuple[str, str] | None:
        """``(token, identity)`` of a valid HELLO, not answered yet (identity: the token's worker, or
        the peer address with auth off); None after answering a refusal. ``body`` None: the frame
        was not read, its op or size being wrong."""
        if op != OP_HELLO or size > MAX_HELLO_BYTES or body is None:
            conn.sendall(_response("INVALID_ARGUMENT", b"expected a HELLO frame first"))
            return None
        try:
            hello = json.loads(body)
            ok = isinstance(hello, dict) and hello.get("magic") == MAGIC
        except ValueError:
            ok = False
        if not ok:
            conn.sendall(_response("INVALID_ARGUMENT", b"malformed HELLO frame"))
            return None
        if hello.get("wire_version") != WIRE_VERSION:
            msg = f"wire version {hello.get('wire_version')} != server's {WIRE_VERSION}; upgrade the older side"
            conn.sendall(_response("FAILED_PRECONDITION", msg.encode()))
            return None
        token = hello.get("token") or ""
        if not isinstance(token, str):
            conn.sendall(_response("INVALID_ARGUMENT", b"malformed HELLO frame: token must be a string"))
            return None
        try:
            claims = self._claims(token, "Hello")
            peer_site = tls_peer_site(conn)
            if claims is not None and peer_site is not None and peer_site != claims.site:
                raise _reject("PERMISSION_DENIED", f"client certificate is for site {peer_site!r}, the token for "
                                                   f"site {claims.site!r}")
        except Reject as rej:
            log.warning("bulk_rejected", peer=who, code=rej.code, reason=rej.message)
            conn.sendall(_response(rej.code, rej.message.encode()))
            return None
        return token, (claims.worker or claims.site) if claims is not None else who

    def _claims(self, token: str, method: str):
        if self.verify is None:
            return None
        from hybridfleet.security.tokens import TokenRejectedError

        roles = METHOD_ROLES[f"/{SERVICE}/{'Push' if method == 'Hello' else method}"]
        try:
            return self.verify(token or None, roles)
        except TokenRejectedError as err:
            raise _reject("PERMISSION_DENIED" if err.reason == "role" else "UNAUTHENTICATED", str(err)) from None

    def _request(self, conn, fd: int, op: int, token: str, who: str, park: Conn | None = None):
        """Serve one request; False when the connection must close, `_PARKED` when a parked pull
        answers it later (``park``: the connection, which may park a pull; None: a pull waits here).
        ``fd``: ``conn``'s descriptor, whose deadline covers the frame."""
        size = _U32.unpack(recv_exact(conn, 4))[0]
        try:
            if op not in (OP_PUSH, OP_PULL) and op not in self._control:
                raise _reject("INVALID_ARGUMENT", f"unknown bulk operation {op}", close=True)
            if size > MAX_HEADER_BYTES:
                raise _reject("INVALID_ARGUMENT", f"header of {size} bytes exceeds {MAX_HEADER_BYTES}", close=True)
            header = bytes(recv_exact(conn, size))
            if op in self._control:
                self._serve_control(conn, op, header, token)
                return True
            if op == OP_PUSH:
                self._serve_push(conn, fd, header, token)
                return True
            self.deadlines.disarm(fd)  # the shard, not the peer, may now take its time
            return self._serve_pull(conn, header, token, park)
        except Reject as rej:
            log.warning("push_rejected" if op == OP_PUSH else "bulk_rejected", peer=who, code=rej.code,
                        reason=rej.message)
            if op == OP_PUSH:
                count_rejected_push(rej.code)
            conn.sendall(_response(rej.code, rej.message.encode()))
            return not getattr(rej, "close", False)
        except (OSError, EOFError, ssl.SSLError):
            raise
        except Exception as err:  # a bug, not the peer's fault: say so, as gRPC would, and drop the connection
            log.error("bulk_request_failed", peer=who, op=_OPS.get(op, op), error=f"{type(err).__name__}: {err}")
            conn.sendall(_response("INTERNAL", f"shard failed to serve the request: {type(err).__name__}".encode()))
            return False

    def _serve_push(self, conn, fd: int, header_bytes: bytes, token: str) -> None:
        try:
            header = ps_pb2.PushHeader.FromString(header_bytes)
        except Exception:  # protobuf raises DecodeError (and others) on garbage
            raise _reject("INVALID_ARGUMENT", "malformed push header", close=True) from None
        declared = sum(k.nbytes for k in header.keys)
        self.deadlines.arm(fd, frame_deadline(declared))
        try:
            claims = self._claims(token, "Push")
            admission = self._admit(header, claims, tls_peer_site(conn))
            admission.__enter__()
        except Reject as rej:
            if declared > DISCARD_LIMIT:
                rej.close = True  # not worth reading: drop the connection instead
            else:
                _discard(conn, declared)  # the sender is already streaming them: keep the connection in step
            raise
        worker = header.worker_id
        with self._lock:
            self._pushing[worker] = self._pushing.get(worker, 0) + 1
        try:
            payloads: dict[str, np.ndarray] = {}
            for k in header.keys:  # read every declared byte before judging the push: the stream stays in step
                payloads[k.key] = buf = self.receive_buffers.take(k.nbytes)
                recv_exact_into(conn, memoryview(buf))
            self.deadlines.disarm(fd)
            reply = self._push(header, payloads, claims)
        finally:
            with self._lock:
                left = self._pushing.pop(worker) - 1
                if left:
                    self._pushing[worker] = left
            admission.__exit__(None, None, None)
        conn.sendall(_response("OK", reply.SerializeToString()))

    def _serve_control(self, conn, op: int, header_bytes: bytes, token: str) -> None:
        """A Heartbeat or Leave: the same checks and answer as on gRPC."""
        serve, parse = self._control[op]
        try:
            request = parse(header_bytes)
        except Exception:  # protobuf raises DecodeError (and others) on garbage
            raise _reject("INVALID_ARGUMENT", f"malformed {_OPS[op].lower()} request", close=True) from None
        claims = self._claims(token, _OPS[op])  # the token may have expired since HELLO
        reply = serve(request, claims, tls_peer_site(conn))
        conn.sendall(_response("OK", reply.SerializeToString()))

    def _serve_pull(self, conn, header_bytes: bytes, token: str, park: Conn | None):
        try:
            request = ps_pb2.PullRequest.FromString(header_bytes)
        except Exception:
            raise _reject("INVALID_ARGUMENT", "malformed pull request", close=True) from None
        claims = self._claims(token, "Pull")  # the token may have expired since HELLO
        if park is None or self._pulls is None:
            self._send_pull(conn, *self._pull(request, claims, tls_peer_site(conn)))
            return True
        release, wait_s = self._pulls.open_pull(request, claims, tls_peer_site(conn))
        p = _ParkedPull(self, park, request, time.monotonic() + wait_s, release)
        with self._lock:
            self._parked.add(p)
        answer = self._attempt(p, wait_s <= 0)
        if answer is None or answer is _DONE:
            return _PARKED
        self._send_pull(conn, *answer)
        return True

    @staticmethod
    def _send_pull(conn, version: int, items: list) -> None:
        body = json.dumps({"version": version, "items": [[k, dv, total] for k, _, total, dv in items]}).encode()
        conn.sendall(_response("OK", body))
        send_values(conn.sendall, items)  # ValuesChanged (an OSError): the connection closes


def server_ssl_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """TLS for a shard's bulk listener; with ``ca`` clients must show a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if ca is not None:
        ctx.load_verify_locations(cafile=ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return remember_files(ctx, certfile=cert, keyfile=key, cafile=ca)
