"""Local-disk store with atomic publish (temp file + fsync + rename + directory fsync)."""

from __future__ import annotations

import mmap
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hybridfleet.errors import StoreError
from hybridfleet.store.base import Buffer, Reader, Store, read_exactly

# Files at least this large are written with O_DIRECT through a page-aligned staging
# buffer: the disk reads straight from it (no page-cache copy), which leaves the CPU
# to the checkpoint's sha256 hashing and gets close to the disk's raw bandwidth.
DIRECT_MIN_BYTES = 16 << 20
DIRECT_ALIGN_BYTES = 4096
DIRECT_STAGE_BYTES = 8 << 20


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _write_direct(path: Path, parts: list[Buffer], total_bytes: int) -> bool:
    """Write ``parts`` to a new file at ``path`` with O_DIRECT; False if the filesystem refuses it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    try:
        stage = mmap.mmap(-1, DIRECT_STAGE_BYTES)  # anonymous maps are page-aligned
        staged = np.frombuffer(stage, dtype=np.uint8)
        filled = 0
        for part in parts:
            src = np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8)
            offset = 0
            while offset < src.size:
                n = min(src.size - offset, DIRECT_STAGE_BYTES - filled)
                staged[filled : filled + n] = src[offset : offset + n]
                filled += n
                offset += n
                if filled == DIRECT_STAGE_BYTES:
                    _write_all(fd, stage)
                    filled = 0
        if filled:
            padded = -(-filled // DIRECT_ALIGN_BYTES) * DIRECT_ALIGN_BYTES
            staged[filled:padded] = 0
            _write_all(fd, memoryview(stage)[:padded])
        os.ftruncate(fd, total_bytes)  # drop the alignment padding
        os.fsync(fd)
    except OSError as err:
        os.close(fd)
        path.unlink(missing_ok=True)
        if err.errno == 22:  # EINVAL: O_DIRECT accepted at open but not for these writes
            return False
        raise
    os.close(fd)
    return True


def _stream_direct(path: Path, reader: Reader, size_bytes: int, source: str) -> bool:
    """Write ``size_bytes`` from ``reader`` to a new file at ``path`` with O_DIRECT, double-buffered: the
    disk writes one staging buffer while the reader fills the other. False (nothing read) if O_DIRECT is refused."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    stages = [mmap.mmap(-1, DIRECT_STAGE_BYTES), mmap.mmap(-1, DIRECT_STAGE_BYTES)]  # page-aligned
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="hfleet-direct-write") as disk:
            pending = None
            done = 0
            while done < size_bytes:
                stage = memoryview(stages[0])
                n = min(DIRECT_STAGE_BYTES, size_bytes - done)
                read_exactly(reader, stage[:n], source)
                done += n
                padded = -(-n // DIRECT_ALIGN_BYTES) * DIRECT_ALIGN_BYTES
                stage[n:padded] = bytes(padded - n)
                if pending is not None:
                    pending.result()
                pending = disk.submit(_write_all, fd, stage[:padded])
                stages.reverse()
            if pending is not None:
                pending.result()
        os.ftruncate(fd, size_bytes)  # drop the alignment padding
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return True


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
        total_bytes = sum(memoryview(p).nbytes for p in parts)
        if total_bytes >= DIRECT_MIN_BYTES and _write_direct(tmp, parts, total_bytes):
            self._publish(tmp, target)
            return
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
        self._publish(tmp, target)

    def _put_stream(self, path: str, reader: Reader, size_bytes: int, check: Callable[[], None]) -> None:
        if size_bytes < DIRECT_MIN_BYTES:
            super()._put_stream(path, reader, size_bytes, check)
            return
        target = self._full(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        source = f"stream for {self.url}/{path}"
        try:
            if not _stream_direct(tmp, reader, size_bytes, source):
                with open(tmp, "xb") as f:
                    stage = memoryview(bytearray(DIRECT_STAGE_BYTES))
                    for start in range(0, size_bytes, DIRECT_STAGE_BYTES):
                        n = min(DIRECT_STAGE_BYTES, size_bytes - start)
                        read_exactly(reader, stage[:n], source)
                        f.write(stage[:n])
            check()
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._publish(tmp, target)

    def _open_reader(self, path: str) -> Reader:
        try:
            return open(self._full(path), "rb", buffering=0)
        except (FileNotFoundError, IsADirectoryError) as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err

    @staticmethod
    def _publish(tmp: Path, target: Path) -> None:
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

    def _read_buffer(self, path: str) -> Buffer:
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

    def _exists(self, path: str) -> bool:
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

    def _size(self, path: str) -> int:
        try:
            return self._full(path).stat().st_size
        except FileNotFoundError as err:
            raise StoreError(f"{self.url}/{path}: no such file") from err
