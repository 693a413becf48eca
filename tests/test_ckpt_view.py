"""The streaming verified view (`open_tensors`): every file checked before any of its tensors is handed out."""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.ckpt import load_tensors_checkpoint, open_tensors, save_tensors_checkpoint
from hybridfleet.errors import CheckpointError
from hybridfleet.store import open_store

PER_FILE = 1 << 18  # 1 MiB of float32: every tensor gets a file of its own


def three_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(PER_FILE, dtype=np.float32) for name in ("a", "b", "c")}


def blob_of(info, tensor_index: int) -> str:
    """The store path of the file holding the tensor at ``tensor_index`` (files are in name order)."""
    return [f.path for f in info.files if f.role == "tensors"][tensor_index]


def rewrite(url: str, path: str, change) -> None:
    store = open_store(url)
    data = bytearray(store.get_bytes(path))
    store.put_bytes(path, bytes(change(data)))


def test_view_yields_every_tensor_equal_to_the_saved_one(tmp_path):
    # Prepare
    url = str(tmp_path / "ck")
    saved = three_tensors()
    save_tensors_checkpoint(url, 3, saved)
    # Execute
    with open_tensors(url) as view:
        got = dict(view.items())
        # Assert
        assert view.manifest.step == 3 and len(view) == 3
    assert list(got) == ["a", "b", "c"]
    for name, array in saved.items():
        np.testing.assert_array_equal(got[name], array)
    got["a"][0] = 42.0  # writable, private: the checkpoint is unchanged
    assert load_tensors_checkpoint(url)[1]["a"][0] == saved["a"][0]


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_view_feeds_framework_tensors(tmp_path, framework):
    from hybridfleet.frameworks import get_adapter, import_framework

    # Prepare
    url = str(tmp_path / "ck")
    saved = three_tensors()
    save_tensors_checkpoint(url, 1, saved)
    adapter = get_adapter(framework)
    # Execute
    with open_tensors(url) as view:
        loaded = {name: adapter.from_numpy(array) for name, array in view.items()}
    # Assert
    assert all(isinstance(t, import_framework(framework).Tensor) for t in loaded.values())
    for name, array in saved.items():
        np.testing.assert_array_equal(adapter.to_numpy(loaded[name]), array)


@pytest.mark.parametrize("check_sha256, reason", [(False, "crc32 mismatch"), (True, "sha256 mismatch")])
def test_flipped_byte_is_caught_before_any_tensor_of_its_file_is_returned(tmp_path, check_sha256, reason):
    # Prepare: one byte of the file holding "b" flipped
    url = str(tmp_path / "ck")
    info = save_tensors_checkpoint(url, 1, three_tensors())
    rewrite(url, blob_of(info, 1), lambda data: data.__setitem__(-5, data[-5] ^ 0x01) or data)
    # Execute: the caller walks the view as a load into a model would
    seen = []
    with open_tensors(url, check_sha256=check_sha256) as view:
        with pytest.raises(CheckpointError, match=reason):
            for name, _ in view.items():
                seen.append(name)
        # Assert: "a" (verified) came out, "b" never did, nor anything after it
        assert seen == ["a"]
        with pytest.raises(CheckpointError, match=reason):
            view["b"]
        with pytest.raises(CheckpointError, match=reason):
            view["c"]


def test_truncated_file_is_caught_before_use(tmp_path):
    url = str(tmp_path / "ck")
    info = save_tensors_checkpoint(url, 1, three_tensors())
    rewrite(url, blob_of(info, 0), lambda data: data[:-100])
    with open_tensors(url) as view:
        with pytest.raises(CheckpointError, match="truncated"):
            view["a"]
        with pytest.raises(CheckpointError, match="truncated"):
            next(iter(view))


def test_missing_checkpoint_role_or_name_is_a_clear_error(tmp_path):
    url = str(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="no checkpoint with a manifest"):
        open_tensors(url)
    save_tensors_checkpoint(url, 1, three_tensors())
    with pytest.raises(CheckpointError, match=r"no 'model' tensors \(roles saved: \['tensors'\]\)"):
        open_tensors(url, role="model")
    with pytest.raises(CheckpointError, match="no manifest"):
        open_tensors(url, step=7)
    with open_tensors(url) as view:
        with pytest.raises(KeyError):
            view["nope"]
        assert "a" in view and "nope" not in view
