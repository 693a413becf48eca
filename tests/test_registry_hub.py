"""Hub import through the real huggingface_hub and modelscope snapshot_download, offline.

There is no internet here, so each test builds the library's own cache layout (what a
previous online download leaves) and the libraries resolve it with local_files_only.
What this cannot cover: the network download itself, the hub's resolution of a branch or
tag to a commit on the server, and the online comparison of the snapshot with the hub's
file list (`hybridfleet.registry.hub._compare_with_hub`); ModelScope's cache names
snapshots by revision, so its pin is the revision, not a commit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.errors import CheckpointError, RegistryNotFoundError
from hybridfleet.registry.hub import import_model
from tests.registry_helpers import table_counts

pytest_plugins = ["tests.registry_fixtures"]
pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(root: Path, weights: dict[str, np.ndarray]) -> Path:
    """A Hugging Face hub cache holding org/tiny at COMMIT (refs/main -> COMMIT)."""
    from safetensors.numpy import save

    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    files = {"config.json": json.dumps({"hidden": 4}).encode(), "model.safetensors": save(weights)}
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else \
            hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # LFS: sha256; git: blob sha1
        (repo / "blobs" / etag).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{etag}")
    return root


def test_hf_import_pins_the_commit_records_every_file_and_pulls(registry, tmp_path):
    weights = {"linear.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "linear.bias": np.ones(3, np.float32)}
    cache = hf_cache(tmp_path / "hf", weights)
    info = import_model(registry, "hf:org/tiny@main", cache_dir=str(cache), offline=True)
    hub = info.lineage["hub"]
    assert hub["resolved_revision"] == COMMIT and hub["requested_revision"] == "main"
    assert {f["path"] for f in hub["files"]} == {"config.json", "model.safetensors"}
    assert all(len(f["sha256"]) == 64 and f["size_bytes"] > 0 for f in hub["files"])
    assert info.name == "hub/tiny" and info.framework == "torch" and info.tags["revision"] == COMMIT
    out = registry.pull("hub/tiny@1", "torch", "safetensors", str(tmp_path / "out"))
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(out["path"])["linear.weight"], weights["linear.weight"])


def test_hf_import_refuses_corrupt_incomplete_and_unknown_snapshots_and_registers_nothing(registry, tmp_path):
    cache = hf_cache(tmp_path / "hf", {"w": np.ones(4, np.float32)})
    before = table_counts(registry)
    blob = next(p for p in (cache / "models--org--tiny" / "blobs").iterdir() if len(p.name) == 64)
    good = blob.read_bytes()
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its content address"):
        import_model(registry, "hf:org/tiny@main", cache_dir=str(cache), offline=True)
    blob.write_bytes(good)
    (blob.parent / "deadbeef.incomplete").write_bytes(b"partial")
    with pytest.raises(CheckpointError, match="unfinished downloads"):
        import_model(registry, "hf:org/tiny@main", cache_dir=str(cache), offline=True)
    (blob.parent / "deadbeef.incomplete").unlink()
    blob.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        import_model(registry, "hf:org/tiny@main", cache_dir=str(cache), offline=True)
    with pytest.raises(RegistryNotFoundError, match="not found in the local hub cache"):
        import_model(registry, "hf:org/tiny@v9", cache_dir=str(cache), offline=True)
    assert table_counts(registry) == before


def test_modelscope_import_of_pdparams_through_the_real_library(registry, tmp_path):
    pytest.importorskip("modelscope")
    paddle = pytest.importorskip("paddle")
    snap = tmp_path / "ms" / "models" / "org--tiny" / "snapshots" / "v1.0"
    snap.mkdir(parents=True)
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    paddle.save({"fc.weight": paddle.to_tensor(weight)}, str(snap / "model.pdparams"))
    (snap / "configuration.json").write_text("{}")
    info = import_model(registry, "modelscope:org/tiny@v1.0", "vision/tiny-ms", cache_dir=str(tmp_path / "ms"), offline=True)
    assert info.framework == "paddle" and info.lineage["hub"]["resolved_revision"] == "v1.0"
    out = registry.pull("vision/tiny-ms@1", "paddle", "pdparams", str(tmp_path / "out"))
    np.testing.assert_array_equal(paddle.load(out["path"])["fc.weight"].numpy(), weight)
