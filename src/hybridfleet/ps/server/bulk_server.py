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
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np

from hybridfleet.errors import PortInUseError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire.bulk import (
    _OPS, _U32, FRAME_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, MAGIC, MAX_HEADER_BYTES, OP_HELLO, OP_PULL, OP_PUSH,
    _discard, _reject, _response, recv_exact,
)
from hybridfleet.ps.wire.protocol import METHOD_ROLES, SERVICE, WIRE_VERSION
from hybridfleet.obs.metrics import count_rejected_push
from hybridfleet.ps.server.identity import tls_peer_site
from hybridfleet.ps.wire.admission import HandshakeSlots, shutdown_fd
from hybridfleet.ps.wire.reject import Reject
from hybridfleet.ps.wire.tls import remember_files, wrap

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


def frame_deadline(nbytes: int) -> float:
    """Seconds a peer has to deliver a frame of ``nbytes`` payload bytes."""
    return FRAME_DEADLINE_S + nbytes / MIN_FRAME_RATE


class Deadlines:
    """Shuts a socket down when its deadline passes; the thread blocked reading it then gets EOF.

    Sockets are known by file descriptor, which stays the same when TLS wraps the socket; the
    shutdown happens under the lock, so once `disarm` returns the descriptor is never touched.
    """

    def __init__(self, tick_s: float = 0.25):
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


class BulkServer:
    """Serves the bulk plane of one shard: a listening socket and one thread per connection.

    ``push(header, payloads, claims)`` and ``pull(request)`` do the work (see
    `hybridfleet.ps.server.service.ShardServicer`) and raise `hybridfleet.ps.wire.reject.Reject`;
    ``verify(token, roles)`` returns the claims or raises (None: no auth, explicit).
    """

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 verify: Callable[[str | None, set[str]], Any] | None, max_push_bytes: int,
                 push: Callable, pull: Callable, admit: Callable | None = None, max_connections: int = 64):
        """``admit(header, claims, peer_site)``: a context manager that checks a push header before
        its payload is read and holds the push's share of the shard (None: no check)."""
        self.ssl_context, self.verify, self.max_push_bytes = ssl_context, verify, max_push_bytes
        self._push, self._pull = push, pull
        self._admit = admit or (lambda header, claims, peer_site: nullcontext())
        self.max_connections = max_connections
        try:
            self._listener = socket.create_server((host, port), backlog=64)
        except OSError as err:
            raise PortInUseError(f"cannot serve the bulk data plane on {host}:{port}: {err.strerror}") from err
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._authenticated = 0  # connections past HELLO
        self._slots = HandshakeSlots(MAX_PENDING_HANDSHAKES, PENDING_PER_SOURCE)  # the others
        self._by_identity: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.deadlines = Deadlines()
        self._thread = threading.Thread(target=self._accept_loop, name="ps-bulk-accept", daemon=True)

    def start(self) -> "BulkServer":
        self.deadlines.start()
        self._thread.start()
        log.info("bulk_serving", port=self.port, tls=self.ssl_context is not None)
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.deadlines.stop()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            self._slots.take(conn.fileno(), peer[0])  # may evict an older pending connection
            threading.Thread(target=self._serve, args=(conn, peer), name="ps-bulk-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
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
            hello = self._hello(conn, who)
            self.deadlines.disarm(fd)
            if hello is None:
                return
            token, identity = hello
            with self._lock:
                if not self._slots.release(fd):
                    identity = None
                    return  # evicted while its HELLO was being checked
                n = self._by_identity.get(identity, 0)
                full = self._authenticated >= self.max_connections
                if n < CONNECTIONS_PER_IDENTITY and not full:
                    self._by_identity[identity] = n + 1
                    self._authenticated += 1
            if full and n < CONNECTIONS_PER_IDENTITY:
                msg = f"the shard's bulk plane serves {self.max_connections} connections already"
                log.warning("bulk_rejected", peer=who, code="RESOURCE_EXHAUSTED", reason=msg)
                conn.sendall(_response("RESOURCE_EXHAUSTED", msg.encode()))
                identity = None
                return
            if n >= CONNECTIONS_PER_IDENTITY:
                msg = f"worker {identity} already has {n} bulk connections to this shard (at most {CONNECTIONS_PER_IDENTITY})"
                log.warning("bulk_rejected", peer=who, code="RESOURCE_EXHAUSTED", reason=msg)
                conn.sendall(_response("RESOURCE_EXHAUSTED", msg.encode()))
                identity = None
                return
            conn.sendall(_response("OK"))
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
        except (OSError, EOFError, ssl.SSLError, ValueError) as err:
            if not self._stopped.is_set():
                log.info("bulk_connection_closed", peer=who, reason=str(err) or type(err).__name__)
        finally:
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
            conn.close()

    def _hello(self, conn: socket.socket, who: str) -> tuple[str, str] | None:
        """``(token, identity)`` of a valid HELLO, not answered yet (identity: the token's worker, or
        the peer address with auth off); None after answering a refusal."""
        op = int(recv_exact(conn, 1)[0])
        size = _U32.unpack(recv_exact(conn, 4))[0]
        if op != OP_HELLO or size > 1 << 16:
            conn.sendall(_response("INVALID_ARGUMENT", b"expected a HELLO frame first"))
            return None
        try:
            hello = json.loads(recv_exact(conn, size).tobytes())
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

    def _request(self, conn: socket.socket, fd: int, op: int, token: str, who: str) -> bool:
        """Serve one request; False when the connection must close. ``fd``: ``conn``'s descriptor,
        whose deadline covers the frame."""
        size = _U32.unpack(recv_exact(conn, 4))[0]
        try:
            if op not in (OP_PUSH, OP_PULL):
                raise _reject("INVALID_ARGUMENT", f"unknown bulk operation {op}", close=True)
            if size > MAX_HEADER_BYTES:
                raise _reject("INVALID_ARGUMENT", f"header of {size} bytes exceeds {MAX_HEADER_BYTES}", close=True)
            header = bytes(recv_exact(conn, size))
            if op == OP_PUSH:
                self._serve_push(conn, fd, header, token)
            else:
                self.deadlines.disarm(fd)  # the shard, not the peer, may now take its time
                self._serve_pull(conn, header, token)
            return True
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

    def _serve_push(self, conn: socket.socket, fd: int, header_bytes: bytes, token: str) -> None:
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
        try:
            payloads: dict[str, np.ndarray] = {}
            for k in header.keys:  # read every declared byte before judging the push: the stream stays in step
                payloads[k.key] = recv_exact(conn, k.nbytes)
            self.deadlines.disarm(fd)
            reply = self._push(header, payloads, claims)
        finally:
            admission.__exit__(None, None, None)
        conn.sendall(_response("OK", reply.SerializeToString()))

    def _serve_pull(self, conn: socket.socket, header_bytes: bytes, token: str) -> None:
        try:
            request = ps_pb2.PullRequest.FromString(header_bytes)
        except Exception:
            raise _reject("INVALID_ARGUMENT", "malformed pull request", close=True) from None
        claims = self._claims(token, "Pull")  # the token may have expired since HELLO
        version, items = self._pull(request, claims, tls_peer_site(conn))
        body = json.dumps({"version": version, "items": [[k, dv, total] for k, _, total, dv in items]}).encode()
        conn.sendall(_response("OK", body))
        for _, pieces, _, _ in items:
            for piece in pieces:
                conn.sendall(piece)


def server_ssl_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """TLS for a shard's bulk listener; with ``ca`` clients must show a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if ca is not None:
        ctx.load_verify_locations(cafile=ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return remember_files(ctx, certfile=cert, keyfile=key, cafile=ca)
