"""A blob already in the registry's store is reused only when its sha256 matches its name: a planted
same-size file (here a valid safetensors file of another model with the same shapes) is rewritten
from the source and logged, and pulls serve the registered tensors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.reader import read_manifest
from hybridfleet.obs.log import redirect_log
from hybridfleet.registry import Registry
from hybridfleet.store import blob_path, open_store
from tests.registry_helpers import save_model

FRAMEWORKS = [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)]


def model_file(url: str, step: int = 10):
    """(manifest entry, bytes) of the checkpoint's model tensors file."""
    store = open_store(url)
    entry = next(f for f in read_manifest(store, step).files if f.role == "model")
    return entry, store.get_bytes(entry.path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_planted_same_size_blob_is_rewritten_and_the_pull_gets_the_true_tensors(tmp_path, framework):
    # Prepare: another model of the same shapes, planted under the digest of the real one's tensors
    real = save_model(tmp_path / "real", framework=framework, seed=0)
    other = save_model(tmp_path / "other", framework=framework, seed=1)
    entry, true_bytes = model_file(real)
    _, planted = model_file(other)
    assert len(planted) == len(true_bytes) and planted != true_bytes
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", store=str(tmp_path / "artifacts"))
    registry.store.put_bytes(blob_path(entry.sha256), planted)
    # Execute
    log = io.StringIO()
    with redirect_log(log):
        info = registry.register("m", real)
    pulled = registry.pull("m@1", framework, out_dir=str(tmp_path / "pulled"))
    # Assert
    events = [json.loads(line) for line in log.getvalue().splitlines()]
    rewritten = [e for e in events if e["event"] == "blob_rewritten"]
    assert len(rewritten) == 1 and rewritten[0]["path"] == blob_path(entry.sha256)
    assert rewritten[0]["level"] == "warning" and "not its name's content" in rewritten[0]["reason"]
    assert info.copied_bytes >= entry.size_bytes
    assert registry.store.get_bytes(blob_path(entry.sha256)) == true_bytes
    want, _ = safetensors_io.decode(true_bytes, "source")
    got, _ = safetensors_io.decode(Path(pulled["path"]).read_bytes(), "pulled")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.torch
def test_a_sound_blob_in_the_store_is_reused_without_a_copy_or_a_warning(tmp_path):
    real = save_model(tmp_path / "real")
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", store=str(tmp_path / "artifacts"))
    registry.register("m", real)
    log = io.StringIO()
    with redirect_log(log):
        again = registry.register("m", real)
    assert again.copied_bytes == 0 and "blob_rewritten" not in log.getvalue()
