"""Allocator settings for processes that move block-sized arrays every round (shards and workers)."""

from __future__ import annotations


def tune_allocator(trim_bytes: int = 1 << 30) -> bool:
    """Keep freed multi-MiB blocks in glibc's heap instead of returning them to the OS.

    A shard allocates and frees block-sized arrays every round (received pushes, decoded
    gradients, optimizer results); with glibc's defaults each of them is a fresh mmap whose
    pages fault in again, which costs about as much as copying the bytes. Raising the mmap
    threshold to its maximum (32 MiB, above the default 4 MiB block size) and the trim
    threshold (up to ``trim_bytes`` of free heap is kept) lets rounds reuse warm memory.
    Workers call it too, with a smaller ``trim_bytes``. Returns False where glibc is not in use.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's, where glibc is the libc
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, int(trim_bytes)))
