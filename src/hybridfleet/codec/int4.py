"""4-bit quantisation with one absmax scale per chunk, two codes per byte."""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.chunks import ChunkedCodec, chunk_multiply, chunk_reduce, num_chunks
from hybridfleet.codec.frame import Frame
from hybridfleet.errors import ProtocolError

# Smaller chunks than int8's: with 15 levels one large element would zero the rest of a
# long chunk. 64 elements cost 4 scale bytes per 32 code bytes (0.5625 bytes per element);
# on bench/wan.py's local mode, 64-element chunks ended 1-2 test images (of 360) closer to
# dense than 128 or 256.
INT4_CHUNK_SIZE = 64
LEVELS = 7  # codes -7..7; the nibble 0b1000 (-8) is never written and refused on decode


class Int4Codec(ChunkedCodec):
    """Each chunk of `chunk_size` elements becomes 4-bit codes times one float32 scale.

    scale = max|x| / 7 over the chunk, code = round-half-even(x / scale) in [-7, 7], so
    every element is within scale / 2 = max|x_chunk| / 14 of its input (plus float32
    rounding); deterministic rounding, meant to run with error feedback, which carries
    the rounding error into the next push. A chunk of zeros decodes to zeros exactly.
    Wire: params (chunk_size u32), scales (float32 per chunk), codes (two's-complement
    nibbles, element 2i in the low nibble of byte i and 2i+1 in the high one; the high
    nibble after an odd last element is zero).
    """

    name = "int4"

    def __init__(self, chunk_size: int = INT4_CHUNK_SIZE):
        super().__init__(chunk_size)

    def _encode_fields(self, flat: np.ndarray) -> list:
        absmax = chunk_reduce(np.abs(flat), self.chunk_size, np.max)
        inverse = np.divide(np.float32(LEVELS), absmax, out=np.zeros_like(absmax), where=absmax > 0)
        codes = np.rint(chunk_multiply(flat, inverse, self.chunk_size))
        np.clip(codes, -LEVELS, LEVELS, out=codes)
        nibbles = codes.astype(np.int8).view(np.uint8) & np.uint8(0x0F)
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        packed = nibbles[0::2] | (nibbles[1::2] << np.uint8(4))
        return [*self._chunk_fields(absmax / np.float32(LEVELS)), packed]

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        chunk_size, scales = self._read_chunking(frame)
        if not np.isfinite(scales).all():
            raise ProtocolError("int4 payload has a NaN or Inf scale")
        if (scales < 0).any():
            raise ProtocolError("int4 payload has a negative scale")
        numel = frame.header.numel
        packed = frame.array(2, np.uint8, num_chunks(numel, 2), "codes")
        if numel % 2 and packed[-1] >> 4:
            raise ProtocolError("int4 payload has a non-zero padding nibble after the last element")
        nibbles = np.empty(2 * packed.size, dtype=np.uint8)
        nibbles[0::2] = packed & np.uint8(0x0F)
        nibbles[1::2] = packed >> np.uint8(4)
        nibbles = nibbles[:numel]
        if (nibbles == 0x08).any():
            raise ProtocolError("int4 payload has the code -8; codes lie in [-7, 7]")
        # sign-extend the nibbles: 0..7 stay, 9..15 become -7..-1
        codes = nibbles.astype(np.int8)
        codes[nibbles > 7] -= 16
        return chunk_multiply(codes, scales, chunk_size)
