"""int8 quantisation with one absmax scale per chunk."""

from __future__ import annotations

import struct

import numpy as np

from hybridfleet.codec.base import Codec
from hybridfleet.codec.chunks import DEFAULT_CHUNK_SIZE, check_chunk_size, chunk_multiply, chunk_reduce, num_chunks
from hybridfleet.codec.frame import Frame
from hybridfleet.errors import ProtocolError

_PARAMS = struct.Struct("<I")  # chunk_size


class Int8Codec(Codec):
    """Each chunk of `chunk_size` elements becomes int8 codes times one float32 scale.

    scale = max|x| / 127 over the chunk, code = round-half-even(x / scale), so
    every element is within scale / 2 = max|x_chunk| / 254 of its input (plus
    float32 rounding). A chunk of zeros decodes to zeros exactly.
    Wire: params (chunk_size u32), scales (float32 per chunk), codes (int8 per element).
    """

    name = "int8"
    num_fields = 3

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE):
        self.chunk_size = check_chunk_size(chunk_size, self.name)

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size}

    def _encode_fields(self, flat: np.ndarray) -> list:
        absmax = chunk_reduce(np.abs(flat), self.chunk_size, np.max) if flat.size else np.empty(0, np.float32)
        inverse = np.divide(np.float32(127), absmax, out=np.zeros_like(absmax), where=absmax > 0)
        codes = np.rint(chunk_multiply(flat, inverse, self.chunk_size))
        np.clip(codes, -127, 127, out=codes)
        scales = (absmax / np.float32(127)).astype("<f4")
        return [_PARAMS.pack(self.chunk_size), scales, codes.astype(np.int8)]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        (chunk_size,) = frame.params(0, _PARAMS, "params")
        if chunk_size < 1:
            raise ProtocolError(f"int8 payload has chunk_size {chunk_size}; it must be >= 1")
        numel = frame.header.numel
        scales = frame.array(1, "<f4", num_chunks(numel, chunk_size), "scales")
        codes = frame.array(2, np.int8, numel, "codes")
        if numel == 0:
            return np.empty(0, np.float32)
        return chunk_multiply(codes, scales, chunk_size)
