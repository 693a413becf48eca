"""The worker side of the bulk data plane (framing in `hybridfleet.ps.wire.bulk`)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from typing import Any, Callable

import grpc

from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire.bulk import (
    _U32, FRAME_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, IDLE_TIMEOUT_S, MAGIC, OP_HELLO, OP_PULL, OP_PUSH,
    BulkError, _frame, _read_response, _status, recv_exact, recv_exact_into,
)
from hybridfleet.ps.wire.protocol import WIRE_VERSION
from hybridfleet.ps.wire.tls import remember_files, wrap


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
                 token: str | None, count: Callable[[str, str, int], None] | None = None):
        """``count(direction, category, nbytes)`` hears of the frame bytes this channel adds
        ("framing" sent, "control" received); payload bytes are the caller's to count."""
        self._count = count or (lambda direction, category, n: None)
        self.host, self.port = host, port
        self.ssl_context, self.server_hostname, self.token = ssl_context, server_hostname or host, token
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = wrap(self.ssl_context, sock, server_side=False, server_hostname=self.server_hostname)
            hello = json.dumps({"magic": MAGIC, "wire_version": WIRE_VERSION, "token": self.token or ""}).encode()
            sock.sendall(_frame(bytes([OP_HELLO]), hello))
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
            try:
                if self._sock is None:
                    self._sock = self._connect()
                sock = self._sock
                sock.settimeout(IDLE_TIMEOUT_S)  # while bytes move, a stall means a dead link or peer
                sock.sendall(_frame(bytes([op]), header))
                self._count("sent", "framing", 1 + _U32.size)
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
