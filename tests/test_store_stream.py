"""Streamed writes (`Store.put_stream`) and verified blob copies (`copy_blob`) on local files and real S3 (SeaweedFS).

Sizes cross the file store's O_DIRECT threshold and, with a 5 MiB part size (S3's minimum),
the S3 store's parallel multipart path.
"""

from __future__ import annotations

import io
import os

import pytest

from hybridfleet.errors import StoreError
from hybridfleet.store import Store, blob_path, copy_blob, file_digests, open_store
from hybridfleet.store import s3 as s3_module
from hybridfleet.store.file import DIRECT_MIN_BYTES

pytest_plugins = ["tests.seaweed"]

SIZES = [3000, DIRECT_MIN_BYTES + 4097]  # buffered; O_DIRECT (file) / multipart in 4 parts (S3)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path, monkeypatch) -> Store:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/root")
    monkeypatch.setattr(s3_module, "PART_BYTES", 5 << 20)
    seaweed = request.getfixturevalue("seaweed")
    return open_store(request.getfixturevalue("s3_url"), **seaweed.options)


@pytest.mark.parametrize("size", SIZES)
def test_put_stream_writes_exactly_what_the_reader_gave(store, size):
    # Prepare
    data = os.urandom(size)
    # Execute
    store.put_stream("d/x.bin", io.BytesIO(data), size)
    # Assert
    assert store.size("d/x.bin") == size
    assert store.get_bytes("d/x.bin") == data


@pytest.mark.parametrize("size", SIZES)
def test_put_stream_whose_check_fails_publishes_nothing(store, size):
    # Prepare: an older file at the path must survive a refused replacement
    store.put_bytes("d/x.bin", b"old")

    def check():
        raise StoreError("digest mismatch")

    # Execute / Assert
    with pytest.raises(StoreError, match="digest mismatch"):
        store.put_stream("d/x.bin", io.BytesIO(os.urandom(size)), size, check)
    assert store.get_bytes("d/x.bin") == b"old"
    assert store.ls("d") == ["d/x.bin"]


@pytest.mark.parametrize("size", SIZES)
def test_put_stream_from_a_reader_that_ends_early_is_refused_and_publishes_nothing(store, size):
    with pytest.raises(StoreError, match="ended after .* bytes expected"):
        store.put_stream("d/y.bin", io.BytesIO(os.urandom(size - 1)), size)
    assert not store.exists("d/y.bin")
    assert store.ls("d") == []


@pytest.mark.parametrize("size", SIZES)
def test_copy_blob_from_a_local_file_records_the_digests_of_the_bytes_written(store, tmp_path, size):
    # Prepare
    data = os.urandom(size)
    source = open_store(f"file://{tmp_path}/src")
    source.put_bytes("f.bin", data)
    sha, crc, _ = file_digests([data])
    # Execute
    copied = copy_blob(source, "f.bin", store, sha, size, crc)
    # Assert
    assert copied == size
    assert file_digests([store.get_bytes(blob_path(sha))])[:2] == (sha, crc)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("with_crc", [True, False])
def test_copy_blob_of_a_corrupt_source_is_refused_and_writes_no_blob(store, tmp_path, size, with_crc):
    # Prepare: the digests of the original, then one byte of the source flipped
    data = bytearray(os.urandom(size))
    sha, crc, _ = file_digests([data])
    data[size // 2] ^= 0x10
    source = open_store(f"file://{tmp_path}/src")
    source.put_bytes("f.bin", data)
    # Execute / Assert
    reason = "crc32 mismatch" if with_crc else "sha256 mismatch"
    with pytest.raises(StoreError, match=reason):
        copy_blob(source, "f.bin", store, sha, size, crc if with_crc else None)
    assert not store.exists(blob_path(sha))
    assert [p for p in store.ls("blobs/sha256")] == []
    assert not any(".tmp-" in name for _, _, names in os.walk(tmp_path) for name in names)


def test_copy_blob_of_a_truncated_source_is_refused_before_reading(store, tmp_path):
    data = os.urandom(5000)
    sha, crc, _ = file_digests([data])
    source = open_store(f"file://{tmp_path}/src")
    source.put_bytes("f.bin", data[:-1])
    with pytest.raises(StoreError, match="size 4999 bytes, manifest says 5000"):
        copy_blob(source, "f.bin", store, sha, 5000, crc)
    assert not store.exists(blob_path(sha))


def test_copy_blob_between_two_s3_prefixes_reads_by_ranges(seaweed, s3_url, monkeypatch):
    # An s3:// source has no local file: it is read by ranged GETs, still once per byte
    monkeypatch.setattr(s3_module, "PART_BYTES", 5 << 20)
    source = open_store(f"{s3_url}/src", **seaweed.options)
    target = open_store(f"{s3_url}/dst", **seaweed.options)
    data = os.urandom(DIRECT_MIN_BYTES + 123)
    source.put_bytes("f.bin", data)
    sha, crc, _ = file_digests([data])
    before = source.bytes_read
    copy_blob(source, "f.bin", target, sha, len(data), crc)
    assert source.bytes_read - before == len(data)
    assert target.get_bytes(blob_path(sha)) == data
