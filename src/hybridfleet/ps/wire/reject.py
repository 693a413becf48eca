"""Refusals both transports answer the same way: a gRPC status code name and a reason."""

from __future__ import annotations


class Reject(Exception):
    """A request the shard refuses; ``code`` names the gRPC status (e.g. ``INVALID_ARGUMENT``)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def check_push_header(header, max_push_bytes: int) -> int:
    """The bytes a push header declares, after the checks both transports make before reading
    them: the size cap and no key declared twice. Raises Reject."""
    declared = sum(k.nbytes for k in header.keys)
    if declared > max_push_bytes:
        raise Reject("RESOURCE_EXHAUSTED", f"push of {declared} bytes exceeds the cap of {max_push_bytes} bytes")
    keys = [k.key for k in header.keys]
    if len(set(keys)) != len(keys):
        twice = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise Reject("INVALID_ARGUMENT", f"key {twice!r} appears twice in the push header")
    return declared
