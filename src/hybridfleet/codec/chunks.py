"""Per-chunk scales: the base of int8, int4 and sign, and vectorised chunk helpers.

int8 and sign both keep one float32 scale per run of `chunk_size` elements
(the last run may be shorter). Their payloads start with the same two fields,
params (chunk_size u32) and scales (float32 per chunk), then their own codes.
The helpers avoid padding copies by handling the whole chunks as a 2-D view
and the tail apart.
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np

from hybridfleet.codec.base import Codec
from hybridfleet.codec.frame import Frame
from hybridfleet.errors import ProtocolError

DEFAULT_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 2**32 - 1


def check_chunk_size(chunk_size: int, codec_name: str) -> int:
    """`chunk_size` if it is an int in [1, 2**32 - 1]; ValueError naming the codec otherwise."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"{codec_name}: chunk_size must be an integer in [1, {MAX_CHUNK_SIZE}] (got {chunk_size!r})")
    return int(chunk_size)


def num_chunks(numel: int, chunk_size: int) -> int:
    """How many chunks `numel` elements make (the last one may be partial)."""
    return -(-numel // chunk_size)


def _split(flat: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    whole = flat.size // chunk_size * chunk_size
    return flat[:whole].reshape(-1, chunk_size), flat[whole:]


def chunk_reduce(flat: np.ndarray, chunk_size: int, reduce: Callable[..., np.ndarray]) -> np.ndarray:
    """`reduce(chunk)` for every chunk of `flat`, as a float32 array of num_chunks values."""
    head, tail = _split(flat, chunk_size)
    parts = [reduce(head, axis=1)]
    if tail.size:
        parts.append(np.atleast_1d(reduce(tail, axis=0)))
    return np.concatenate(parts).astype(np.float32, copy=False)


def chunk_multiply(flat: np.ndarray, per_chunk: np.ndarray, chunk_size: int) -> np.ndarray:
    """A new float32 array: each element of `flat` times its chunk's entry of `per_chunk`."""
    out = np.empty(flat.size, dtype=np.float32)
    head, tail = _split(flat, chunk_size)
    whole_chunks = head.shape[0]
    with np.errstate(over="ignore"):  # a peer's huge scale overflows to Inf; decoders refuse non-finite results
        np.multiply(head, per_chunk[:whole_chunks, None], out=out[: head.size].reshape(head.shape))
        if tail.size:
            np.multiply(tail, per_chunk[whole_chunks], out=out[head.size :])
    return out


_PARAMS = struct.Struct("<I")  # chunk_size


class ChunkedCodec(Codec):
    """A codec with one float32 scale per chunk; subclasses add the per-element codes."""

    num_fields = 3

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE):
        self.chunk_size = check_chunk_size(chunk_size, self.name)

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size}

    def _chunk_fields(self, scales: np.ndarray) -> list:
        """The params and scales fields that start every payload of this codec."""
        return [_PARAMS.pack(self.chunk_size), scales.astype("<f4", copy=False)]

    def _read_chunking(self, frame: Frame) -> tuple[int, np.ndarray]:
        """(chunk_size, scales) of a payload, validated against its element count."""
        (chunk_size,) = frame.params(0, _PARAMS, "params")
        if chunk_size < 1:
            raise ProtocolError(f"{self.name} payload has chunk_size {chunk_size}; it must be >= 1")
        return chunk_size, frame.array(1, "<f4", num_chunks(frame.header.numel, chunk_size), "scales")
