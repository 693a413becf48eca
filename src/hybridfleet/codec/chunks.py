"""Per-chunk reductions and scalings over a flat array, vectorised.

int8 and sign both keep one float32 scale per run of `chunk_size` elements
(the last run may be shorter); these helpers avoid padding copies by handling
the whole chunks as a 2-D view and the tail apart.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

DEFAULT_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 2**32 - 1


def check_chunk_size(chunk_size: int, codec_name: str) -> int:
    """`chunk_size` if it is an int in [1, 2**32 - 1]; ValueError naming the codec otherwise."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"{codec_name}: chunk_size must be an integer in [1, {MAX_CHUNK_SIZE}] (got {chunk_size!r})")
    return int(chunk_size)


def num_chunks(numel: int, chunk_size: int) -> int:
    """How many chunks `numel` elements make (the last one may be partial)."""
    return -(-numel // chunk_size)


def _split(flat: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    whole = flat.size // chunk_size * chunk_size
    return flat[:whole].reshape(-1, chunk_size), flat[whole:]


def chunk_reduce(flat: np.ndarray, chunk_size: int, reduce: Callable[..., np.ndarray]) -> np.ndarray:
    """`reduce(chunk)` for every chunk of `flat`, as a float32 array of num_chunks values."""
    head, tail = _split(flat, chunk_size)
    parts = [reduce(head, axis=1)]
    if tail.size:
        parts.append(np.atleast_1d(reduce(tail, axis=0)))
    return np.concatenate(parts).astype(np.float32, copy=False)


def chunk_multiply(flat: np.ndarray, per_chunk: np.ndarray, chunk_size: int) -> np.ndarray:
    """A new float32 array: each element of `flat` times its chunk's entry of `per_chunk`."""
    out = np.empty(flat.size, dtype=np.float32)
    head, tail = _split(flat, chunk_size)
    whole_chunks = head.shape[0]
    np.multiply(head, per_chunk[:whole_chunks, None], out=out[: head.size].reshape(head.shape))
    if tail.size:
        np.multiply(tail, per_chunk[whole_chunks], out=out[head.size :])
    return out
