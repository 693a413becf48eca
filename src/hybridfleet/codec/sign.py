"""1-bit sign compression with one mean-magnitude scale per chunk (EF-signSGD style)."""

from __future__ import annotations

import struct

import numpy as np

from hybridfleet.codec.base import Codec
from hybridfleet.codec.chunks import DEFAULT_CHUNK_SIZE, check_chunk_size, chunk_multiply, chunk_reduce, num_chunks
from hybridfleet.codec.frame import Frame
from hybridfleet.errors import ProtocolError

_PARAMS = struct.Struct("<I")  # chunk_size


class SignCodec(Codec):
    """Each element becomes its sign bit; each chunk keeps scale = mean |x| over the chunk.

    Decoding gives +scale or -scale per element (zero counts as positive), as in
    EF-signSGD (Karimireddy et al., 2019); it is meant to run with error feedback.
    Wire: params (chunk_size u32), scales (float32 per chunk), sign bits
    (np.packbits, little bit order, 1 = negative, padding bits zero).
    """

    name = "sign"
    num_fields = 3

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE):
        self.chunk_size = check_chunk_size(chunk_size, self.name)

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size}

    def _encode_fields(self, flat: np.ndarray) -> list:
        scales = chunk_reduce(np.abs(flat), self.chunk_size, np.mean).astype("<f4")
        bits = np.packbits(flat < 0, bitorder="little")
        return [_PARAMS.pack(self.chunk_size), scales, bits]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        (chunk_size,) = frame.params(0, _PARAMS, "params")
        if chunk_size < 1:
            raise ProtocolError(f"sign payload has chunk_size {chunk_size}; it must be >= 1")
        numel = frame.header.numel
        scales = frame.array(1, "<f4", num_chunks(numel, chunk_size), "scales")
        if (scales < 0).any():
            raise ProtocolError("sign payload has a negative scale")
        packed = frame.array(2, np.uint8, num_chunks(numel, 8), "sign bits")
        if numel % 8 and packed[-1] >> (numel % 8):
            raise ProtocolError("sign payload has non-zero padding bits after the last element")
        negative = np.unpackbits(packed, count=numel, bitorder="little")
        signs = np.float32(1) - np.float32(2) * negative.astype(np.float32)
        return chunk_multiply(signs, scales, chunk_size)
