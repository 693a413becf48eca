"""The worker side of the bulk data plane (framing in `hybridfleet.ps.wire.bulk`)."""

from __future__ import annotations

import json
import random
import socket
import ssl
import threading
import time
from typing import Any, Callable

import grpc

from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire.bulk import (
    _U32, FRAME_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, IDLE_TIMEOUT_S, MAGIC, OP_HEARTBEAT, OP_HELLO, OP_LEAVE, OP_PULL,
    OP_PUSH, BulkError, _frame, _read_response, _status, recv_exact, recv_exact_into,
)
from hybridfleet.ps.wire.protocol import WIRE_VERSION
from hybridfleet.ps.wire.tls import remember_files, wrap

# Attempts to open a connection that the shard closes during its handshake (see BulkChannel._connect)
CONNECT_ATTEMPTS = 8
# The delays between those attempts come from a generator of their own: a worker's threads never draw
# from the script's `random` module, whose state the script's checkpoints record for an exact resume
_JITTER = random.Random()


def client_ssl_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a worker's bulk connections: trusts ``ca``; shows ``cert`` when the shard wants mutual TLS."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert and key:
        ctx.load_cert_chain(cert, key)
        return remember_files(ctx, certfile=cert, keyfile=key, cafile=ca)
    return remember_files(ctx, cafile=ca)


# -------------------------------------------------------------------------- client
class BulkChannel:
    """A worker's connection to one shard's bulk plane; connects on first use and after a failure.

    Calls are serialized (one request at a time per connection). Transport failures
    raise `BulkError` with ``UNAVAILABLE``, refusals the shard's own status code.
    """

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None, server_hostname: str | None,
                 token: str | Callable[[], str | None] | None,
                 count: Callable[[str, str, int], None] | None = None):
        """``token``: the bearer token, or a function returning the current one (a renewed token
        makes the next call say HELLO again). ``count(direction, category, nbytes)`` hears of the
        frame bytes this channel adds ("framing" and the HELLO sent, with their ``data``; "control"
        received); header and payload bytes are the caller's to count."""
        self._count = count or (lambda direction, category, n, data=None: None)
        self.host, self.port = host, port
        self.ssl_context, self.server_hostname = ssl_context, server_hostname or host
        self._token = token if callable(token) else (lambda: token)
        self.token: str | None = None  # the token of the current connection's HELLO
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        """A new connection past its HELLO. A shard that gets a burst of new connections from one
        address (a site behind one NAT address, all joining at once) ends the oldest of those still
        in their handshake (`hybridfleet.ps.wire.admission`); such a connection, closed before the
        HELLO was answered, is opened again after a short random delay, up to `CONNECT_ATTEMPTS`
        times. A refused connection or an untrusted certificate is not tried again here."""
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                return self._connect_once()
            except (ssl.SSLCertVerificationError, ConnectionRefusedError):
                raise
            except (EOFError, ConnectionError, ssl.SSLError):
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise
                time.sleep(_JITTER.uniform(0.0, 0.02 * 2 ** attempt))
        raise AssertionError("unreachable")

    def _connect_once(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = wrap(self.ssl_context, sock, server_side=False, server_hostname=self.server_hostname)
            self.token = self._token()
            hello = json.dumps({"magic": MAGIC, "wire_version": WIRE_VERSION, "token": self.token or ""}).encode()
            frame = _frame(bytes([OP_HELLO]), hello)
            sock.sendall(frame)
            self._count("sent", "control", len(frame), frame)
            status, body = _read_response(sock)
        except BaseException:
            sock.close()
            raise
        if status != "OK":
            sock.close()
            raise BulkError(_status(status), body.decode(errors="replace"))
        return sock

    def _call(self, op: int, header: bytes, payloads: list, timeout_s: float, read_body) -> Any:
        with self._lock:
            return self._call_locked(op, header, payloads, timeout_s, read_body)

    def _call_locked(self, op: int, header: bytes, payloads: list, timeout_s: float, read_body) -> Any:
        try:
            if self._sock is not None and self._token() != self.token:
                self._drop()  # the token was renewed: say HELLO with the new one
            if self._sock is None:
                self._sock = self._connect()
            sock = self._sock
            sock.settimeout(IDLE_TIMEOUT_S)  # while bytes move, a stall means a dead link or peer
            frame = _frame(bytes([op]), header)
            sock.sendall(frame)
            # the frame's header bytes are the caller's to count (a PushHeader or PullRequest)
            self._count("sent", "framing", 1 + _U32.size, frame[:1 + _U32.size])
            for p in payloads:
                sock.sendall(p)
            sock.settimeout(timeout_s)  # the shard may hold a pull until its round closes
            status_len = recv_exact(sock, 1)
            sock.settimeout(IDLE_TIMEOUT_S)
            status, body = _read_response(sock, status_len)
            self._count("received", "control", 1 + len(status) + _U32.size + len(body))
            if status != "OK":
                raise BulkError(_status(status), body.decode(errors="replace"))
            return read_body(sock, body)
        except BulkError as err:
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._drop()  # the next call says HELLO again
            raise
        except (OSError, EOFError, ssl.SSLError) as err:
            self._drop()
            raise BulkError(grpc.StatusCode.UNAVAILABLE,
                            f"bulk connection to {self.address} failed: {err or type(err).__name__}") from None

    def push(self, header: ps_pb2.PushHeader, payloads: list, timeout_s: float = FRAME_TIMEOUT_S) -> ps_pb2.PushResponse:
        """Send one push (``payloads`` in the order of ``header.keys``) and return the shard's answer;
        ``timeout_s`` is the longest wait for that answer once every byte is sent."""
        return self._call(OP_PUSH, header.SerializeToString(), payloads, timeout_s,
                          lambda sock, body: ps_pb2.PushResponse.FromString(bytes(body)))

    def heartbeat(self, request: ps_pb2.HeartbeatRequest, timeout_s: float) -> ps_pb2.HeartbeatResponse | None:
        """Send a heartbeat unless the connection is busy (a push or a waiting pull, which the shard
        counts as this worker being alive): None then."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._control(OP_HEARTBEAT, request, timeout_s, ps_pb2.HeartbeatResponse.FromString)
        finally:
            self._lock.release()

    def leave(self, request: ps_pb2.LeaveRequest, timeout_s: float) -> bool:
        """Leave the shard's quorum; False when the connection stayed busy for ``timeout_s``."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            self._control(OP_LEAVE, request, timeout_s, ps_pb2.LeaveResponse.FromString)
            return True
        finally:
            self._lock.release()

    def _control(self, op: int, request, timeout_s: float, parse):
        try:
            return self._call_locked(op, request.SerializeToString(), [], timeout_s,
                                     lambda sock, body: parse(bytes(body)))
        except BulkError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self._drop()  # a shard that does not know the call closes the connection after saying so
            raise

    def pull(self, request: ps_pb2.PullRequest, timeout_s: float,
             into: Callable[[str, int, int], memoryview | None] | None = None,
             ) -> tuple[int, list[tuple[str, int, Any, bool]]]:
        """``(version, [(key, delta_version, bytes, placed)])`` of one pull.

        ``into(key, delta_version, nbytes)`` may return a writable byte view of exactly
        ``nbytes`` to receive that item in place (``placed`` is then True); None: a new buffer.
        """
        def read(sock, body):
            try:
                meta = json.loads(body)
                version, items = int(meta["version"]), [(str(k), int(dv), int(n)) for k, dv, n in meta["items"]]
            except (ValueError, KeyError, TypeError):
                self._drop()
                raise BulkError(grpc.StatusCode.INTERNAL, "malformed pull reply from the shard") from None
            out = []
            for k, dv, n in items:
                dest = into(k, dv, n) if into is not None else None
                if dest is not None and len(dest) == n:
                    recv_exact_into(sock, dest)
                    out.append((k, dv, dest, True))
                else:
                    out.append((k, dv, recv_exact(sock, n), False))
            return version, out

        return self._call(OP_PULL, request.SerializeToString(), [], timeout_s, read)

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
