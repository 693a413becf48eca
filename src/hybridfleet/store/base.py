"""The `Store` interface: a flat, URL-rooted namespace of immutable-ish byte objects.

Paths are relative, '/'-separated and never contain '..'; every backend (local
files, S3, any fsspec filesystem) implements the same seven operations and passes
the same conformance tests.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Protocol, Union

from hybridfleet.errors import StoreError

Buffer = Union[bytes, bytearray, memoryview]
READ_CHUNK_BYTES = 8 << 20


class Reader(Protocol):
    """What `Store.put_stream` reads from: a binary file opened for reading, or anything with ``readinto``."""

    def readinto(self, view: memoryview) -> int: ...


class RangeReader:
    """Sequential ``readinto`` over a store file, fetched by ranged reads of ``chunk_bytes``."""

    def __init__(self, store: "Store", path: str, size_bytes: int, chunk_bytes: int = READ_CHUNK_BYTES):
        self.store, self.path, self.size_bytes, self.chunk_bytes = store, path, size_bytes, chunk_bytes
        self.position = 0  # of the next byte fetched
        self._chunk = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        if not self._chunk.nbytes and self.position < self.size_bytes:
            end = min(self.size_bytes, self.position + self.chunk_bytes)
            self._chunk = memoryview(self.store.get_bytes(self.path, self.position, end))
            self.position += self._chunk.nbytes
        count, self._chunk = serve_chunk(self._chunk, view)
        return count

    def close(self) -> None:
        self._chunk = memoryview(b"")


def serve_chunk(chunk: memoryview, view: memoryview) -> tuple[int, memoryview]:
    """Copy the start of ``chunk`` into ``view`` (``readinto``'s contract): (bytes copied, what is left)."""
    view = memoryview(view).cast("B")
    count = min(view.nbytes, chunk.nbytes)
    view[:count] = chunk[:count]
    return count, chunk[count:]


def read_exactly(reader: Reader, view: memoryview, source: str) -> None:
    """Fill ``view`` from ``reader``; StoreError naming ``source`` when the reader ends first."""
    view = memoryview(view).cast("B")
    filled = 0
    while filled < view.nbytes:
        n = reader.readinto(view[filled:])
        if not n:
            raise StoreError(f"{source}: ended after {filled} of {view.nbytes} bytes expected")
        filled += n


def clean_path(path: str) -> str:
    """``path`` normalised to 'a/b/c'; StoreError for absolute paths or '..' components."""
    if not isinstance(path, str):
        raise StoreError(f"store path must be a string (got {type(path).__name__})")
    if path.startswith("/") or "\\" in path:
        raise StoreError(f"store path must be relative with '/' separators (got {path!r})")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StoreError(f"store path must not contain '..' (got {path!r})")
    return "/".join(parts)


class Store(ABC):
    """Byte storage addressed by relative paths under one root URL.

    ``bytes_written`` / ``bytes_read`` count payload bytes moved through this
    instance, so callers can check how much an operation really uploaded;
    ``bytes_copied_in_store`` counts bytes the storage service copied itself (`copy_from`),
    which never pass through this process.
    """

    url: str = ""

    def __init__(self) -> None:
        self.bytes_written = 0
        self.bytes_read = 0
        self.bytes_copied_in_store = 0

    # -- the narrow part each backend implements -------------------------------------------
    @abstractmethod
    def _put_parts(self, path: str, parts: list[Buffer]) -> None:
        """Publish the concatenation of ``parts`` at ``path`` atomically (readers see all or nothing)."""

    @abstractmethod
    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        """Bytes [start, end) of ``path``; StoreError if it does not exist."""

    @abstractmethod
    def _exists(self, path: str) -> bool:
        """True when a file exists at ``path``."""

    @abstractmethod
    def _ls(self, prefix: str) -> list[str]:
        """Immediate children (files and folders) of ``prefix``, as root-relative paths."""

    @abstractmethod
    def _rm(self, path: str, recursive: bool) -> None:
        """Remove a file, or a folder with everything under it when ``recursive``."""

    @abstractmethod
    def _size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes; StoreError if it does not exist."""

    def _read_buffer(self, path: str) -> Buffer:
        """The whole file as a writable buffer; backends may map it instead of copying."""
        data = self._get(path, None, None)
        self.bytes_read += len(data)
        return bytearray(data)

    def _put_stream(self, path: str, reader: Reader, size_bytes: int, check: Callable[[], None]) -> None:
        """Publish ``size_bytes`` read from ``reader`` at ``path`` atomically, after ``check()`` passed.

        This default reads everything into memory first; backends override it to stream.
        """
        data = bytearray(size_bytes)
        read_exactly(reader, memoryview(data), f"{self.url}/{path}")
        check()
        self._put_parts(path, [data])

    def _open_reader(self, path: str) -> Reader:
        """A sequential reader of ``path``; backends may open the file itself instead."""
        return RangeReader(self, path, self._size(path))

    def can_copy_from(self, source: "Store") -> bool:
        """True when the service behind this store can copy ``source``'s files itself (`copy_from`)."""
        return False

    def _prepare_copy_from(self, source: "Store", source_path: str, path: str, size_bytes: int,
                           verify: Callable[[Reader], None]) -> Callable[[], None]:  # fmt: skip
        """Backends that answer `can_copy_from` with True verify here and return the server-side copy."""
        raise StoreError(f"{self.url} cannot copy files of {source.url} inside the storage service")

    # -- derived operations ---------------------------------------------------------------------
    def put_stream(self, path: str, reader: Reader, size_bytes: int, check: Callable[[], None] | None = None) -> None:
        """Write exactly ``size_bytes`` read from ``reader`` at ``path`` atomically.

        ``check`` runs after the last byte was read and before anything is published; when it
        raises (e.g. a digest of the bytes read does not match), or the reader ends early,
        nothing appears at ``path`` and the exception propagates.
        """
        path = clean_path(path)
        if not path:
            raise StoreError("cannot write to the store root; give a file path")
        if size_bytes < 0:
            raise StoreError(f"size_bytes must be >= 0 (got {size_bytes})")
        self._put_stream(path, reader, size_bytes, check or (lambda: None))
        self.bytes_written += size_bytes

    def prepare_copy_from(self, source: "Store", source_path: str, path: str, size_bytes: int,
                          verify: Callable[[Reader], None]) -> Callable[[], None]:  # fmt: skip
        """Verify ``source_path`` of ``source`` now; return the call that copies it to ``path`` inside the
        storage service (where `can_copy_from`).

        ``verify`` gets a reader of the source's ``size_bytes`` bytes; it reads them once and raises
        when they are not the expected ones (then nothing is written, and it propagates). The
        returned call copies exactly the bytes ``verify`` read (the object stays pinned); a source
        that changed meanwhile is a StoreError and nothing appears at ``path``. No byte is written
        through this process; the copy counts in ``bytes_copied_in_store``.
        """
        path = clean_path(path)
        if not path:
            raise StoreError("cannot write to the store root; give a file path")
        if not self.can_copy_from(source):
            raise StoreError(f"{self.url} cannot copy files of {source.url} inside the storage service")
        copy = self._prepare_copy_from(source, clean_path(source_path), path, size_bytes, verify)

        def copy_and_count() -> None:
            copy()
            self.bytes_copied_in_store += size_bytes

        return copy_and_count

    def copy_from(self, source: "Store", source_path: str, path: str, size_bytes: int,
                  verify: Callable[[Reader], None]) -> None:  # fmt: skip
        """`prepare_copy_from` and the copy at once."""
        self.prepare_copy_from(source, source_path, path, size_bytes, verify)()

    def open_reader(self, path: str) -> Reader:
        """A sequential binary reader (``readinto``, ``close``) of ``path``; StoreError if it does not exist."""
        return self._open_reader(clean_path(path))

    def put_bytes(self, path: str, data: Buffer) -> None:
        """Write ``data`` at ``path`` atomically, replacing any previous file."""
        self.put_parts(path, [data])

    def put_parts(self, path: str, parts: Iterable[Buffer]) -> None:
        """Write the concatenation of ``parts`` at ``path`` atomically, without joining them in memory."""
        path = clean_path(path)
        if not path:
            raise StoreError("cannot write to the store root; give a file path")
        parts = list(parts)
        self._put_parts(path, parts)
        self.bytes_written += sum(memoryview(p).nbytes for p in parts)

    def get_bytes(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``path`` (or the range [start, end)); StoreError if missing."""
        if start is not None and start < 0 or end is not None and end < 0:
            raise StoreError(f"byte range must be non-negative (got start={start}, end={end})")
        data = self._get(clean_path(path), start, end)
        self.bytes_read += len(data)
        return data

    def read_buffer(self, path: str) -> Buffer:
        """The whole file as a writable buffer (a private memory map where the backend allows)."""
        return self._read_buffer(clean_path(path))

    def exists(self, path: str) -> bool:
        """True when a file exists at ``path``."""
        return self._exists(clean_path(path))

    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes; StoreError if it does not exist."""
        return self._size(clean_path(path))

    def ls(self, prefix: str = "") -> list[str]:
        """Sorted immediate children of ``prefix`` (root-relative paths); [] when it does not exist."""
        return sorted(self._ls(clean_path(prefix)))

    def rm(self, path: str, recursive: bool = False) -> None:
        """Remove ``path`` (a folder only with ``recursive=True``); missing paths are ignored."""
        path = clean_path(path)
        if not path:
            raise StoreError("refusing to remove the store root")
        self._rm(path, recursive)

    def join(self, *parts: str) -> str:
        """Join relative path parts with '/'."""
        return clean_path(posixpath.join(*parts))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
