"""Wire constants and chunking shared by the shard server and the client."""

from __future__ import annotations

from collections.abc import Iterator

WIRE_VERSION = 1
SERVICE = "hybridfleet.ps.v1.ParameterServer"

# 1 MiB chunks: well under gRPC's 4 MiB default message cap, large enough that
# per-message overhead is small (streamed 1 MiB chunks reach ~1 GB/s on loopback).
CHUNK_BYTES = 1 << 20

# gRPC channel/server options: allow a little more than one chunk per message.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
    ("grpc.so_reuseport", 0),
]

WORKER_METHODS = ("Join", "Pull", "Push", "Heartbeat", "Leave", "Status")
# Only a worker's token may act as a worker (and then only as its own worker id, see
# hybridfleet.ps.server.identity); admins and monitors read Status.
METHOD_ROLES: dict[str, set[str]] = {f"/{SERVICE}/{m}": {"worker"} for m in WORKER_METHODS}
METHOD_ROLES[f"/{SERVICE}/Status"] = {"worker", "admin", "monitor"}
# Secure aggregation (hybridfleet.ps.secagg): workers only, each as its own worker id.
SECAGG_SERVICE = "hybridfleet.ps.v1.SecureAggregation"
METHOD_ROLES.update({f"/{SECAGG_SERVICE}/{m}": {"worker"} for m in ("Advertise", "Roster", "Shares", "Unmask", "Reveal")})


def iter_chunks(key: str, payload: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(offset, piece)`` covering ``payload`` in order; an empty payload yields one empty piece."""
    view = memoryview(payload).cast("B")
    if len(view) == 0:
        yield 0, view
        return
    for offset in range(0, len(view), chunk_bytes):
        yield offset, view[offset : offset + chunk_bytes]
