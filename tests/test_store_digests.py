"""File digests for blobs and checkpoint manifests: sha256 and CRC-32 over multi-part buffers."""

from __future__ import annotations

import hashlib
import os
import zlib

import numpy as np

from hybridfleet.store import crc32_parts, file_digests, sha256_parts


def test_file_digests_match_hashlib_and_zlib_across_slice_boundaries():
    # Prepare: parts of odd sizes, one larger than the 1 MiB slice the digests are taken in
    parts = [os.urandom(3), np.arange(700_000, dtype=np.float32), memoryview(os.urandom(1_500_001)), b""]
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)

    sha, crc, size = file_digests(parts)

    assert sha == hashlib.sha256(joined).hexdigest() == sha256_parts(parts)[0]
    assert crc == f"{zlib.crc32(joined):08x}"
    assert crc32_parts(parts) == (crc, size) and size == len(joined)


def test_crc32_changes_for_any_single_flipped_byte():
    data = bytearray(os.urandom(4096))
    crc, _ = crc32_parts([data])

    for index in range(0, len(data), 97):
        data[index] ^= 0x01
        assert crc32_parts([data])[0] != crc, index
        data[index] ^= 0x01
