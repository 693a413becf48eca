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
from hybridfleet.store import s3_copy
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


# ------------------------------------------------------------------ server-side copies within one S3 bucket
@pytest.fixture(params=["copy_object", "upload_part_copy"])
def same_bucket(request, seaweed, s3_url, monkeypatch):
    """(source, target): two prefixes of the test bucket; with ``upload_part_copy`` the copy is forced
    into a multipart UploadPartCopy of 5 MiB parts (S3's minimum) instead of one CopyObject."""
    if request.param == "upload_part_copy":
        monkeypatch.setattr(s3_copy, "COPY_OBJECT_MAX_BYTES", 5 << 20)
        monkeypatch.setattr(s3_copy, "COPY_PART_BYTES", 5 << 20)
    monkeypatch.setattr(s3_copy, "READ_RANGE_BYTES", 4 << 20)  # several ranges in flight for the verification read
    return open_store(f"{s3_url}/src", **seaweed.options), open_store(f"{s3_url}/dst", **seaweed.options)


def test_copy_blob_within_one_bucket_is_copied_by_the_server_after_one_verification_read(same_bucket):
    # Prepare: 12 MiB + 5 bytes (3 parts of an UploadPartCopy in the multipart case)
    source, target = same_bucket
    data = os.urandom((12 << 20) + 5)
    source.put_bytes("f.bin", data)
    sha, crc, _ = file_digests([data])
    read_before, written_before = source.bytes_read, target.bytes_written
    # Execute
    copied = copy_blob(source, "f.bin", target, sha, len(data), crc)
    # Assert: each byte read once (the check), none written through this process, the blob holds the bytes
    assert target.can_copy_from(source)
    assert copied == len(data)
    assert source.bytes_read - read_before == len(data)
    assert target.bytes_written - written_before == 0
    assert target.bytes_copied_in_store == len(data)
    assert file_digests([target.get_bytes(blob_path(sha))])[:2] == (sha, crc)


@pytest.mark.parametrize("with_crc", [True, False])
def test_copy_blob_within_one_bucket_of_a_corrupt_source_is_refused_and_copies_nothing(same_bucket, with_crc):
    # Prepare: the digests of the original, then one byte of the source flipped
    source, target = same_bucket
    data = bytearray(os.urandom((6 << 20) + 1))
    sha, crc, _ = file_digests([data])
    data[len(data) // 2] ^= 0x01
    source.put_bytes("f.bin", data)
    # Execute / Assert
    with pytest.raises(StoreError, match="crc32 mismatch" if with_crc else "sha256 mismatch"):
        copy_blob(source, "f.bin", target, sha, len(data), crc if with_crc else None)
    assert not target.exists(blob_path(sha))
    assert target.ls("blobs/sha256") == []
    assert target.bytes_copied_in_store == 0 and target.bytes_written == 0


def test_server_copy_of_a_source_replaced_after_its_verification_is_refused_and_publishes_nothing(same_bucket):
    # Prepare: a source that another writer replaces right after the verification read passed
    source, target = same_bucket
    source.put_bytes("f.bin", os.urandom((6 << 20) + 1))
    size = source.size("f.bin")

    def verify_then_replace(reader):
        view = memoryview(bytearray(1 << 20))
        while reader.readinto(view):
            pass
        source.put_bytes("f.bin", os.urandom(size))  # same size, other bytes

    # Execute / Assert: the copy is pinned to the version that was read
    with pytest.raises(StoreError, match="server-side copy refused .*nothing was published"):
        target.copy_from(source, "f.bin", "blobs/x", size, verify_then_replace)
    assert not target.exists("blobs/x")
    assert target.ls("") == [] and target.bytes_copied_in_store == 0


def test_server_copy_is_offered_only_within_one_bucket_of_one_endpoint(seaweed, s3_url, tmp_path):
    store = open_store(f"{s3_url}/a", **seaweed.options)
    assert store.can_copy_from(open_store(f"{s3_url}/b", **seaweed.options))
    other_bucket = open_store(f"s3://another-bucket/{s3_url.rsplit('/', 1)[1]}", **seaweed.options)
    other_endpoint = open_store(f"{s3_url}/b", **{**seaweed.options, "endpoint_url": "http://127.0.0.2:1"})
    other_keys = open_store(f"{s3_url}/b", **{**seaweed.options, "key": "someone-else"})
    local = open_store(f"file://{tmp_path}/c")
    assert not store.can_copy_from(other_bucket)
    assert not store.can_copy_from(other_endpoint)
    assert not store.can_copy_from(other_keys)
    assert not store.can_copy_from(local) and not local.can_copy_from(store)
    with pytest.raises(StoreError, match="cannot copy files of file://"):
        store.copy_from(local, "f.bin", "g.bin", 1, lambda reader: None)
