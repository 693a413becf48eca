"""URL-addressed storage: local files and S3-compatible object stores behind one `Store`."""

from __future__ import annotations

from hybridfleet.store.base import Store
from hybridfleet.store.blobs import (
    BLOB_PREFIX,
    DigestingReader,
    blob_path,
    copy_blob,
    crc32_parts,
    download_verified,
    file_digests,
    prepare_blob_copy,
    put_blob,
    sha256_parts,
)
from hybridfleet.store.registry import STORES, StoreBackendMissingError, open_store

__all__ = [
    "BLOB_PREFIX",
    "STORES",
    "Store",
    "StoreBackendMissingError",
    "DigestingReader",
    "blob_path",
    "copy_blob",
    "crc32_parts",
    "download_verified",
    "file_digests",
    "open_store",
    "prepare_blob_copy",
    "put_blob",
    "sha256_parts",
]
