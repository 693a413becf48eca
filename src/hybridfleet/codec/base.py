"""The narrow codec interface every gradient codec derives from.

A codec turns one gradient block into bytes and back. Implementations write
only `_encode_fields` / `_decode_fields` (and `_decode_sparse_fields` when
they sparsify); input checks, the wire framing (`frame.py`), dtype and shape
restoration and the checks on what comes off the wire live here, once.

Dtype policy: float16, float32 and float64 inputs are accepted and `decode`
returns the input's dtype and shape. `none` carries the raw bytes (exact for
all three); every lossy codec computes in float32, so float64 input is first
rounded to float32. Any other dtype is a TypeError; NaN or Inf is a
ValueError (a non-finite gradient would poison error-feedback residuals).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import numpy as np

from hybridfleet.codec.frame import DTYPE_CODES, Frame, check_numel, pack_frame, unpack_frame
from hybridfleet.errors import ProtocolError

SUPPORTED_DTYPES = tuple(DTYPE_CODES)
# Elements checked at a time by `all_finite`: its boolean scratch is this many bytes, whatever the array
FINITE_CHUNK = 1 << 20


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of ``x`` is finite: ``np.isfinite(x).all()`` without its boolean array of
    ``x.size`` bytes (a quarter of a float32 tensor), checked `FINITE_CHUNK` elements at a time
    into one reused scratch and stopping at the first piece that holds NaN or Inf."""
    if x.size <= FINITE_CHUNK or not x.flags.c_contiguous:
        return bool(np.isfinite(x).all())
    flat = x.reshape(-1)
    scratch = np.empty(FINITE_CHUNK, dtype=bool)
    for start in range(0, flat.size, FINITE_CHUNK):
        piece = flat[start:start + FINITE_CHUNK]
        found = scratch[:piece.size]
        np.isfinite(piece, out=found)
        if not found.all():
            return False
    return True


class SparseTensor(NamedTuple):
    """A decoded update as coordinates: `dense.flat[indices] = values`.

    `indices` are int64, strictly increasing, all below prod(shape); `values`
    have the original dtype.
    """

    indices: np.ndarray
    values: np.ndarray
    shape: tuple[int, ...]


class Codec(ABC):
    """Encode a gradient block to bytes and decode it back.

    `decode(encode(x))` has x's shape and dtype; how close the values are is
    each codec's documented bound. Codecs hold no per-tensor state (error
    feedback lives in `ErrorFeedback`), so one instance may serve many keys.
    """

    name: ClassVar[str]
    # True when a payload carries only some coordinates (decode_sparse is cheap).
    sparse: ClassVar[bool] = False
    num_fields: ClassVar[int]

    def options(self) -> dict[str, Any]:
        """The constructor options; `get_codec(self.name, **self.options())` rebuilds this codec."""
        return {}

    def encode(self, x: np.ndarray) -> bytes:
        """One self-describing frame holding `x` (any layout; views are fine)."""
        array = check_gradient(x, self.name)
        shape = tuple(array.shape)
        check_numel(shape)
        with np.errstate(over="ignore"):  # overflow is reported just below
            flat = np.ascontiguousarray(array, dtype=self._work_dtype(array.dtype)).reshape(-1)
        if flat.dtype.itemsize < array.dtype.itemsize and not all_finite(flat):
            raise ValueError(f"codec {self.name!r} computes in {flat.dtype}; the gradient holds values beyond its range")
        return pack_frame(self.name, array.dtype, shape, self._encode_fields(flat))

    def encode_parts(self, x: np.ndarray):
        """The frame of `encode` as a sender may write it: bytes here; a codec whose field is the
        input's own bytes (``none``) returns `FrameParts` sharing ``x``'s memory instead of a copy
        (then ``x`` must not change until the frame is sent)."""
        return self.encode(x)

    def decode(self, payload: bytes, expected_numel: int | None = None, *, view: bool = False) -> np.ndarray:
        """The dense tensor in `payload`, with its original shape and dtype (a new, writable array;
        with ``view`` it may instead share `payload`'s memory, writable only if `payload` is, so a
        caller that owns the payload decodes a raw frame without copying it).

        Raises ProtocolError if the payload is malformed or not this codec's, or, with
        `expected_numel`, when its shape holds another number of elements: checked before
        any array is built, so a frame cannot make the decoder allocate beyond what the
        caller expects.
        """
        frame = _expect(unpack_frame(payload, self.name, self.num_fields), expected_numel)
        flat = self._decode_fields(frame).astype(frame.header.dtype, copy=False)
        if not view and np.may_share_memory(flat, np.frombuffer(payload, np.uint8)):
            flat = flat.copy()
        return _finite(flat, self.name).reshape(frame.header.shape)

    def decode_sparse(self, payload: bytes, expected_numel: int | None = None) -> SparseTensor:
        """The update in `payload` as (indices, values, shape), without densifying sparse codecs.

        Dense codecs return every index. Raises ProtocolError like `decode`.
        """
        frame = _expect(unpack_frame(payload, self.name, self.num_fields), expected_numel)
        indices, values = self._decode_sparse_fields(frame)
        values = _finite(values.astype(frame.header.dtype, copy=False), self.name)
        return SparseTensor(indices=indices, values=values, shape=frame.header.shape)

    def _work_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype `_encode_fields` receives and `_decode_fields` returns."""
        return np.dtype(np.float32)

    @abstractmethod
    def _encode_fields(self, flat: np.ndarray) -> list:
        """The frame fields (bytes or arrays) for a contiguous 1-D array in the work dtype."""

    @abstractmethod
    def _decode_fields(self, frame: Frame) -> np.ndarray:
        """The flat dense values of `frame` (validated; ProtocolError otherwise)."""

    def _decode_sparse_fields(self, frame: Frame) -> tuple[np.ndarray, np.ndarray]:
        flat = self._decode_fields(frame)
        return np.arange(flat.size, dtype=np.int64), flat

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({args})"


def check_gradient(x: Any, codec_name: str) -> np.ndarray:
    """`x` as an array if a codec can encode it; TypeError (not an array, unsupported
    dtype) or ValueError (NaN or Inf) naming the codec otherwise."""
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"codec {codec_name!r} encodes numpy arrays (got {type(x).__name__})")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"codec {codec_name!r} encodes {names} arrays (got {x.dtype})")
    if not all_finite(x):
        raise ValueError(f"codec {codec_name!r} cannot encode a gradient holding NaN or Inf (shape {x.shape})")
    return x


def _expect(frame: Frame, expected_numel: int | None) -> Frame:
    if expected_numel is not None and frame.header.numel != expected_numel:
        raise ProtocolError(f"{frame.codec_name} payload shape {frame.header.shape} has {frame.header.numel} "
                            f"elements, expected {expected_numel}")
    return frame


def _finite(values: np.ndarray, codec_name: str) -> np.ndarray:
    if not all_finite(values):
        raise ProtocolError(f"{codec_name} payload decodes to NaN or Inf values")
    return values
