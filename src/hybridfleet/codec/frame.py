"""The one wire framing shared by every gradient codec.

A frame is a small little-endian header followed by the codec's fields::

    offset  size        meaning
    0       2           magic b"HG"
    2       1           FORMAT_VERSION
    3       1           codec id (CODEC_IDS)
    4       1           dtype code of the original tensor (float16=1, float32=2, float64=3)
    5       1           ndim (0..MAX_NDIM)
    6       4 * ndim    shape, uint32 each
    .       1           number of fields
    .       8 * nfields byte length of each field, uint64 each
    .       ...         the fields, back to back

Everything a decoder needs travels in the frame (k, chunk size, index coding),
so a server decodes with a codec built from the name alone. `unpack_frame`
checks every byte count against the header before any array is built and
raises `ProtocolError` naming what is wrong; nothing is trusted from the peer.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from hybridfleet.errors import ProtocolError

MAGIC = b"HG"
FORMAT_VERSION = 1
MAX_NDIM = 32
# One frame carries one block; blocks are a few MiB, so 2**32 - 1 elements
# (16 GiB of float32) is far above any real block and keeps indices in uint32.
MAX_NUMEL = 2**32 - 1

# Wire ids, fixed forever: a new codec takes a new id, an id is never reused.
CODEC_IDS: dict[str, int] = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "topk": 4, "randomk": 5, "sign": 6,
                           "int4": 7, "powersgd": 8, "rows": 9}
_NAMES_BY_ID = {code: name for name, code in CODEC_IDS.items()}

DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype("float16"): 1,
    np.dtype("float32"): 2,
    np.dtype("float64"): 3,
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

_FIXED = struct.Struct("<2sBBBB")


@dataclass(frozen=True)
class FrameHeader:
    """What a frame says about the tensor inside it, readable without decoding."""

    codec_id: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def codec_name(self) -> str | None:
        """The name of the codec that wrote the frame (None for an unknown id)."""
        return _NAMES_BY_ID.get(self.codec_id)


@dataclass(frozen=True)
class Frame:
    """A parsed frame: its header and a zero-copy view of each field."""

    header: FrameHeader
    fields: tuple[memoryview, ...]
    codec_name: str

    def array(self, index: int, dtype: str | np.dtype, count: int, what: str) -> np.ndarray:
        """Field `index` as a read-only array of exactly `count` items of `dtype`."""
        field = self.fields[index]
        itemsize = np.dtype(dtype).itemsize
        if len(field) != count * itemsize:
            raise ProtocolError(
                f"{self.codec_name} payload: {what} field holds {len(field)} bytes, "
                f"expected {count * itemsize} ({count} x {np.dtype(dtype).name})"
            )
        return np.frombuffer(field, dtype=dtype, count=count)

    def params(self, index: int, layout: struct.Struct, what: str) -> tuple:
        """Field `index` unpacked with `layout` (its size must match exactly)."""
        field = self.fields[index]
        if len(field) != layout.size:
            raise ProtocolError(
                f"{self.codec_name} payload: {what} field holds {len(field)} bytes, expected {layout.size}"
            )
        return layout.unpack(field)


def check_numel(shape: tuple[int, ...]) -> int:
    """The element count of `shape`; ValueError when a frame cannot carry it."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor has {len(shape)} dimensions; a codec frame carries at most {MAX_NDIM}")
    numel = math.prod(shape)
    if numel > MAX_NUMEL or any(dim > MAX_NUMEL for dim in shape):
        raise ValueError(
            f"tensor of shape {shape} has {numel} elements; a codec frame carries at most "
            f"{MAX_NUMEL}: split it into blocks"
        )
    return numel


def _header(codec_name: str, dtype: np.dtype, shape: tuple[int, ...], lengths: list[int]) -> bytes:
    return b"".join(
        (
            _FIXED.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[codec_name], DTYPE_CODES[np.dtype(dtype)], len(shape)),
            struct.pack(f"<{len(shape)}I", *shape),
            struct.pack("<B", len(lengths)),
            struct.pack(f"<{len(lengths)}Q", *lengths),
        )
    )


def _raw(fields: list) -> list[memoryview]:
    return [memoryview(f if isinstance(f, (bytes, bytearray)) else np.ascontiguousarray(f)).cast("B") for f in fields]


def pack_frame(codec_name: str, dtype: np.dtype, shape: tuple[int, ...], fields: list) -> bytearray:
    """One frame holding `fields` (bytes or arrays, written as their raw little-endian bytes).

    Each field is copied once, straight into the frame.
    """
    raw = _raw(fields)
    header = _header(codec_name, dtype, shape, [len(r) for r in raw])
    out = bytearray(len(header) + sum(len(r) for r in raw))
    view = memoryview(out)
    view[: len(header)] = header
    pos = len(header)
    for r in raw:
        view[pos : pos + len(r)] = r
        pos += len(r)
    return out


class FrameParts:
    """One frame as the pieces a sender writes in order, never joined: the header, then each
    field's own memory (a contiguous array's bytes are not copied). ``len()`` is the frame's size
    and ``bytes()`` the very frame `pack_frame` makes of the same fields. The pieces share the
    fields' memory: the frame holds what the arrays hold when it is sent."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: list):
        self.parts = tuple(parts)
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def pack_frame_parts(codec_name: str, dtype: np.dtype, shape: tuple[int, ...], fields: list) -> FrameParts:
    """The frame `pack_frame` makes, as `FrameParts`: a contiguous array field is sent from its own memory."""
    raw = _raw(fields)
    return FrameParts([_header(codec_name, dtype, shape, [len(r) for r in raw]), *raw])


def frame_pieces(payload) -> tuple:
    """The buffers to send, in order, for ``payload`` (bytes-like, or `FrameParts`)."""
    return payload.parts if isinstance(payload, FrameParts) else (payload,)


def read_header(payload: bytes, codec_name: str = "codec") -> tuple[FrameHeader, int]:
    """Parse and validate the tensor header; returns it and the offset of the field table.

    A server may call this to check shape and dtype against the parameter
    before decoding anything.
    """
    view = memoryview(payload)
    if len(view) < _FIXED.size:
        raise ProtocolError(f"{codec_name} payload truncated: {len(view)} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, codec_id, dtype_code, ndim = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise ProtocolError(f"{codec_name} payload does not start with the frame magic {MAGIC!r} (got {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ProtocolError(f"{codec_name} payload has frame version {version}; this side speaks version {FORMAT_VERSION}")
    if dtype_code not in _DTYPES_BY_CODE:
        raise ProtocolError(f"{codec_name} payload has unknown dtype code {dtype_code} (known: {sorted(_DTYPES_BY_CODE)})")
    if ndim > MAX_NDIM:
        raise ProtocolError(f"{codec_name} payload has ndim {ndim}; at most {MAX_NDIM} is allowed")
    offset = _FIXED.size
    if len(view) < offset + 4 * ndim:
        raise ProtocolError(f"{codec_name} payload truncated inside the shape ({len(view)} bytes)")
    shape = struct.unpack_from(f"<{ndim}I", view, offset)
    offset += 4 * ndim
    header = FrameHeader(codec_id=codec_id, dtype=_DTYPES_BY_CODE[dtype_code], shape=tuple(shape))
    if header.numel > MAX_NUMEL:
        raise ProtocolError(f"{codec_name} payload shape {header.shape} has {header.numel} elements; at most {MAX_NUMEL} is allowed")
    return header, offset


def unpack_frame(payload: bytes, codec_name: str, num_fields: int) -> Frame:
    """Parse `payload`, checking it was written by codec `codec_name` with `num_fields` fields.

    Raises ProtocolError on any inconsistency.
    """
    codec_id = CODEC_IDS[codec_name]
    header, offset = read_header(payload, codec_name)
    if header.codec_id != codec_id:
        sender = _NAMES_BY_ID.get(header.codec_id)
        said = f"codec {sender!r} (id {header.codec_id})" if sender else f"unknown codec id {header.codec_id}"
        raise ProtocolError(f"payload was encoded by {said}, but this decoder is {codec_name!r} (id {codec_id})")
    view = memoryview(payload)
    if len(view) < offset + 1:
        raise ProtocolError(f"{codec_name} payload truncated before the field count ({len(view)} bytes)")
    (count,) = struct.unpack_from("<B", view, offset)
    offset += 1
    if count != num_fields:
        raise ProtocolError(f"{codec_name} payload has {count} fields, expected {num_fields}")
    if len(view) < offset + 8 * count:
        raise ProtocolError(f"{codec_name} payload truncated inside the field table ({len(view)} bytes)")
    lengths = struct.unpack_from(f"<{count}Q", view, offset)
    offset += 8 * count
    expected_bytes = offset + sum(lengths)
    if len(view) != expected_bytes:
        state = "truncated" if len(view) < expected_bytes else "has trailing bytes"
        raise ProtocolError(f"{codec_name} payload {state}: {len(view)} bytes, the header announces {expected_bytes}")
    fields = []
    for length in lengths:
        fields.append(view[offset : offset + length])
        offset += length
    return Frame(header=header, fields=tuple(fields), codec_name=codec_name)
