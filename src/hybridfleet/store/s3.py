"""S3 and S3-compatible stores (AWS, OSS, MinIO, SeaweedFS) through s3fs."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import s3fs

from hybridfleet.errors import StoreError
from hybridfleet.store import s3_copy
from hybridfleet.store.base import Reader, Store, read_exactly
from hybridfleet.store.fsspec_store import FsspecStore

# Streamed writes go up as a multipart upload with this many parts in flight (what boto3's
# TransferConfig and s5cmd do): one connection per part keeps the server's disks and the
# network busy where a single sequential stream waits on each round trip. Memory held:
# (UPLOAD_CONCURRENCY + 1) * PART_BYTES per stream.
PART_BYTES = 16 << 20
UPLOAD_CONCURRENCY = 8


class S3Store(FsspecStore):
    """``s3://bucket/prefix``; endpoint and credentials from arguments or the environment.

    ``endpoint_url`` falls back to ``AWS_ENDPOINT_URL``; ``key``/``secret`` fall back
    to ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (botocore's own lookup).
    Listings are never cached, so a checkpoint written by another process is seen.
    """

    def __init__(self, url: str, endpoint_url: str | None = None, **options: Any):
        bucket_and_prefix = url[len("s3://") :].strip("/")
        if not bucket_and_prefix:
            raise StoreError(f"S3 URL must name a bucket: s3://BUCKET[/PREFIX] (got {url!r})")
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        client_kwargs = dict(options.pop("client_kwargs", {}))
        if endpoint_url:
            client_kwargs["endpoint_url"] = endpoint_url
        client_kwargs.setdefault("region_name", os.environ.get("AWS_REGION", "us-east-1"))
        # fsspec reuses one filesystem (and its connection pool) per distinct configuration;
        # creating a botocore client costs about half a second.
        fs = s3fs.S3FileSystem(client_kwargs=client_kwargs, use_listings_cache=False, **options)
        super().__init__(fs, bucket_and_prefix, f"s3://{bucket_and_prefix}")
        self.endpoint_url = endpoint_url
        self.bucket = bucket_and_prefix.split("/", 1)[0]

    def can_copy_from(self, source: Store) -> bool:
        """True for an S3 store in the same bucket of the same endpoint, opened with the same keys (the
        copy is made with this store's, which must read the source): the server copies its files."""
        return (isinstance(source, S3Store) and source.endpoint_url == self.endpoint_url and source.bucket == self.bucket
                and (source.fs.key, source.fs.secret) == (self.fs.key, self.fs.secret))  # fmt: skip

    def _prepare_copy_from(self, source: Store, source_path: str, path: str, size_bytes: int,
                           verify: Callable[[Reader], None]) -> Callable[[], None]:  # fmt: skip
        assert isinstance(source, S3Store)  # can_copy_from said so
        etag = s3_copy.verify_pinned(source, source_path, size_bytes, verify)
        return lambda: s3_copy.copy_pinned(self, source, source_path, etag, path, size_bytes)

    def _put_stream(self, path: str, reader: Reader, size_bytes: int, check: Callable[[], None]) -> None:
        if size_bytes < 2 * PART_BYTES:
            super()._put_stream(path, reader, size_bytes, check)
            return
        bucket, key, _ = self.fs.split_path(self._full(path))
        source = f"stream for {self.url}/{path}"
        try:
            upload_id = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        except OSError as err:
            raise StoreError(f"{self.url}/{path}: write failed: {err}") from err
        try:
            with ThreadPoolExecutor(UPLOAD_CONCURRENCY, thread_name_prefix="hfleet-s3-part") as pool:
                futures: list[Future] = []
                for number, start in enumerate(range(0, size_bytes, PART_BYTES), start=1):
                    in_flight = [f for f in futures if not f.done()]
                    if len(in_flight) >= UPLOAD_CONCURRENCY:
                        wait(in_flight, return_when=FIRST_COMPLETED)
                    part = bytearray(min(PART_BYTES, size_bytes - start))
                    read_exactly(reader, memoryview(part), source)
                    futures.append(pool.submit(self.fs.call_s3, "upload_part", Bucket=bucket, Key=key,
                                               UploadId=upload_id, PartNumber=number, Body=part))  # fmt: skip
                parts = [{"PartNumber": i, "ETag": f.result()["ETag"]} for i, f in enumerate(futures, start=1)]
            check()
            self.fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                            MultipartUpload={"Parts": parts})  # fmt: skip
        except BaseException as err:
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except OSError:
                pass  # the server drops abandoned uploads itself; the object was never published
            if isinstance(err, OSError):
                raise StoreError(f"{self.url}/{path}: write failed: {err}") from err
            raise
        self.fs.invalidate_cache(self._full(path))

    def _rm(self, path: str, recursive: bool) -> None:
        super()._rm(path, recursive)
        if recursive:
            self._remove_folder_markers(self._full(path))

    def _remove_folder_markers(self, full: str) -> None:
        # Some S3 servers (SeaweedFS) keep folder entries after their objects are
        # deleted; deleting the "folder/" key removes them, so `ls` stays truthful.
        try:
            entries = self.fs.ls(full, detail=True)
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.get("type") == "directory" and entry["name"].rstrip("/") != full.rstrip("/"):
                self._remove_folder_markers(entry["name"].rstrip("/"))
        try:
            self.fs.rm_file(full.rstrip("/") + "/")
        except (FileNotFoundError, OSError):
            pass
