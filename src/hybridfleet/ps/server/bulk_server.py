"""The shard side of the bulk data plane (framing in `hybridfleet.ps.wire.bulk`)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
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
from hybridfleet.ps.wire.reject import Reject, check_push_header
from hybridfleet.ps.wire.tls import remember_files, wrap

log = get_logger("ps.bulk")


class BulkServer:
    """Serves the bulk plane of one shard: a listening socket and one thread per connection.

    ``push(header, payloads, claims)`` and ``pull(request)`` do the work (see
    `hybridfleet.ps.server.service.ShardServicer`) and raise `hybridfleet.ps.wire.reject.Reject`;
    ``verify(token, roles)`` returns the claims or raises (None: no auth, explicit).
    """

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 verify: Callable[[str | None, set[str]], Any] | None, max_push_bytes: int,
                 push: Callable, pull: Callable):
        self.ssl_context, self.verify, self.max_push_bytes = ssl_context, verify, max_push_bytes
        self._push, self._pull = push, pull
        try:
            self._listener = socket.create_server((host, port), backlog=64)
        except OSError as err:
            raise PortInUseError(f"cannot serve the bulk data plane on {host}:{port}: {err.strerror}") from err
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ps-bulk-accept", daemon=True)

    def start(self) -> "BulkServer":
        self._thread.start()
        log.info("bulk_serving", port=self.port, tls=self.ssl_context is not None)
        return self

    def stop(self) -> None:
        self._stopped.set()
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
            threading.Thread(target=self._serve, args=(conn, peer), name="ps-bulk-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                conn = wrap(self.ssl_context, conn, server_side=True)
            with self._lock:
                self._conns.add(conn)
            token = self._hello(conn, who)
            if token is None:
                return
            while not self._stopped.is_set():
                conn.settimeout(None)  # a worker may stay idle between steps
                first = conn.recv(1)
                if not first:
                    return
                conn.settimeout(FRAME_TIMEOUT_S)
                if not self._request(conn, first[0], token, who):
                    return
        except (OSError, EOFError, ssl.SSLError) as err:
            if not self._stopped.is_set():
                log.info("bulk_connection_closed", peer=who, reason=str(err) or type(err).__name__)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket, who: str) -> str | None:
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
        try:
            self._claims(token, "Hello")
        except Reject as rej:
            log.warning("bulk_rejected", peer=who, code=rej.code, reason=rej.message)
            conn.sendall(_response(rej.code, rej.message.encode()))
            return None
        conn.sendall(_response("OK"))
        return token

    def _claims(self, token: str, method: str):
        if self.verify is None:
            return None
        from hybridfleet.security.tokens import TokenRejectedError

        roles = METHOD_ROLES[f"/{SERVICE}/{'Push' if method == 'Hello' else method}"]
        try:
            return self.verify(token or None, roles)
        except TokenRejectedError as err:
            raise _reject("PERMISSION_DENIED" if err.reason == "role" else "UNAUTHENTICATED", str(err)) from None

    def _request(self, conn: socket.socket, op: int, token: str, who: str) -> bool:
        """Serve one request; False when the connection must close."""
        size = _U32.unpack(recv_exact(conn, 4))[0]
        try:
            if op not in (OP_PUSH, OP_PULL):
                raise _reject("INVALID_ARGUMENT", f"unknown bulk operation {op}", close=True)
            if size > MAX_HEADER_BYTES:
                raise _reject("INVALID_ARGUMENT", f"header of {size} bytes exceeds {MAX_HEADER_BYTES}", close=True)
            header = bytes(recv_exact(conn, size))
            if op == OP_PUSH:
                self._serve_push(conn, header, token)
            else:
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

    def _serve_push(self, conn: socket.socket, header_bytes: bytes, token: str) -> None:
        try:
            header = ps_pb2.PushHeader.FromString(header_bytes)
        except Exception:  # protobuf raises DecodeError (and others) on garbage
            raise _reject("INVALID_ARGUMENT", "malformed push header", close=True) from None
        declared = sum(k.nbytes for k in header.keys)
        try:
            claims = self._claims(token, "Push")
            check_push_header(header, self.max_push_bytes)
        except Reject:
            _discard(conn, declared)  # the sender is already streaming them: keep the connection in step
            raise
        payloads: dict[str, np.ndarray] = {}
        for k in header.keys:  # read every declared byte before judging the push: the stream stays in step
            payloads[k.key] = recv_exact(conn, k.nbytes)
        reply = self._push(header, payloads, claims)
        conn.sendall(_response("OK", reply.SerializeToString()))

    def _serve_pull(self, conn: socket.socket, header_bytes: bytes, token: str) -> None:
        try:
            request = ps_pb2.PullRequest.FromString(header_bytes)
        except Exception:
            raise _reject("INVALID_ARGUMENT", "malformed pull request", close=True) from None
        self._claims(token, "Pull")  # the token may have expired since HELLO
        version, items = self._pull(request)
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
