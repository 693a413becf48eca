"""Allocator settings for processes that move block-sized arrays every round (shards and workers)."""

from __future__ import annotations

# glibc heaps ("arenas") a shard's threads share. By default glibc gives threads up to 8 per
# core, and each keeps the free memory of its threads' transient buffers (TLS records, frames)
# at its own high-water mark; with the trim threshold raised below, a shard's free heap then
# grew by about 300 KiB per connected worker (bench/shard_memory.py, docs/SCALE.md). Two arenas
# keep that flat; the shard's heavy work runs under the interpreter lock, so they are not contended.
SHARD_MALLOC_ARENAS = 2


def tune_allocator(trim_bytes: int = 1 << 30, arenas: int | None = None) -> bool:
    """Keep freed multi-MiB blocks in glibc's heap instead of returning them to the OS.

    A shard allocates and frees block-sized arrays every round (received pushes, decoded
    gradients, optimizer results); with glibc's defaults each of them is a fresh mmap whose
    pages fault in again, which costs about as much as copying the bytes. Raising the mmap
    threshold to its maximum (32 MiB, above the default 4 MiB block size) and the trim
    threshold (up to ``trim_bytes`` of free heap is kept) lets rounds reuse warm memory.
    Larger blocks stay mmaps; the bulk plane keeps their receive buffers itself
    (`hybridfleet.ps.server.recv_buffers`).
    Workers call it too, with a smaller ``trim_bytes``. ``arenas``: at most this many glibc
    arenas for the process's threads (shards pass `SHARD_MALLOC_ARENAS`; call it before the
    threads start). Returns False where glibc is not in use.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's, where glibc is the libc
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    ok = bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, int(trim_bytes)))
    if arenas is not None:
        ok = bool(mallopt(m_arena_max, int(arenas))) and ok
    return ok
