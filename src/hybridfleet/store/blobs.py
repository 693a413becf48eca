"""Content-addressed blobs (``blobs/sha256/<hex>``) and verified, resumable downloads.

A blob's name is the sha256 of its bytes, so it is written once: uploading a
blob that is already present costs one existence check and no payload bytes.
`file_digests` also gives the CRC-32 that checkpoint loads check (see `hybridfleet.ckpt.manifest`).
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridfleet.errors import StoreError
from hybridfleet.obs.log import get_logger
from hybridfleet.store.base import Buffer, Reader, Store

BLOB_PREFIX = "blobs/sha256"
log = get_logger("store.blobs")
DOWNLOAD_CHUNK_BYTES = 8 << 20
_HASH_SLICE_BYTES = 64 << 20  # hashlib releases the GIL per update; slices keep memory views small
# Both digests of a slice are taken while it is still in the core's L2 cache.
_DIGESTS_SLICE_BYTES = 1 << 20

try:  # ISA-L's CRC-32 gives zlib's values at memory speed and releases the GIL like zlib does
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    _crc32 = zlib.crc32


def blob_path(sha256_hex: str) -> str:
    """The store path of the blob with this digest."""
    if len(sha256_hex) != 64 or any(c not in "0123456789abcdef" for c in sha256_hex):
        raise StoreError(f"not a lowercase sha256 hex digest: {sha256_hex!r}")
    return f"{BLOB_PREFIX}/{sha256_hex}"


def sha256_parts(parts: Iterable[Buffer]) -> tuple[str, int]:
    """(hex digest, total size in bytes) of the concatenation of ``parts``, without joining them."""
    digest = hashlib.sha256()
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for offset in range(0, view.nbytes, _HASH_SLICE_BYTES):
            digest.update(view[offset : offset + _HASH_SLICE_BYTES])
        total += view.nbytes
    return digest.hexdigest(), total


def crc32_parts(parts: Iterable[Buffer]) -> tuple[str, int]:
    """(CRC-32 as 8 hex digits, total size in bytes) of the concatenation of ``parts``.

    The CRC is zlib's (``zlib.crc32``); it catches any flipped byte, not a deliberate forgery.
    """
    crc = 0
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for offset in range(0, view.nbytes, _HASH_SLICE_BYTES):
            crc = _crc32(view[offset : offset + _HASH_SLICE_BYTES], crc)
        total += view.nbytes
    return f"{crc:08x}", total


def file_digests(parts: Iterable[Buffer]) -> tuple[str, str, int]:
    """(sha256 hex, CRC-32 hex, total size in bytes) of the concatenation of ``parts``, in one pass."""
    digest = hashlib.sha256()
    crc = 0
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for offset in range(0, view.nbytes, _DIGESTS_SLICE_BYTES):
            piece = view[offset : offset + _DIGESTS_SLICE_BYTES]
            digest.update(piece)
            crc = _crc32(piece, crc)
        total += view.nbytes
    return digest.hexdigest(), f"{crc:08x}", total


class DigestingReader:
    """A `Reader` that takes the CRC-32 and/or sha256 of the bytes passing through, slice by slice while
    each slice is still in the core's cache: copying through it reads every byte once."""

    def __init__(self, reader: Reader, crc32: bool = True, sha256: bool = False):
        self.reader = reader
        self.size_bytes = 0
        self._crc = 0 if crc32 else None
        self._sha = hashlib.sha256() if sha256 else None

    def readinto(self, view: memoryview) -> int:
        view = memoryview(view).cast("B")
        n = self.reader.readinto(view[:_DIGESTS_SLICE_BYTES])
        if n:
            piece = view[:n]
            if self._crc is not None:
                self._crc = _crc32(piece, self._crc)
            if self._sha is not None:
                self._sha.update(piece)
            self.size_bytes += n
        return n

    @property
    def crc32(self) -> str | None:
        """CRC-32 (8 hex digits) of the bytes read so far, or None when not taken."""
        return None if self._crc is None else f"{self._crc:08x}"

    @property
    def sha256(self) -> str | None:
        """sha256 hex of the bytes read so far, or None when not taken."""
        return None if self._sha is None else self._sha.hexdigest()


def copy_blob(source: Store, path: str, target: Store, sha256_hex: str, size_bytes: int, crc32_hex: str | None) -> int:
    """Copy ``path`` of ``source`` into ``target`` as blob ``sha256_hex``, reading and writing each byte once.

    The bytes are checked while they stream through: their size and CRC-32 (or, without
    ``crc32_hex``, their sha256) must match, else StoreError ("crc32 mismatch", "sha256
    mismatch", "size ... truncated") and nothing is published under the blob's path.
    Parts go up in parallel where the target streams that way (S3 multipart); where the
    target copies server-side (see `prepare_blob_copy`) no byte is written through this
    process. Returns the payload bytes the blob holds.
    """
    return prepare_blob_copy(source, path, target, sha256_hex, size_bytes, crc32_hex)()


def prepare_blob_copy(source: Store, path: str, target: Store, sha256_hex: str, size_bytes: int,
                      crc32_hex: str | None) -> Callable[[], int]:  # fmt: skip
    """The copy of `copy_blob`, in two steps: what can be checked before writing is checked now, and
    the returned call copies (returning the blob's payload bytes).

    When the target's service copies the source's files itself (`Store.can_copy_from`: S3 stores
    in one bucket), every byte is read and checked now, and the returned call has the server
    copy exactly those bytes, none written through this process: a caller that prepares all its
    files first publishes no blob when any of them is corrupt. Otherwise only the size is
    checked now and the returned call streams the bytes, checking them on the way.
    """
    where = f"{source.url}/{path}"
    stored_size = source.size(path)
    if stored_size != size_bytes:
        raise StoreError(f"{where}: size {stored_size} bytes, manifest says {size_bytes} (truncated or replaced)")

    def check(reader: DigestingReader) -> None:
        if reader.size_bytes != size_bytes:
            raise StoreError(f"{where}: read {reader.size_bytes} bytes, manifest says {size_bytes} (truncated or replaced)")
        if crc32_hex is not None and reader.crc32 != crc32_hex:
            raise StoreError(f"{where}: crc32 mismatch (corrupt file); nothing was written")
        if crc32_hex is None and reader.sha256 != sha256_hex:
            raise StoreError(f"{where}: sha256 mismatch (corrupt file); nothing was written")

    def digesting(raw: Reader) -> DigestingReader:
        return DigestingReader(raw, crc32=crc32_hex is not None, sha256=crc32_hex is None)

    if target.can_copy_from(source):
        def verify(raw: Reader) -> None:
            reader = digesting(raw)
            scratch = memoryview(bytearray(_DIGESTS_SLICE_BYTES))
            while reader.readinto(scratch):
                pass
            check(reader)

        server_copy = target.prepare_copy_from(source, path, blob_path(sha256_hex), size_bytes, verify)

        def copy_in_store() -> int:
            server_copy()
            return size_bytes

        return copy_in_store

    def stream() -> int:
        reader = digesting(source.open_reader(path))
        try:
            target.put_stream(blob_path(sha256_hex), reader, size_bytes, lambda: check(reader))
        finally:
            close = getattr(reader.reader, "close", None)
            if close is not None:
                close()
        return size_bytes

    return stream


def put_blob(store: Store, parts: list[Buffer], sha256_hex: str, crc32_hex: str | None = None) -> int:
    """Store ``parts`` as blob ``sha256_hex`` unless a sound copy is present; returns the payload bytes uploaded.

    The caller supplies the digests (computed with `file_digests`) so the parts are hashed once.
    A blob already in the store is reused only after its size and CRC-32 (or, without
    ``crc32_hex``, its sha256) match ``parts``: a flipped byte or a truncated upload is
    rewritten instead of being referenced by one more checkpoint.
    """
    path = blob_path(sha256_hex)
    size = sum(memoryview(p).nbytes for p in parts)
    if store.exists(path) and _stored_blob_matches(store, path, size, sha256_hex, crc32_hex):
        return 0
    store.put_parts(path, parts)
    # not a difference of store.bytes_written: other blobs may be uploading in parallel
    return size


def _stored_blob_matches(store: Store, path: str, size: int, sha256_hex: str, crc32_hex: str | None) -> bool:
    """True when the blob at ``path`` has ``size`` bytes and the expected CRC-32 (else sha256)."""
    try:
        if store.size(path) != size:
            stored = None
        else:
            buffer = store.read_buffer(path)
            stored = crc32_parts([buffer])[0] if crc32_hex is not None else sha256_parts([buffer])[0]
    except StoreError:
        return False  # removed between the two calls: write it
    ok = stored == (crc32_hex if crc32_hex is not None else sha256_hex)
    if not ok:
        log.warning("blob_rewritten", url=store.url, path=path, reason="stored copy does not match its digest")
    return ok


def download_verified(
    store: Store, path: str, local_path: str | os.PathLike[str], sha256_hex: str, chunk_bytes: int = DOWNLOAD_CHUNK_BYTES,
    size: int | None = None, durable: bool = True,
) -> Path:
    """Copy ``path`` from ``store`` to ``local_path`` and verify its sha256.

    Bytes go to ``<local_path>.part`` first; a later call continues a partial
    download with range reads from where it stopped. On a digest mismatch the
    partial file is removed and StoreError names the file; on success the file is
    renamed into place. ``size``: the known size (saves a request); ``durable=False``
    skips the fsync, for caches that verify what they read again anyway.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0 (got {chunk_bytes})")
    target = Path(local_path)
    partial = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    total = store.size(path) if size is None else size
    have = partial.stat().st_size if partial.exists() else 0
    if have > total:
        partial.unlink()
        have = 0
    digest = hashlib.sha256()
    with open(partial, "ab+") as f:
        f.seek(0)
        while chunk := f.read(chunk_bytes):  # re-hash what an earlier attempt fetched
            digest.update(chunk)
        # the next range is requested while this one is written and hashed (both release the GIL)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfleet-download") as pool:
            ahead = pool.submit(store.get_bytes, path, have, min(total, have + chunk_bytes)) if have < total else None
            while ahead is not None:
                chunk = ahead.result()
                if not chunk:
                    raise StoreError(f"{store.url}/{path}: download stopped at byte {have} of {total}")
                following = have + len(chunk)
                ahead = (pool.submit(store.get_bytes, path, following, min(total, following + chunk_bytes))
                         if following < total else None)
                f.write(chunk)
                digest.update(chunk)
                have = following
        f.flush()
        if durable:
            os.fsync(f.fileno())
    if digest.hexdigest() != sha256_hex:
        partial.unlink(missing_ok=True)
        raise StoreError(f"{store.url}/{path}: sha256 mismatch after download (expected {sha256_hex}, got {digest.hexdigest()})")
    os.replace(partial, target)
    return target
