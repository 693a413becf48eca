"""int8 quantisation with one absmax scale per chunk."""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.chunks import ChunkedCodec, chunk_multiply, chunk_reduce
from hybridfleet.codec.frame import Frame


class Int8Codec(ChunkedCodec):
    """Each chunk of `chunk_size` elements becomes int8 codes times one float32 scale.

    scale = max|x| / 127 over the chunk, code = round-half-even(x / scale), so
    every element is within scale / 2 = max|x_chunk| / 254 of its input (plus
    float32 rounding). A chunk of zeros decodes to zeros exactly.
    Wire: params (chunk_size u32), scales (float32 per chunk), codes (int8 per element).
    """

    name = "int8"

    def _encode_fields(self, flat: np.ndarray) -> list:
        absmax = chunk_reduce(np.abs(flat), self.chunk_size, np.max)
        inverse = np.divide(np.float32(127), absmax, out=np.zeros_like(absmax), where=absmax > 0)
        codes = np.rint(chunk_multiply(flat, inverse, self.chunk_size))
        np.clip(codes, -127, 127, out=codes)
        return [*self._chunk_fields(absmax / np.float32(127)), codes.astype(np.int8)]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        chunk_size, scales = self._read_chunking(frame)
        codes = frame.array(2, np.int8, frame.header.numel, "codes")
        return chunk_multiply(codes, scales, chunk_size)
