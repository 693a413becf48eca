"""Server-side copies between S3 stores in one bucket: CopyObject, or UploadPartCopy beyond its limit.

The source object is pinned by the ETag its HEAD reports: the verification read asks for
every range with ``If-Match`` and the copy with ``x-amz-copy-source-if-match``, so the bytes
copied are exactly the bytes that were read and checked, or the copy is refused.

A checksum computed by the server during the copy would spare the read, but S3 servers
differ: SeaweedFS (4.48) ignores ``ChecksumAlgorithm`` on CopyObject and only carries over
a checksum sent at upload (none for multipart uploads, or uploads sent without one), so
the bytes are read once here instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fsspec.asyn import sync

from hybridfleet.errors import StoreError
from hybridfleet.store.base import Reader, serve_chunk

if TYPE_CHECKING:
    from hybridfleet.store.s3 import S3Store

COPY_OBJECT_MAX_BYTES = 5 << 30  # S3's limit for one CopyObject
COPY_PART_BYTES = 512 << 20  # parts of an UploadPartCopy; S3 allows 5 MiB to 5 GiB each
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
COPY_CONCURRENCY = 8  # part copies in flight, as for streamed uploads
# The verification read fetches ranges of this size, this many in flight, like the streamed copy's uploads.
READ_RANGE_BYTES = 16 << 20
READ_AHEAD = 8


class PinnedReader:
    """Sequential ``readinto`` over one version of an S3 object (ranged GETs with ``If-Match: etag``),
    ``READ_AHEAD`` ranges in flight; bytes read count in the store's ``bytes_read``."""

    def __init__(self, store: "S3Store", bucket: str, key: str, size_bytes: int, etag: str, where: str):
        self.store, self.bucket, self.key, self.size_bytes, self.etag, self.where = store, bucket, key, size_bytes, etag, where
        self._pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="hfleet-s3-verify")
        self._pending: deque[Future] = deque()
        self._next = 0  # first byte not yet requested
        self._chunk = memoryview(b"")

    async def _get_range(self, start: int, end: int) -> bytes:
        response = await self.store.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key,
                                                Range=f"bytes={start}-{end - 1}", IfMatch=self.etag)  # fmt: skip
        body = response["Body"]
        try:
            return await body.read()
        finally:
            body.close()

    def _fetch(self, start: int, end: int) -> bytes:
        try:
            data = sync(self.store.fs.loop, self._get_range, start, end)
        except OSError as err:
            raise StoreError(f"{self.where}: changed or unreadable while it was verified ({err}); nothing was written") from err
        if len(data) != end - start:
            raise StoreError(f"{self.where}: range {start}-{end} gave {len(data)} bytes; nothing was written")
        return data

    def readinto(self, view: memoryview) -> int:
        if not self._chunk.nbytes:
            while len(self._pending) < READ_AHEAD and self._next < self.size_bytes:
                end = min(self.size_bytes, self._next + READ_RANGE_BYTES)
                self._pending.append(self._pool.submit(self._fetch, self._next, end))
                self._next = end
            if not self._pending:
                return 0
            self._chunk = memoryview(self._pending.popleft().result())
            self.store.bytes_read += self._chunk.nbytes
        count, self._chunk = serve_chunk(self._chunk, view)
        return count

    def close(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._chunk = memoryview(b"")


def verify_pinned(source: "S3Store", source_path: str, size_bytes: int, verify: Callable[[Reader], None]) -> str:
    """Run ``verify`` on a reader of ``source_path``'s bytes, pinned to the object's current ETag; that ETag."""
    where = f"{source.url}/{source_path}"
    bucket, key, _ = source.fs.split_path(source._full(source_path))
    try:
        head = source.fs.call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError as err:
        raise StoreError(f"{where}: no such file") from err
    except OSError as err:
        raise StoreError(f"{where}: cannot read it: {err}") from err
    if int(head["ContentLength"]) != size_bytes:
        raise StoreError(f"{where}: size {head['ContentLength']} bytes, expected {size_bytes} (truncated or replaced)")
    reader = PinnedReader(source, bucket, key, size_bytes, head["ETag"], where)
    try:
        verify(reader)
    finally:
        reader.close()
    return head["ETag"]


def copy_pinned(target: "S3Store", source: "S3Store", source_path: str, etag: str, path: str, size_bytes: int) -> None:
    """Copy the version ``etag`` of ``source_path`` to ``path`` server-side; StoreError, nothing published, when
    the source is no longer that version."""
    where = f"{source.url}/{source_path}"
    src_bucket, src_key, _ = source.fs.split_path(source._full(source_path))
    bucket, key, _ = target.fs.split_path(target._full(path))
    copy_source = {"Bucket": src_bucket, "Key": src_key}
    try:
        if size_bytes <= COPY_OBJECT_MAX_BYTES:
            target.fs.call_s3("copy_object", Bucket=bucket, Key=key, CopySource=copy_source, CopySourceIfMatch=etag)
        else:
            _copy_parts(target, bucket, key, copy_source, etag, size_bytes)
    except OSError as err:
        raise StoreError(f"{where} -> {target.url}/{path}: server-side copy refused ({err}; the source changed "
                         f"after it was verified, or access was denied); nothing was published") from err  # fmt: skip
    target.fs.invalidate_cache(target._full(path))
    copied = target.size(path)
    if copied != size_bytes:  # a server that copied something else: do not leave it under the name
        target.rm(path)
        raise StoreError(f"{target.url}/{path}: the server-side copy has {copied} bytes, expected {size_bytes}; removed")


def part_bytes_for(size_bytes: int) -> int:
    """The UploadPartCopy part size for an object of ``size_bytes``: ``COPY_PART_BYTES``, larger when
    that would need more than ``MAX_PARTS`` parts."""
    return max(COPY_PART_BYTES, -(-size_bytes // MAX_PARTS))


def _copy_parts(target: "S3Store", bucket: str, key: str, copy_source: dict[str, str], etag: str, size_bytes: int) -> None:
    """A multipart upload whose parts the server copies from ``copy_source`` (pinned to ``etag``), in parallel."""
    part = part_bytes_for(size_bytes)
    upload_id = target.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        with ThreadPoolExecutor(COPY_CONCURRENCY, thread_name_prefix="hfleet-s3-copy") as pool:
            futures: list[Future[Any]] = [
                pool.submit(target.fs.call_s3, "upload_part_copy", Bucket=bucket, Key=key, UploadId=upload_id,
                            PartNumber=number, CopySource=copy_source, CopySourceIfMatch=etag,
                            CopySourceRange=f"bytes={start}-{min(size_bytes, start + part) - 1}")
                for number, start in enumerate(range(0, size_bytes, part), start=1)
            ]  # fmt: skip
            parts = [{"PartNumber": i, "ETag": f.result()["CopyPartResult"]["ETag"]} for i, f in enumerate(futures, start=1)]
        target.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": parts})  # fmt: skip
    except BaseException:
        try:
            target.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except OSError:
            pass  # the server drops abandoned uploads itself; the object was never published
        raise
