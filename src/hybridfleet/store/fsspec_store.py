"""A store over any fsspec filesystem (the base of the S3 store)."""

from __future__ import annotations

from typing import Any

from hybridfleet.errors import StoreError
from hybridfleet.store.base import Buffer, Store


class FsspecStore(Store):
    """Files under ``root`` of an fsspec filesystem ``fs``; ``url`` is for messages."""

    def __init__(self, fs: Any, root: str, url: str):
        super().__init__()
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _relative(self, full: str) -> str:
        return full.rstrip("/")[len(self.root) + 1 :]

    def _put_parts(self, path: str, parts: list[Buffer]) -> None:
        # Object stores publish on close (single PUT or completed multipart upload).
        try:
            with self.fs.open(self._full(path), "wb") as f:
                for part in parts:
                    f.write(memoryview(part).cast("B"))
        except OSError as err:
            raise StoreError(f"{self.url}/{path}: write failed: {err}") from err

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        try:
            return self.fs.cat_file(self._full(path), start=start, end=end)
        except FileNotFoundError as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err

    def _exists(self, path: str) -> bool:
        try:
            return self.fs.isfile(self._full(path))
        except FileNotFoundError:
            return False

    def _ls(self, prefix: str) -> list[str]:
        try:
            entries = self.fs.ls(self._full(prefix), detail=False)
        except FileNotFoundError:
            return []
        full_prefix = self._full(prefix).rstrip("/")
        return [self._relative(e) for e in entries if e.rstrip("/") != full_prefix]

    def _rm(self, path: str, recursive: bool) -> None:
        full = self._full(path)
        try:
            if self.fs.isdir(full):
                if not recursive:
                    raise StoreError(f"{self.url}/{path} is a folder; pass recursive=True to remove it")
                self.fs.rm(full, recursive=True)
            else:
                self.fs.rm_file(full)
        except FileNotFoundError:
            pass

    def _size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._full(path)))
        except FileNotFoundError as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err
