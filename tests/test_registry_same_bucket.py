"""Registering a checkpoint that lives in the registry store's own S3 bucket (real SeaweedFS): the
server copies it (CopyObject / UploadPartCopy) after one verification read; no tensor byte is
written through this process, and a corrupt file leaves no row, no manifest and no blob."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from hybridfleet.ckpt import save_checkpoint
from hybridfleet.errors import CheckpointError
from hybridfleet.registry import Registry
from hybridfleet.registry import service as registry_service
from hybridfleet.store import open_store, s3_copy
from tests.registry_helpers import save_model, table_counts

pytest_plugins = ["tests.registry_fixtures", "tests.seaweed"]


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """S3 endpoint and keys by environment, as in a deployment (the registry opens its store from a URL)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret)


@pytest.fixture
def opened_sources(monkeypatch) -> list:
    """The checkpoint stores a registration opens (the real stores, recorded to read their byte counters)."""
    opened = []

    def recording_open_store(url, **options):
        store = open_store(url, **options)
        opened.append(store)
        return store

    monkeypatch.setattr(registry_service, "open_store", recording_open_store)
    return opened


def test_same_bucket_registration_reads_each_byte_once_and_writes_none_through_the_client(
    db_url, s3_env, s3_url, opened_sources, monkeypatch
):
    # Prepare: a 6 MiB checkpoint beside the registry's store in one bucket; copies forced to UploadPartCopy
    monkeypatch.setattr(s3_copy, "COPY_OBJECT_MAX_BYTES", 5 << 20)
    monkeypatch.setattr(s3_copy, "COPY_PART_BYTES", 5 << 20)
    reg = Registry(db_url, store=f"{s3_url}/registry")
    tensors = {"w": np.random.default_rng(0).standard_normal((6 << 20) // 4, dtype=np.float32)}
    saved = save_checkpoint(f"{s3_url}/ckpt", 3, tensors=tensors)
    total = sum(f.size_bytes for f in saved.files)
    written_before = reg.store.bytes_written
    # Execute
    info = reg.register("raw", f"{s3_url}/ckpt")
    # Assert: the client wrote only the version's manifest, read the files once, and the server copied them
    (source,) = [store for store in opened_sources if store.url == f"{s3_url}/ckpt"]
    assert reg.store.bytes_written - written_before == reg.store.size(info.manifest_path)
    assert reg.store.bytes_copied_in_store == total == info.copied_bytes
    assert total <= source.bytes_read < total + 64 * 1024  # each file once, plus the small source manifest
    manifest = json.loads(reg.store.get_bytes(info.manifest_path))
    for entry in manifest["files"]:
        assert hashlib.sha256(reg.store.get_bytes(entry["path"])).hexdigest() == entry["sha256"]
        assert entry["path"].endswith(entry["sha256"])


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])  # fmt: skip
def test_a_model_saved_in_the_same_bucket_is_registered_by_server_copy_and_pulls_verified(
    db_url, s3_env, s3_url, opened_sources, tmp_path, framework
):
    # Prepare: a framework model checkpoint written straight into the registry's bucket
    reg = Registry(db_url, store=f"{s3_url}/registry")
    url = save_model(f"{s3_url}/run", framework=framework, test_accuracy=0.9)
    written_before = reg.store.bytes_written
    # Execute
    info = reg.register("m", url)
    out = reg.pull("m@1", framework, "safetensors", str(tmp_path / "out"))
    # Assert
    assert reg.store.bytes_written - written_before == reg.store.size(info.manifest_path)
    assert reg.store.bytes_copied_in_store == info.copied_bytes == info.size_bytes
    assert info.metrics["test_accuracy"] == 0.9
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0 and out["path"].endswith("model.safetensors")


def test_same_bucket_registration_of_a_corrupt_file_is_refused_leaving_no_row_manifest_or_blob(db_url, s3_env, s3_url):
    # Prepare: a checkpoint of two tensor files and its state, one byte of one file flipped after the manifest was written
    reg = Registry(db_url, store=f"{s3_url}/registry")
    saved = save_checkpoint(f"{s3_url}/ckpt", 1, tensors={"a": np.ones(4096, np.float32), "b": np.zeros(4096, np.float32)},
                            state={"k": 1}, shard_bytes=16384)  # fmt: skip
    assert len(saved.files) >= 3  # the other files verify: only the flipped one is refused
    source = open_store(f"{s3_url}/ckpt")
    victim = [f for f in saved.files if f.role != "state"][-1]
    data = bytearray(source.get_bytes(victim.path))
    data[-1] ^= 0x01
    source.put_bytes(victim.path, bytes(data))
    before = table_counts(reg)
    # Execute / Assert
    with pytest.raises(CheckpointError, match=r"crc32 mismatch \(corrupt file\); nothing was written"):
        reg.register("raw", f"{s3_url}/ckpt")
    assert table_counts(reg) == before
    assert reg.store.ls("blobs/sha256") == [] and reg.store.ls("models") == []
    assert reg.store.bytes_copied_in_store == 0
