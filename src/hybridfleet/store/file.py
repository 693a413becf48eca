"""Local-disk store with atomic publish (temp file + fsync + rename + directory fsync)."""

from __future__ import annotations

import mmap
import os
import shutil
import uuid
from pathlib import Path

from hybridfleet.errors import StoreError
from hybridfleet.store.base import Buffer, Store


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


class FileStore(Store):
    """Files under a local root directory (``file:///abs/dir`` or a plain path)."""

    def __init__(self, root: str | os.PathLike[str]):
        super().__init__()
        self.root = Path(root).expanduser().resolve()
        self.url = f"file://{self.root}"

    def _full(self, path: str) -> Path:
        return self.root / path if path else self.root

    def _put_parts(self, path: str, parts: list[Buffer]) -> None:
        target = self._full(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                _write_all(fd, part)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        try:
            with open(self._full(path), "rb") as f:
                f.seek(start or 0)
                if end is None:
                    return f.read()
                return f.read(max(0, end - (start or 0)))
        except (FileNotFoundError, IsADirectoryError) as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err

    def read_buffer(self, path: str) -> Buffer:
        # A private copy-on-write map: zero-copy, writable, never written back.
        full = self._full(path)
        try:
            with open(full, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return bytearray()
                buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except (FileNotFoundError, IsADirectoryError) as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err
        self.bytes_read += size
        return buf

    def exists(self, path: str) -> bool:
        return self._full(path).is_file()

    def _ls(self, prefix: str) -> list[str]:
        folder = self._full(prefix)
        if not folder.is_dir():
            return []
        return [f"{prefix}/{e.name}" if prefix else e.name for e in os.scandir(folder) if ".tmp-" not in e.name]

    def _rm(self, path: str, recursive: bool) -> None:
        full = self._full(path)
        if full.is_dir():
            if not recursive:
                raise StoreError(f"{self.url}/{path} is a folder; pass recursive=True to remove it")
            shutil.rmtree(full)
        else:
            full.unlink(missing_ok=True)

    def size(self, path: str) -> int:
        try:
            return self._full(path).stat().st_size
        except FileNotFoundError as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err
