"""One conformance suite that every Store backend passes: local files and real S3 (SeaweedFS)."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from hybridfleet.errors import StoreError
from hybridfleet.store import (
    Store,
    StoreBackendMissingError,
    blob_path,
    download_verified,
    open_store,
    put_blob,
    sha256_parts,
)

pytest_plugins = ["tests.seaweed"]


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/root")
    seaweed = request.getfixturevalue("seaweed")
    return open_store(request.getfixturevalue("s3_url"), **seaweed.options)


def test_put_then_get_returns_same_bytes_and_size(store):
    # Prepare
    data = os.urandom(3000)
    # Execute
    store.put_bytes("a/b/c.bin", data)
    # Assert
    assert store.get_bytes("a/b/c.bin") == data
    assert store.size("a/b/c.bin") == len(data)
    assert store.exists("a/b/c.bin")


def test_large_odd_sized_file_round_trips_exactly(store):
    # Above the size where the file store switches to unbuffered (O_DIRECT) writes.
    from hybridfleet.store.file import DIRECT_MIN_BYTES

    data = os.urandom(DIRECT_MIN_BYTES + 4097)

    store.put_parts("big.bin", [data[:5], memoryview(data)[5:]])

    assert store.size("big.bin") == len(data)
    assert store.get_bytes("big.bin") == data


def test_range_read_returns_requested_slice(store):
    data = bytes(range(256)) * 4
    store.put_bytes("r.bin", data)

    assert store.get_bytes("r.bin", 10, 20) == data[10:20]
    assert store.get_bytes("r.bin", 1000) == data[1000:]


def test_put_parts_writes_their_concatenation(store):
    parts = [b"head", bytearray(b"-mid-"), memoryview(b"tail")]

    store.put_parts("p.bin", parts)

    assert store.get_bytes("p.bin") == b"head-mid-tail"
    assert store.bytes_written == len(b"head-mid-tail")


def test_put_replaces_existing_file(store):
    store.put_bytes("x", b"old")

    store.put_bytes("x", b"new!")

    assert store.get_bytes("x") == b"new!"


def test_ls_lists_immediate_children_sorted(store):
    store.put_bytes("d/one", b"1")
    store.put_bytes("d/two", b"2")
    store.put_bytes("d/sub/three", b"3")

    assert store.ls("d") == ["d/one", "d/sub", "d/two"]
    assert store.ls("missing") == []


def test_rm_removes_file_and_folder_recursively(store):
    store.put_bytes("k/f1", b"1")
    store.put_bytes("k/sub/f2", b"2")

    store.rm("k/f1")
    assert not store.exists("k/f1")
    store.rm("k", recursive=True)

    assert store.ls("k") == []
    assert not store.exists("k/sub/f2")


def test_missing_file_read_names_the_path(store):
    with pytest.raises(StoreError, match="nope/x.bin: no such file"):
        store.get_bytes("nope/x.bin")
    with pytest.raises(StoreError, match="no such file"):
        store.size("nope/x.bin")
    assert not store.exists("nope/x.bin")


@pytest.mark.parametrize("bad", ["../escape", "/abs/path", "a/../../b"])
def test_path_escaping_the_root_is_rejected_and_nothing_written(store, bad):
    with pytest.raises(StoreError, match="must"):
        store.put_bytes(bad, b"x")
    assert store.ls("") == []


@pytest.mark.parametrize("bad", ["../escape", "/etc/hostname", "a/../../b"])
@pytest.mark.parametrize("read", ["read_buffer", "size", "exists", "get_bytes"])
def test_reads_of_a_path_escaping_the_root_are_rejected(store, bad, read):
    # e.g. a tampered manifest naming a file outside the checkpoint root
    with pytest.raises(StoreError, match="must"):
        getattr(store, read)(bad)


def test_read_buffer_is_writable_copy_that_does_not_change_the_file(store):
    store.put_bytes("buf", b"abcdef")

    buffer = store.read_buffer("buf")
    memoryview(buffer)[0] = ord("Z")

    assert store.get_bytes("buf") == b"abcdef"


def test_blob_is_uploaded_once_then_skipped(store):
    parts = [b"x" * 1000, b"y" * 24]
    digest, size = sha256_parts(parts)

    first = put_blob(store, parts, digest)
    second = put_blob(store, parts, digest)

    assert (first, second) == (size, 0)
    assert store.get_bytes(blob_path(digest)) == b"x" * 1000 + b"y" * 24


def test_download_resumes_a_partial_file_with_range_reads(store, tmp_path):
    # Prepare: a blob and a local partial download of its first third
    data = os.urandom(100_000)
    digest = hashlib.sha256(data).hexdigest()
    store.put_bytes(blob_path(digest), data)
    target = tmp_path / "dl" / "blob"
    target.parent.mkdir()
    (tmp_path / "dl" / "blob.part").write_bytes(data[:33_333])
    read_before = store.bytes_read
    # Execute
    download_verified(store, blob_path(digest), target, digest, chunk_bytes=10_000)
    # Assert: only the missing bytes were fetched and the result is exact
    assert target.read_bytes() == data
    assert store.bytes_read - read_before == len(data) - 33_333
    assert not (tmp_path / "dl" / "blob.part").exists()


def test_download_with_wrong_digest_fails_and_leaves_no_file(store, tmp_path):
    store.put_bytes("f", b"payload")

    with pytest.raises(StoreError, match="sha256 mismatch"):
        download_verified(store, "f", tmp_path / "out", "0" * 64)

    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.part").exists()


def test_unknown_url_scheme_is_rejected_naming_supported_ones():
    with pytest.raises(StoreError, match="unsupported storage URL scheme 'gopher'.*'file', 's3'"):
        open_store("gopher://x/y")


def test_s3_url_without_bucket_is_rejected():
    with pytest.raises(StoreError, match="must name a bucket"):
        open_store("s3://")


def test_missing_s3fs_gives_install_hint(monkeypatch):
    # s3fs is installed here; hide it to see what a user without the extra gets.
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(sys.modules, "hybridfleet.store.s3", raising=False)

    with pytest.raises(StoreBackendMissingError, match=r"pip install 'hybridfleet\[s3\]'") as info:
        open_store("s3://bucket/prefix")
    assert isinstance(info.value, ImportError)


def test_file_write_leaves_no_temp_files(tmp_path):
    store = open_store(str(tmp_path))

    store.put_bytes("a/b", b"1" * 10)

    assert sorted(os.listdir(tmp_path / "a")) == ["b"]
