"""The bulk data plane's framing: Push and Pull bodies as raw bytes on one TLS socket per worker and shard.

gRPC in Python moves about 0.5 GB/s through a shard here, a tenth of what one TCP
stream does on the same loopback: every message crosses the Python/C boundary and
the HTTP/2 and TLS layers copy each chunk several times. Tensor bytes therefore go
over a plain socket (TLS from the same certificates, the same bearer tokens, the
same validation). Join and Status stay on gRPC, which also remains the fallback: a
shard advertises its bulk port in ``JoinResponse.bulk_port`` and a client uses it when
it can (``ps.transport: grpc`` switches it off). Once a worker's bulk connection is up,
its Heartbeat and Leave go there too, so its gRPC channel falls idle and closes
(`IDLE_CHANNEL_MS`): a shard then holds one connection per worker, not two.

Frames (integers little-endian)::

    request   op:u8  header_len:u32  header  [payload bytes]
    response  status_len:u8  status  body_len:u32  body  [payload bytes]

The first request on a connection is ``HELLO`` with a JSON header
``{"magic": "hybridfleet-bulk", "wire_version": N, "token": "..."}``. ``PUSH``
carries a serialized ``PushHeader`` followed by each declared key's bytes in header
order; the reply body is a serialized ``PushResponse``. ``PULL`` carries a serialized
``PullRequest``; the reply body is JSON ``{"version": V, "items": [[key,
delta_version, nbytes], ...]}`` followed by the items' bytes in that order.
``HEARTBEAT`` and ``LEAVE`` carry a serialized ``HeartbeatRequest`` / ``LeaveRequest``
and are answered with the serialized response, as on gRPC. A worker whose connection
is busy with a push or a waiting pull sends no heartbeat on it: the shard counts a
push being received, and a pull parked on a connection that is still open, as the
worker being alive (`hybridfleet.ps.server.bulk_server.BulkServer.busy_workers`). ``status``
is ``OK`` or a gRPC status code name with the reason as body, exactly what the gRPC
path would answer. The token is checked again on every request, so an expiring token
stops working mid-connection. After an error that leaves unread bytes on the socket
(a header that cannot be parsed, a push over the size cap) the shard closes the
connection; nothing was applied.

The shard side is `hybridfleet.ps.server.bulk_server`, the worker side
`hybridfleet.ps.worker.bulk_channel`.
"""

from __future__ import annotations

import socket
import struct

import grpc
import numpy as np

from hybridfleet.ps.wire.reject import Reject

MAGIC = "hybridfleet-bulk"
OP_HELLO, OP_PUSH, OP_PULL, OP_HEARTBEAT, OP_LEAVE = 1, 2, 3, 4, 5
_OPS = {OP_HELLO: "Hello", OP_PUSH: "Push", OP_PULL: "Pull", OP_HEARTBEAT: "Heartbeat", OP_LEAVE: "Leave"}
MAX_HEADER_BYTES = 16 << 20
HANDSHAKE_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 120.0  # the shard drops a connection whose started frame stalls this long
IDLE_TIMEOUT_S = 30.0  # a worker gives up on a transfer that moves no byte for this long, then reconnects
# A worker's gRPC channel closes its connection after this long without a call while its control
# calls go by the bulk plane (a later Join or Status opens it again). A channel that carries the
# heartbeats (ps.transport: grpc, a shard without a bulk plane) keeps its connection.
IDLE_CHANNEL_MS = 5_000
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
    whole_frame = getattr(sock, "recv_exact_into", None)
    if whole_frame is not None:  # a native TLS connection (hybridfleet.ps.wire.tls) reads it in one call
        whole_frame(view)
        return
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


def _status(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
