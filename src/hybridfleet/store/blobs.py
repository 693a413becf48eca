"""Content-addressed blobs (``blobs/sha256/<hex>``) and verified, resumable downloads.

A blob's name is the sha256 of its bytes, so it is written once: uploading a
blob that is already present costs one existence check and no payload bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from hybridfleet.errors import StoreError
from hybridfleet.store.base import Buffer, Store

BLOB_PREFIX = "blobs/sha256"
DOWNLOAD_CHUNK_BYTES = 8 << 20
_HASH_SLICE_BYTES = 64 << 20  # hashlib releases the GIL per update; slices keep memory views small


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


def put_blob(store: Store, parts: list[Buffer], sha256_hex: str) -> int:
    """Store ``parts`` as blob ``sha256_hex`` unless present; returns the payload bytes uploaded (0 if skipped).

    The caller supplies the digest (computed with `sha256_parts`) so it is hashed once.
    """
    path = blob_path(sha256_hex)
    if store.exists(path):
        return 0
    before = store.bytes_written
    store.put_parts(path, parts)
    return store.bytes_written - before


def download_verified(
    store: Store, path: str, local_path: str | os.PathLike[str], sha256_hex: str, chunk_bytes: int = DOWNLOAD_CHUNK_BYTES
) -> Path:
    """Copy ``path`` from ``store`` to ``local_path`` and verify its sha256.

    Bytes go to ``<local_path>.part`` first; a later call continues a partial
    download with range reads from where it stopped. On a digest mismatch the
    partial file is removed and StoreError names the file; on success the file is
    renamed into place.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0 (got {chunk_bytes})")
    target = Path(local_path)
    partial = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    total = store.size(path)
    have = partial.stat().st_size if partial.exists() else 0
    if have > total:
        partial.unlink()
        have = 0
    digest = hashlib.sha256()
    with open(partial, "ab+") as f:
        f.seek(0)
        while chunk := f.read(chunk_bytes):  # re-hash what an earlier attempt fetched
            digest.update(chunk)
        while have < total:
            chunk = store.get_bytes(path, have, min(total, have + chunk_bytes))
            if not chunk:
                raise StoreError(f"{store.url}/{path}: download stopped at byte {have} of {total}")
            f.write(chunk)
            digest.update(chunk)
            have += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    if digest.hexdigest() != sha256_hex:
        partial.unlink(missing_ok=True)
        raise StoreError(f"{store.url}/{path}: sha256 mismatch after download (expected {sha256_hex}, got {digest.hexdigest()})")
    os.replace(partial, target)
    return target
