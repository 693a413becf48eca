"""Masks: AES-256-CTR keystreams viewed as ring elements (several GB/s with AES-NI).

The keystream is written chunk by chunk into one reused buffer per thread
(`update_into`), so masking a vector allocates nothing: allocating fresh pages costs
more than the AES itself.
"""

from __future__ import annotations

import threading

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_NONCE = bytes(16)  # every key masks one vector only (fresh per round, shard and pair)
_CHUNK = 1 << 22
_local = threading.local()


def _scratch() -> tuple[memoryview, bytearray]:
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = (memoryview(bytes(_CHUNK)), bytearray(_CHUNK + 15))  # +15: update_into's slack
    return buffers


def add_mask(acc: np.ndarray, seed: bytes, sign: int = 1) -> None:
    """``acc += sign * PRG(seed)`` in the ring of ``acc``'s unsigned dtype (in place; unsigned arithmetic wraps)."""
    if len(seed) != 32:
        raise ValueError(f"a mask seed is 32 bytes (got {len(seed)})")
    zeros, out = _scratch()
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()
    flat = acc.reshape(-1)
    step = _CHUNK // flat.itemsize
    op = np.add if sign > 0 else np.subtract
    for start in range(0, flat.size, step):
        part = flat[start:start + step]
        encryptor.update_into(zeros[:part.nbytes], out)
        op(part, np.frombuffer(out, dtype=flat.dtype, count=part.size), out=part)


def prg(seed: bytes, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` uniformly random elements of ``dtype`` expanded from the 32-byte ``seed``."""
    out = np.zeros(count, dtype=np.dtype(dtype))
    add_mask(out, seed)
    return out
