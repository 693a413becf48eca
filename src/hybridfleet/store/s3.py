"""S3 and S3-compatible stores (AWS, OSS, MinIO, SeaweedFS) through s3fs."""

from __future__ import annotations

import os
from typing import Any

import s3fs

from hybridfleet.errors import StoreError
from hybridfleet.store.fsspec_store import FsspecStore


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
