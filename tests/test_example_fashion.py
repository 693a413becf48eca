"""The Fashion-MNIST example: its IDX reader, its non-IID site split, one ResNet for both frameworks,
and the shipped jobs run through `hfleet run` (real shards, workers and site baselines as subprocesses)
on a small packed subset with a shrunk model."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.errors import SpecError
from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from hybridfleet.spec.preflight import check_here
from tests.examples import example_job
from tests.needs import missing

REPO = Path(__file__).resolve().parents[1]
FASHION = REPO / "examples" / "fashion"
JOBS = {"torch": "fashion-hybrid.yaml", "paddle": "fashion-hybrid-paddle.yaml"}
ROWS_PER_SITE = 1000  # of the ~30,000 each site holds


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"fashion_example_{name}", FASHION / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fashion_data = _module("fashion_data")


def _need_dataset() -> None:
    if not (fashion_data.data_dir() / "train-images-idx3-ubyte.gz").is_file():
        missing(f"Fashion-MNIST is not installed at {fashion_data.data_dir()}: apt-get install dataset-fashion-mnist "
                "(.ci/install-datasets.sh)")


def _idx(path: Path, magic: int, dims: list[int], body: bytes) -> Path:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    path.write_bytes(gzip.compress(header + body))
    return path


# -- the IDX reader ------------------------------------------------------------------------------

def test_idx_reader_reads_a_well_formed_file(tmp_path):
    path = _idx(tmp_path / "ok.gz", fashion_data.IMAGES_MAGIC, [2, 3, 4], bytes(range(24)))
    out = fashion_data.read_idx(path, fashion_data.IMAGES_MAGIC)
    assert out.shape == (2, 3, 4) and out.dtype == np.uint8 and out[1, 2, 3] == 23


@pytest.mark.parametrize("magic, dims, body, message", [
    (0x00000801, [2, 3, 4], bytes(24), "magic 00000801, expected 00000803"),
    (0x00000803, [2, 3, 4], bytes(23), "truncated: the header says [2, 3, 4] (24 bytes), the file holds 23"),
    (0x00000803, [2, 3, 4], bytes(25), "more bytes follow"),
    (0x00000803, [60000, 28000, 28], b"", "IDX header asks for [60000, 28000, 28]"),
], ids=["wrong-magic", "truncated", "trailing", "oversized-header"])
def test_idx_reader_refuses_a_malformed_file_naming_it_and_what_is_wrong(tmp_path, magic, dims, body, message):
    # Prepare
    path = _idx(tmp_path / "bad.gz", magic, dims, body)
    before = path.read_bytes()
    # Execute / Assert: a clear error naming the file; the file is left as it was
    with pytest.raises(ValueError, match="bad.gz") as err:
        fashion_data.read_idx(path, fashion_data.IMAGES_MAGIC)
    assert message in str(err.value)
    assert path.read_bytes() == before


def test_idx_reader_refuses_a_cut_gzip_stream_and_a_missing_file_with_the_install_hint(tmp_path):
    cut = tmp_path / "cut.gz"
    header = fashion_data.IMAGES_MAGIC.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (10, 10, 50))
    body = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()  # incompressible
    cut.write_bytes(gzip.compress(header + body)[:2500])
    with pytest.raises(ValueError, match="cut.gz: .*apt-get install dataset-fashion-mnist"):
        fashion_data.read_idx(cut, fashion_data.IMAGES_MAGIC)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_data.read_idx(tmp_path / "absent.gz", fashion_data.IMAGES_MAGIC)


# -- the site split -------------------------------------------------------------------------------

def test_sites_split_the_training_set_by_class_and_see_it_through_their_own_scanner():
    _need_dataset()
    # Execute
    images, labels = fashion_data.load_raw("train")
    xa, ya = fashion_data.split_rows("fashion:site-a")
    xb, yb = fashion_data.split_rows("fashion:site-b")
    x_all, y_all = fashion_data.split_rows("fashion:all")
    # Assert: a partition of all 60,000 rows, 90% of classes 0-4 at site A, 90% of 5-9 at site B
    assert len(ya) + len(yb) == len(labels) == 60000 and len(y_all) == len(labels)
    assert 0.88 < np.mean(ya < 5) < 0.92 and 0.88 < np.mean(yb >= 5) < 0.92
    assert all(np.sum(ya == c) > 400 for c in range(10))  # some overlap: each site sees every class a little
    to_a = fashion_data.site_of_rows(labels)
    assert np.array_equal(xa, fashion_data.scan(images[to_a], "site-a"))
    assert np.array_equal(xb, images[~to_a])  # site B's scanner is the identity
    assert xa.mean() > images[to_a].mean() + 20  # site A's scanner: brighter, less contrast
    assert np.array_equal(y_all, labels)
    assert np.array_equal(fashion_data.split_rows("fashion:site-a")[0], xa)  # seeded
    with pytest.raises(ValueError, match="unknown site data 'fashion:site-c'"):
        fashion_data.split_rows("fashion:site-c")


# -- one model for both frameworks ------------------------------------------------------------------

@pytest.mark.torch
@pytest.mark.paddle
def test_torch_and_paddle_models_are_the_same_network():
    import paddle
    import torch

    fashion_model = _module("fashion_model")
    # Prepare: the torch model's weights copied into the paddle one (Linear weights transposed)
    t, p = fashion_model.build_torch(4), fashion_model.build_paddle(4)
    torch_state = {k: v for k, v in t.state_dict().items() if not k.endswith("num_batches_tracked")}
    paddle_state = p.state_dict()
    assert len(torch_state) == len(paddle_state)
    for (_, value), (_, target) in zip(torch_state.items(), paddle_state.items()):
        value = value.numpy()
        target.set_value(value.T if value.ndim == 2 else value)
    t.eval()
    p.eval()
    # Execute
    x = np.random.default_rng(0).random((5, 1, 28, 28), dtype=np.float32)
    out_t = t(torch.from_numpy(x)).detach().numpy()
    out_p = p(paddle.to_tensor(x)).numpy()
    # Assert
    np.testing.assert_allclose(out_p, out_t, rtol=1e-4, atol=1e-5)
    assert 0.3e6 <= sum(v.numel() for v in fashion_model.build_torch().parameters()) <= 1e6


# -- the shipped jobs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """The first ROWS_PER_SITE rows of each site, packed by the example's own pack_sites.py."""
    _need_dataset()
    out = tmp_path_factory.mktemp("fashion-data")
    subprocess.run([sys.executable, str(FASHION / "pack_sites.py"), "--rows", str(ROWS_PER_SITE), "--out", str(out)],
                   check=True, capture_output=True, cwd=REPO)
    return out


def _shrunk_job(tmp_path: Path, framework: str, packed: Path) -> Path:
    data = example_job(JOBS[framework])
    data["args"] = ["--width", "4", "--test-rows", "1000", "--lr", "0.1"]
    data["sites"]["hospital"]["data"] = str(packed / "site-a")
    data["sites"]["cloud"]["data"] = str(packed / "site-b")
    data["train"].update(steps=120, batch_size=32, eval_every_steps=60)
    data["ps"]["shards"] = 1
    data.update(max_restarts=0, checkpoint={"keep_last": 1})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_fashion_joint_model_beats_each_site_alone(tmp_path, packed, framework):
    # Prepare: the shipped job, shrunk (width 4, 120 steps, 1,000 rows per site)
    job = _shrunk_job(tmp_path, framework, packed)
    spec = load_spec(job)
    assert spec.train.site_baselines and spec.ps.sync == "bsp" and "optimizer" not in spec.ps.model_fields_set
    # Execute
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         metrics=False, report=False)
    # Assert: the saved model beats each site trained alone; every worker holds the same model
    assert summary["status"] == "completed", summary
    alone = summary["site_alone_accuracy"]
    assert set(alone) == {"hospital", "cloud"}
    assert all(summary["test_accuracy"] > a for a in alone.values()), summary
    assert len(set(summary["test_accuracy_by_worker"].values())) == 1
    assert summary["train_rows_by_site"] == {"hospital": ROWS_PER_SITE, "cloud": ROWS_PER_SITE}


def test_a_missing_site_dataset_is_refused_before_start_naming_the_packing_script(tmp_path):
    # Prepare: the shipped job with its site data in a folder nobody packed
    data = example_job(JOBS["torch"])
    for site, folder in (("hospital", "site-a"), ("cloud", "site-b")):
        data["sites"][site]["data"] = str(tmp_path / "not-packed" / folder)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    # Execute / Assert: the hint names pack_sites.py; nothing was written
    with pytest.raises(SpecError, match=r"sites\.\w+\.data: .*not-packed.*does not exist") as err:
        check_here(load_spec(job))
    assert f"python {FASHION / 'pack_sites.py'}" in err.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
