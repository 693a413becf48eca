"""Checkpoint format: safetensors + state JSON + manifest written last; verification and fallback."""

from __future__ import annotations

import hashlib
import io
import json
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file

from hybridfleet.ckpt import (
    list_checkpoints,
    load_checkpoint,
    load_tensors_checkpoint,
    save_checkpoint,
    save_tensors_checkpoint,
    verify,
)
from hybridfleet.ckpt.manifest import MANIFEST_NAME, step_dir
from hybridfleet.errors import CheckpointError
from hybridfleet.frameworks import get_adapter
from hybridfleet.obs import log as obs_log
from hybridfleet.store import open_store
from tests.test_frameworks import make_model, make_trained_optimizer

pytest_plugins = ["tests.seaweed"]


def sample_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "ids": rng.integers(0, 1000, size=17, dtype=np.int64),
        "half": rng.standard_normal(5).astype(np.float16),
        "mask": rng.random(7) > 0.5,
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def blob_file(root, info, role):
    return root / next(f.path for f in info.files if f.role == role)


def flip_bit(path, index, mask=0x01):
    """Flip bit ``mask`` of byte ``index`` (negative counts from the end) of the file at ``path``."""
    data = bytearray(path.read_bytes())
    data[index] ^= mask
    path.write_bytes(bytes(data))


@pytest.fixture
def captured_log():
    sink = io.StringIO()
    obs_log.configure(sink)
    yield sink
    obs_log.configure(None)


def test_raw_tensors_round_trip_exactly_with_state(tmp_path):
    tensors = sample_tensors()

    save_tensors_checkpoint(tmp_path, 7, tensors, state={"version": 3, "workers": ["a", "b"]})
    step, loaded, state = load_tensors_checkpoint(tmp_path)

    assert step == 7 and state == {"version": 3, "workers": ["a", "b"]}
    assert sorted(loaded) == sorted(tensors)
    for name, arr in tensors.items():
        assert loaded[name].dtype == arr.dtype and loaded[name].shape == arr.shape
        np.testing.assert_array_equal(loaded[name], arr)
        assert loaded[name].flags.writeable


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_model_and_optimizer_round_trip_bitwise(tmp_path, framework):
    adapter = get_adapter(framework)
    model = make_model(framework, seed=3)
    opt = make_trained_optimizer(framework, model)
    save_checkpoint(tmp_path, 5, model, opt, state={"epoch": 2, "sampler": {"index": 40}}, metrics={"loss": 0.5})
    fresh = make_model(framework, seed=9)
    fresh_opt = make_trained_optimizer(framework, fresh)

    info = load_checkpoint(tmp_path, fresh, fresh_opt)

    assert (info.step, info.framework, info.state, info.metrics) == (5, framework, {"epoch": 2, "sampler": {"index": 40}}, {"loss": 0.5})
    assert info.framework_version == adapter.version
    for name, arr in adapter.model_state(model).items():
        np.testing.assert_array_equal(adapter.model_state(fresh)[name], arr, err_msg=name)
    saved_opt, _ = adapter.optimizer_state(opt)
    loaded_opt, _ = adapter.optimizer_state(fresh_opt)
    for name in saved_opt:
        np.testing.assert_array_equal(loaded_opt[name], saved_opt[name], err_msg=name)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_refused_optimizer_load_leaves_the_model_unchanged(tmp_path, framework):
    # Prepare: a model-only checkpoint, and a fresh model + optimizer to load into
    adapter = get_adapter(framework)
    save_checkpoint(tmp_path, 1, make_model(framework, seed=3))
    fresh = make_model(framework, seed=9)
    optimizer = make_trained_optimizer(framework, fresh)  # takes a step, so read the model after it
    before = adapter.model_state(fresh)
    # Execute
    with pytest.raises(CheckpointError, match="the checkpoint has no optimizer state"):
        load_checkpoint(tmp_path, fresh, optimizer)
    # Assert
    after = adapter.model_state(fresh)
    for name, arr in before.items():
        np.testing.assert_array_equal(after[name], arr, err_msg=name)


@pytest.mark.torch  # trains or probes torch
def test_files_are_plain_safetensors_and_json(tmp_path):
    info = save_checkpoint(tmp_path, 1, make_model("torch"), tensors=sample_tensors())

    for entry in info.files:
        path = tmp_path / entry.path
        if entry.role == "state":
            assert json.loads(path.read_bytes())["step"] == 1
        else:
            assert load_file(str(path))  # the reference reader accepts our files
    manifest = json.loads((tmp_path / step_dir(1) / MANIFEST_NAME).read_bytes())
    assert {f["name"] for f in manifest["files"]} == {e.name for e in info.files}


def test_flipped_byte_in_newest_falls_back_to_previous_with_warning(tmp_path, captured_log):
    save_tensors_checkpoint(tmp_path, 1, sample_tensors(1))
    newest = save_tensors_checkpoint(tmp_path, 2, sample_tensors(2))
    target = blob_file(tmp_path, newest, "tensors")
    flip_bit(target, target.stat().st_size // 2)

    step, tensors, _ = load_tensors_checkpoint(tmp_path)

    assert step == 1
    np.testing.assert_array_equal(tensors["w"], sample_tensors(1)["w"])
    warnings = [json.loads(line) for line in captured_log.getvalue().splitlines() if '"warning"' in line]
    assert warnings and warnings[0]["step"] == 2 and "crc32 mismatch (corrupt file)" in warnings[0]["reason"]


def test_flipped_byte_is_reported_by_verify_as_a_sha256_mismatch(tmp_path):
    save_tensors_checkpoint(tmp_path, 1, sample_tensors(1))
    flip_bit(blob_file(tmp_path, save_tensors_checkpoint(tmp_path, 2, sample_tensors(2)), "tensors"), -1, 0x80)

    results = {r.step: r for r in verify(tmp_path)}

    assert results[1].ok and not results[2].ok
    assert "sha256 mismatch (corrupt file)" in results[2].problem


@pytest.mark.torch  # trains or probes torch
def test_manifest_records_zlib_crc32_and_sha256_of_every_file(tmp_path):
    info = save_checkpoint(tmp_path, 1, make_model("torch"), tensors=sample_tensors())

    for entry in info.files:
        data = (tmp_path / entry.path).read_bytes()
        assert entry.crc32 == f"{zlib.crc32(data):08x}"
        assert entry.sha256 == hashlib.sha256(data).hexdigest()


def as_version_1_manifest(root, step):
    """Rewrite ``step``'s manifest as the first format wrote it: no crc32 fields."""
    path = root / step_dir(step) / MANIFEST_NAME
    manifest = json.loads(path.read_bytes())
    manifest["version"] = 1
    for entry in manifest["files"]:
        del entry["crc32"]
    path.write_text(json.dumps(manifest))


def test_version_1_manifest_without_crc32_loads_verified_by_sha256(tmp_path, captured_log):
    # Prepare: two checkpoints in the old format, the newest with a flipped byte
    save_tensors_checkpoint(tmp_path, 1, sample_tensors(1))
    newest = save_tensors_checkpoint(tmp_path, 2, sample_tensors(2))
    for step in (1, 2):
        as_version_1_manifest(tmp_path, step)
    assert load_tensors_checkpoint(tmp_path)[0] == 2
    target = blob_file(tmp_path, newest, "tensors")
    flip_bit(target, target.stat().st_size // 3, 0x04)

    # Execute
    step, tensors, _ = load_tensors_checkpoint(tmp_path)

    # Assert
    assert step == 1
    np.testing.assert_array_equal(tensors["w"], sample_tensors(1)["w"])
    warnings = [json.loads(line) for line in captured_log.getvalue().splitlines() if '"warning"' in line]
    assert warnings and "sha256 mismatch" in warnings[0]["reason"]


def test_truncated_file_is_detected_and_named(tmp_path):
    save_tensors_checkpoint(tmp_path, 1, sample_tensors(1))
    newest = save_tensors_checkpoint(tmp_path, 2, sample_tensors(2))
    target = blob_file(tmp_path, newest, "tensors")
    target.write_bytes(target.read_bytes()[:-10])

    results = {r.step: r for r in verify(tmp_path)}

    assert results[1].ok and not results[2].ok
    assert "tensors-00001-of-00001.safetensors" in results[2].problem and "truncated" in results[2].problem
    assert load_tensors_checkpoint(tmp_path)[0] == 1
    with pytest.raises(CheckpointError, match="truncated"):
        load_tensors_checkpoint(tmp_path, step=2)


def test_checkpoint_without_manifest_does_not_exist(tmp_path):
    save_tensors_checkpoint(tmp_path, 1, sample_tensors(1))
    save_tensors_checkpoint(tmp_path, 2, sample_tensors(2))
    (tmp_path / step_dir(2) / MANIFEST_NAME).unlink()  # as if the save died before its last write

    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    assert load_tensors_checkpoint(tmp_path)[0] == 1


def test_no_valid_checkpoint_is_an_error_naming_the_url(tmp_path):
    with pytest.raises(CheckpointError, match=f"no valid checkpoint under file://{tmp_path}"):
        load_checkpoint(tmp_path)


def test_unchanged_tensors_are_not_uploaded_again(tmp_path):
    # Prepare: ten 1 MiB tensors, then the same with one of them changed
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": rng.standard_normal(1 << 18).astype(np.float32) for i in range(10)}
    first = save_tensors_checkpoint(tmp_path, 1, tensors)
    tensors["layer3.weight"] = tensors["layer3.weight"] + 1
    # Execute
    second = save_tensors_checkpoint(tmp_path, 2, tensors)
    # Assert: only the changed tensor's file and the small state file were written
    changed = [f for f in second.files if f.role == "tensors" and f not in first.files]
    state_bytes = next(f.size_bytes for f in second.files if f.role == "state")
    assert len(changed) == 1
    assert second.uploaded_bytes == changed[0].size_bytes + state_bytes
    assert second.uploaded_bytes < 0.15 * first.uploaded_bytes


def test_small_shard_size_splits_files_and_loads_back(tmp_path):
    tensors = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(8)}

    info = save_checkpoint(tmp_path, 1, tensors=tensors, shard_bytes=10_000)
    _, loaded, _ = load_tensors_checkpoint(tmp_path)

    assert len([f for f in info.files if f.role == "tensors"]) == 4
    for name, arr in tensors.items():
        np.testing.assert_array_equal(loaded[name], arr)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, "step must be a non-negative int"),
        ({"state": {"bad": object()}}, "state must be JSON-serialisable"),
        ({"metrics": {"acc": "high"}}, "metric 'acc' must be a number"),
        ({"tensors": {"x": [1, 2]}}, "tensor 'x' must be a numpy array"),
        ({"tensors": {"c": np.zeros(2, np.complex64)}}, "tensor 'c': dtype complex64 cannot be stored"),
    ],
)
def test_bad_save_input_is_rejected_and_writes_nothing(tmp_path, kwargs, message):
    args = {"step": 1, "tensors": {"ok": np.zeros(2, np.float32)}} | kwargs

    with pytest.raises(ValueError, match=message):
        save_checkpoint(tmp_path / "ck", **args)

    assert list_checkpoints(tmp_path / "ck") == []


def test_s3_checkpoint_round_trip_and_corruption_fallback(seaweed, s3_url):
    # Prepare: two checkpoints on real S3, the newest then corrupted in place
    save_tensors_checkpoint(s3_url, 1, sample_tensors(1), state={"k": 1}, **seaweed.options)
    newest = save_tensors_checkpoint(s3_url, 2, sample_tensors(2), state={"k": 2}, **seaweed.options)
    store = open_store(s3_url, **seaweed.options)
    path = next(f.path for f in newest.files if f.role == "tensors")
    data = bytearray(store.get_bytes(path))
    data[-1] ^= 0xFF
    # Execute
    intact = load_tensors_checkpoint(s3_url, step=2, **seaweed.options)
    store.put_bytes(path, bytes(data))
    fallback = load_tensors_checkpoint(s3_url, **seaweed.options)
    # Assert
    assert intact[0] == 2 and intact[2] == {"k": 2}
    np.testing.assert_array_equal(intact[1]["w"], sample_tensors(2)["w"])
    assert fallback[0] == 1 and fallback[2] == {"k": 1}
    assert [r.ok for r in verify(s3_url, **seaweed.options)] == [True, False]
