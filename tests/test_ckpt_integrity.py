"""Checkpoint store integrity under reuse: a corrupt stored blob is never referenced again, gc keeps only valid checkpoints.

Runs on local files and on real S3 (SeaweedFS).
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.ckpt import gc, list_checkpoints, load_tensors_checkpoint, save_tensors_checkpoint, verify
from hybridfleet.store import open_store, put_blob, sha256_parts

pytest_plugins = ["tests.seaweed"]


@pytest.fixture(params=["file", "s3"])
def root(request, tmp_path) -> tuple[str, dict]:
    """(checkpoint root URL, store options) on local files or on S3."""
    if request.param == "file":
        return f"file://{tmp_path}/ck", {}
    seaweed = request.getfixturevalue("seaweed")
    return request.getfixturevalue("s3_url"), seaweed.options


def tensors(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((64, 64), value, dtype=np.float32), "b": np.arange(8, dtype=np.int64) + int(value)}


def flip_byte_of_blob(url: str, options: dict, info, index: int = -1) -> str:
    """Flip every bit of one byte of the checkpoint's tensor blob in place; returns the blob path."""
    store = open_store(url, **options)
    path = next(f.path for f in info.files if f.role == "tensors")
    data = bytearray(store.get_bytes(path))
    data[index] ^= 0xFF
    store.put_bytes(path, bytes(data))
    return path


def test_identical_save_after_a_blob_was_corrupted_rewrites_the_blob(root):
    # Prepare: step 1 saved, then one byte of its blob flipped in the store
    url, options = root
    first = save_tensors_checkpoint(url, 1, tensors(1.0), **options)
    path = flip_byte_of_blob(url, options, first)
    assert [r.ok for r in verify(url, **options)] == [False]
    # Execute: the same tensors saved again
    second = save_tensors_checkpoint(url, 2, tensors(1.0), **options)
    # Assert: the new checkpoint is valid the moment it is written, and the shared blob was repaired
    assert next(f.path for f in second.files if f.role == "tensors") == path
    assert [(r.step, r.ok) for r in verify(url, **options)] == [(1, True), (2, True)]
    step, loaded, _ = load_tensors_checkpoint(url, **options)
    assert step == 2
    np.testing.assert_array_equal(loaded["w"], tensors(1.0)["w"])


def test_truncated_stored_blob_is_rewritten_not_reused(root):
    url, options = root
    store = open_store(url, **options)
    parts = [b"header-", b"payload" * 100]
    digest, size = sha256_parts(parts)
    put_blob(store, parts, digest)
    store.put_bytes(f"blobs/sha256/{digest}", b"header-payl")  # an upload cut short

    uploaded = put_blob(store, parts, digest)

    assert uploaded == size
    assert store.get_bytes(f"blobs/sha256/{digest}") == b"".join(parts)
    assert put_blob(store, parts, digest) == 0  # a sound copy is reused


def test_gc_keeps_only_valid_checkpoints_among_the_last_n(root):
    # Prepare: steps 1..4, step 4 (the newest) and step 2 corrupted
    url, options = root
    infos = [save_tensors_checkpoint(url, s, tensors(float(s)), metrics={"acc": 0.1 * s}, **options) for s in range(1, 5)]
    flip_byte_of_blob(url, options, infos[3])
    flip_byte_of_blob(url, options, infos[1], index=0)
    # Execute
    result = gc(url, keep_last=2, **options)
    # Assert: the last two VALID checkpoints are kept; the invalid ones are gone
    assert result.kept_steps == [1, 3]
    assert sorted(result.removed_steps) == [2, 4]
    assert [(r.step, r.ok) for r in verify(url, **options)] == [(1, True), (3, True)]


def test_gc_best_metric_never_picks_an_invalid_checkpoint(tmp_path):
    url = str(tmp_path)
    infos = [save_tensors_checkpoint(url, s, tensors(float(s)), metrics={"acc": a}) for s, a in [(1, 0.2), (2, 0.9), (3, 0.5)]]
    flip_byte_of_blob(url, {}, infos[1])  # the best by acc is corrupt

    result = gc(url, keep_last=1, best_metric="acc")

    assert result.kept_steps == [3]  # the best VALID one is also the newest
    assert [c.step for c in list_checkpoints(url)] == result.kept_steps


def test_gc_without_retention_removes_invalid_checkpoints_only(tmp_path):
    url = str(tmp_path)
    infos = [save_tensors_checkpoint(url, s, tensors(float(s))) for s in range(1, 4)]
    flip_byte_of_blob(url, {}, infos[0])

    result = gc(url)

    assert result.kept_steps == [2, 3] and result.removed_steps == [1]
    assert all(r.ok for r in verify(url))
