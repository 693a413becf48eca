"""`open_store(url)`: the backend registry, imported lazily with install hints."""

from __future__ import annotations

import importlib
import os
from typing import Any
from urllib.parse import urlparse

from hybridfleet.errors import HfleetError, StoreError
from hybridfleet.store.base import Store

# scheme -> ("module:Class", pip extra that provides its dependency)
STORES: dict[str, tuple[str, str]] = {
    "file": ("hybridfleet.store.file:FileStore", ""),
    "s3": ("hybridfleet.store.s3:S3Store", "s3"),
}


class StoreBackendMissingError(HfleetError, ImportError):
    """The URL's backend needs a package that is not installed (exit code and hint of `store`)."""

    kind = "store"


def _backend(scheme: str) -> type:
    if scheme not in STORES:
        raise StoreError(f"unsupported storage URL scheme {scheme!r}; supported: {sorted(STORES)}")
    target, extra = STORES[scheme]
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise StoreBackendMissingError(f"{scheme}:// storage needs {err.name}: pip install 'hybridfleet[{extra}]'") from err
    return getattr(module, class_name)


def open_store(url: str | os.PathLike[str], endpoint_url: str | None = None, **options: Any) -> Store:
    """A `Store` rooted at ``url``: ``file:///dir``, a plain path, or ``s3://bucket/prefix``.

    ``endpoint_url`` and ``options`` (e.g. ``key``, ``secret``) go to object-store
    backends. Raises StoreError for unknown schemes and StoreBackendMissingError
    (an ImportError) with the pip command when the backend's package is missing.
    """
    if isinstance(url, Store):
        return url
    text = os.fspath(url)
    if not text:
        raise StoreError("storage URL is empty")
    parsed = urlparse(text)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # plain path (or a Windows drive)
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise StoreError(f"file:// URL must be absolute, e.g. file:///data/ckpt (got {text!r})")
        return _backend("file")(parsed.path if parsed.scheme == "file" else text)
    if parsed.scheme == "s3":
        return _backend("s3")(text, endpoint_url=endpoint_url, **options)
    return _backend(parsed.scheme)(text, **options)
