"""Wire coding of sorted, distinct element indices for the sparse codecs.

Two codings:

- ``int32``: one little-endian uint32 per index (4 bytes each).
- ``delta``: LEB128 varints of the gaps: the first index, then for each next
  index (index - previous - 1). At 1 % density gaps are ~100, so most indices
  cost one byte.

Both carry the indices in strictly increasing order, so a decoder can check
distinctness and range with one pass, and `smaller_coding` picks whichever is
shorter for a given set.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.errors import ProtocolError

INT32 = 0
DELTA = 1
CODING_IDS = {"int32": INT32, "delta": DELTA}
# Indices are < 2**32, so a gap needs at most 5 varint bytes.
_MAX_VARINT_BYTES = 5


def _gaps(indices: np.ndarray) -> np.ndarray:
    gaps = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        gaps[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= 1
    return gaps


def _varint_lengths(gaps: np.ndarray) -> np.ndarray:
    lengths = np.ones(gaps.size, dtype=np.int64)
    for extra in range(1, _MAX_VARINT_BYTES):
        lengths += gaps >= (1 << (7 * extra))
    return lengths


def delta_nbytes(indices: np.ndarray) -> int:
    """How many bytes the delta coding of sorted `indices` takes."""
    return int(_varint_lengths(_gaps(indices)).sum())


def smaller_coding(indices: np.ndarray) -> int:
    """INT32 or DELTA, whichever encodes sorted `indices` in fewer bytes (DELTA on a tie)."""
    return DELTA if delta_nbytes(indices) <= 4 * indices.size else INT32


def encode_indices(indices: np.ndarray, coding: int) -> np.ndarray:
    """The wire bytes (uint8 array) of sorted, distinct `indices` below 2**32."""
    if coding == INT32:
        return indices.astype("<u4").view(np.uint8)
    gaps = _gaps(indices)
    lengths = _varint_lengths(gaps)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = np.empty(int(ends[-1]) if ends.size else 0, dtype=np.uint8)
    for byte in range(int(lengths.max()) if lengths.size else 0):
        chosen = lengths > byte if byte else slice(None)
        seven_bits = (gaps[chosen] >> np.uint64(7 * byte)) & np.uint64(0x7F)
        more = (lengths[chosen] > byte + 1).astype(np.uint64) << np.uint64(7)
        out[starts[chosen] + byte] = seven_bits | more
    return out


def decode_indices(data: np.ndarray, coding: int, count: int, numel: int, codec_name: str) -> np.ndarray:
    """`count` int64 indices from wire bytes `data` (uint8); ProtocolError unless each is
    distinct, increasing and below `numel`."""
    if coding == INT32:
        if data.size != 4 * count:
            raise ProtocolError(f"{codec_name} payload: indices field holds {data.size} bytes, expected {4 * count} ({count} x uint32)")
        indices = data.view("<u4").astype(np.int64)
        if count > 1 and not (np.diff(indices) > 0).all():
            raise ProtocolError(f"{codec_name} payload: indices are not strictly increasing")
    elif coding == DELTA:
        indices = _decode_varint_gaps(data, count, numel, codec_name)
    else:
        raise ProtocolError(f"{codec_name} payload has unknown index coding {coding} (known: {sorted(CODING_IDS.values())})")
    if count and indices[-1] >= numel:
        raise ProtocolError(f"{codec_name} payload: index {int(indices[-1])} is out of range for {numel} elements")
    return indices


def _decode_varint_gaps(data: np.ndarray, count: int, numel: int, codec_name: str) -> np.ndarray:
    if data.size == 0:
        if count:
            raise ProtocolError(f"{codec_name} payload: indices field is empty but {count} values are announced")
        return np.empty(0, dtype=np.int64)
    last_bytes = np.flatnonzero((data & 0x80) == 0)
    if data[-1] & 0x80:
        raise ProtocolError(f"{codec_name} payload: indices field ends inside a varint")
    if last_bytes.size != count:
        raise ProtocolError(f"{codec_name} payload: indices field holds {last_bytes.size} varints, expected {count}")
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = last_bytes[:-1] + 1
    lengths = last_bytes - starts + 1
    if lengths.max() > _MAX_VARINT_BYTES:
        raise ProtocolError(f"{codec_name} payload: a varint in the indices field is longer than {_MAX_VARINT_BYTES} bytes")
    position = np.arange(data.size, dtype=np.int64) - np.repeat(starts, lengths)
    parts = (data & 0x7F).astype(np.uint64) << (np.uint64(7) * position.astype(np.uint64))
    gaps = np.add.reduceat(parts, starts)
    if gaps.max() >= numel:
        raise ProtocolError(f"{codec_name} payload: index gap {int(gaps.max())} is out of range for {numel} elements")
    # gaps < numel < 2**32 and count <= numel keep the running sum far below 2**64.
    return (np.cumsum(gaps) + np.arange(count, dtype=np.uint64)).astype(np.int64)
