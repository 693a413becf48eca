"""The bulk data plane: Push and Pull bodies as raw bytes on one TLS socket per worker and shard.

gRPC in Python moves about 0.5 GB/s through a shard here, a tenth of what one TCP
stream does on the same loopback: every message crosses the Python/C boundary and
the HTTP/2 and TLS layers copy each chunk several times. Tensor bytes therefore go
over a plain socket (TLS from the same certificates, the same bearer tokens, the
same validation), while Join, Heartbeat, Leave and Status stay on gRPC, which also
remains the fallback: a shard advertises its bulk port in ``JoinResponse.bulk_port``
and a client uses it when it can (``ps.transport: grpc`` switches it off).

Frames (integers little-endian)::

    request   op:u8  header_len:u32  header  [payload bytes]
    response  status_len:u8  status  body_len:u32  body  [payload bytes]

The first request on a connection is ``HELLO`` with a JSON header
``{"magic": "hybridfleet-bulk", "wire_version": N, "token": "..."}``. ``PUSH``
carries a serialized ``PushHeader`` followed by each declared key's bytes in header
order; the reply body is a serialized ``PushResponse``. ``PULL`` carries a serialized
``PullRequest``; the reply body is JSON ``{"version": V, "items": [[key,
delta_version, nbytes], ...]}`` followed by the items' bytes in that order. ``status``
is ``OK`` or a gRPC status code name with the reason as body, exactly what the gRPC
path would answer. The token is checked again on every request, so an expiring token
stops working mid-connection. After an error that leaves unread bytes on the socket
(a header that cannot be parsed, a push over the size cap) the shard closes the
connection; nothing was applied.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import threading
from typing import Any, Callable

import grpc
import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.ps._proto import ps_pb2
from hybridfleet.ps.shard import Reject, check_push_header
from hybridfleet.ps.wire import METHOD_ROLES, SERVICE, WIRE_VERSION

log = get_logger("ps.bulk")

MAGIC = "hybridfleet-bulk"
OP_HELLO, OP_PUSH, OP_PULL = 1, 2, 3
_OPS = {OP_HELLO: "Hello", OP_PUSH: "Push", OP_PULL: "Pull"}
MAX_HEADER_BYTES = 16 << 20
HANDSHAKE_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 120.0  # the shard drops a connection whose started frame stalls this long
IDLE_TIMEOUT_S = 30.0  # a worker gives up on a transfer that moves no byte for this long, then reconnects
_U32 = struct.Struct("<I")


class BulkError(grpc.RpcError):
    """A bulk-plane call failed; ``code()`` and ``details()`` read like a gRPC error's."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _reject(code: str, message: str, close: bool = False):
    """A `Reject` that, with ``close``, also ends the connection (unread bytes may follow it)."""
    rej = Reject(code, message)
    rej.close = close
    return rej


# ------------------------------------------------------------------ socket helpers
def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOFError when the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int) -> np.ndarray:
    """``n`` bytes from ``sock`` as a fresh uint8 array (not zero-filled first, unlike a bytearray)."""
    buf = np.empty(n, dtype=np.uint8)
    recv_exact_into(sock, memoryview(buf))
    return buf


def _discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes."""
    buf = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        k = sock.recv_into(buf, min(n, len(buf)))
        if not k:
            raise EOFError("connection closed while discarding a refused push")
        n -= k


def _frame(status_or_op: bytes, body: bytes) -> bytes:
    return status_or_op + _U32.pack(len(body)) + body


def _response(status: str, body: bytes = b"") -> bytes:
    name = status.encode()
    return _frame(bytes([len(name)]) + name, body)


def _read_response(sock: socket.socket, status_len: np.ndarray | None = None) -> tuple[str, bytes]:
    """(status, body) of one response; ``status_len``: its first byte, when already read."""
    n = int((status_len if status_len is not None else recv_exact(sock, 1))[0])
    status = recv_exact(sock, n).tobytes().decode("ascii", "replace")
    size = _U32.unpack(recv_exact(sock, 4))[0]
    if size > MAX_HEADER_BYTES:
        raise EOFError(f"response body of {size} bytes exceeds {MAX_HEADER_BYTES}")
    return status, recv_exact(sock, size).tobytes()


# -------------------------------------------------------------------------- server
class BulkServer:
    """Serves the bulk plane of one shard: a listening socket and one thread per connection.

    ``push(header, payloads, claims)`` and ``pull(request)`` do the work (see
    `hybridfleet.ps.server.ShardServicer`) and raise `hybridfleet.ps.shard.Reject`;
    ``verify(token, roles)`` returns the claims or raises (None: no auth, explicit).
    """

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext | None,
                 verify: Callable[[str | None, set[str]], Any] | None, max_push_bytes: int,
                 push: Callable, pull: Callable):
        self.ssl_context, self.verify, self.max_push_bytes = ssl_context, verify, max_push_bytes
        self._push, self._pull = push, pull
        self._listener = socket.create_server((host, port), backlog=64)
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
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
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
    return ctx


def client_ssl_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a worker's bulk connections: trusts ``ca``; shows ``cert`` when the shard wants mutual TLS."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


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
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname)
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


def _status(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
