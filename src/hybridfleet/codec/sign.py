"""1-bit sign compression with one mean-magnitude scale per chunk (EF-signSGD style)."""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.chunks import ChunkedCodec, chunk_multiply, chunk_reduce, num_chunks
from hybridfleet.codec.frame import Frame
from hybridfleet.errors import ProtocolError


class SignCodec(ChunkedCodec):
    """Each element becomes its sign bit; each chunk keeps scale = mean |x| over the chunk.

    Decoding gives +scale or -scale per element (zero counts as positive), as in
    EF-signSGD (Karimireddy et al., 2019); it is meant to run with error feedback.
    Wire: params (chunk_size u32), scales (float32 per chunk), sign bits
    (np.packbits, little bit order, 1 = negative, padding bits zero).
    """

    name = "sign"

    def _encode_fields(self, flat: np.ndarray) -> list:
        scales = chunk_reduce(np.abs(flat), self.chunk_size, np.mean)
        return [*self._chunk_fields(scales), np.packbits(flat < 0, bitorder="little")]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        chunk_size, scales = self._read_chunking(frame)
        if (scales < 0).any():
            raise ProtocolError("sign payload has a negative scale")
        numel = frame.header.numel
        packed = frame.array(2, np.uint8, num_chunks(numel, 8), "sign bits")
        if numel % 8 and packed[-1] >> (numel % 8):
            raise ProtocolError("sign payload has non-zero padding bits after the last element")
        negative = np.unpackbits(packed, count=numel, bitorder="little")
        signs = np.float32(1) - np.float32(2) * negative.astype(np.float32)
        return chunk_multiply(signs, scales, chunk_size)
