"""Codecs that keep every element and change only its width: none, fp16, bf16."""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.base import Codec, check_gradient
from hybridfleet.codec.frame import Frame, FrameParts, check_numel, pack_frame_parts

FP16_MAX = float(np.finfo(np.float16).max)
_BF16_MAX_MAGNITUDE = 0x7F7F  # largest finite bfloat16, sign bit cleared


class NoneCodec(Codec):
    """The raw little-endian bytes of the input dtype: decoding is exact."""

    name = "none"
    num_fields = 1

    def _work_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype

    def _encode_fields(self, flat: np.ndarray) -> list:
        return [flat.astype(flat.dtype.newbyteorder("<"), copy=False)]

    def encode_parts(self, x: np.ndarray) -> FrameParts | bytes:
        """`encode`'s frame with the values sent from ``x``'s own memory when ``x`` is contiguous and
        little-endian (a gradient's bytes are not copied into a frame); otherwise `encode`'s bytes."""
        array = check_gradient(x, self.name)
        if not array.flags.c_contiguous or array.dtype != array.dtype.newbyteorder("<"):
            return self.encode(array)
        shape = tuple(array.shape)
        check_numel(shape)
        return pack_frame_parts(self.name, array.dtype, shape, [array.reshape(-1)])

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        dtype = frame.header.dtype.newbyteorder("<")
        return frame.array(0, dtype, frame.header.numel, "values").astype(frame.header.dtype, copy=False)


class Fp16Codec(Codec):
    """IEEE half precision, round to nearest even.

    Relative error <= 2**-11 for |x| >= 2**-14; below that (subnormals) the
    absolute error is <= 2**-25. Values beyond +-65504 saturate to +-65504
    rather than becoming Inf (error feedback carries the excess forward).
    """

    name = "fp16"
    num_fields = 1

    def _encode_fields(self, flat: np.ndarray) -> list:
        return [np.clip(flat, -FP16_MAX, FP16_MAX).astype("<f2")]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        return frame.array(0, "<f2", frame.header.numel, "values").astype(np.float32)


class Bf16Codec(Codec):
    """bfloat16: the top 16 bits of float32, rounded to nearest even.

    Relative error <= 2**-8 for normal float32 values; float32's range is kept
    (values that would round up to Inf saturate to the largest finite bfloat16).
    """

    name = "bf16"
    num_fields = 1

    def _encode_fields(self, flat: np.ndarray) -> list:
        bits = flat.view(np.uint32)
        # Round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate.
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        sign = rounded & 0x8000
        magnitude = np.minimum(rounded & 0x7FFF, _BF16_MAX_MAGNITUDE)
        return [(sign | magnitude).astype("<u2")]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        halves = frame.array(0, "<u2", frame.header.numel, "values")
        return (halves.astype(np.uint32) << 16).view(np.float32)
