"""Masks: AES-256-CTR keystreams viewed as ring elements (multi-GB/s with AES-NI)."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_NONCE = bytes(16)  # every key masks one vector only (fresh per round, shard and pair)


def prg(seed: bytes, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` uniformly random elements of ``dtype`` expanded from the 32-byte ``seed``."""
    if len(seed) != 32:
        raise ValueError(f"a mask seed is 32 bytes (got {len(seed)})")
    dtype = np.dtype(dtype)
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()
    return np.frombuffer(encryptor.update(bytes(count * dtype.itemsize)), dtype=dtype)  # read-only view


def add_mask(acc: np.ndarray, seed: bytes, sign: int = 1) -> None:
    """``acc += sign * prg(seed)`` in the ring (in place; unsigned arithmetic wraps)."""
    mask = prg(seed, acc.size, acc.dtype)
    if sign > 0:
        np.add(acc, mask, out=acc)
    else:
        np.subtract(acc, mask, out=acc)
