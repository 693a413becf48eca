"""The charlm example: a character-level transformer on Python's standard library, for torch and paddle.

Unit tests build both frameworks' models and the data splits; the system tests pack a small
slice of the corpus with ``hfleet data pack`` and run the real ``hfleet run`` job (TLS shards
and workers as subprocesses, each site also alone) with a tiny model for a short budget.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from tests.examples import example_job

REPO = Path(__file__).resolve().parents[1]
CHARLM = REPO / "examples" / "charlm"
sys.path.insert(0, str(CHARLM))

import charlm_data  # noqa: E402
import charlm_model  # noqa: E402
import charlm_optim  # noqa: E402

TINY = {"layers": 1, "d_model": 32, "context": 32}
TINY_ARGS = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--lr", "0.01",
             "--warmup-steps", "5", "--test-bytes", "8000"]
STEPS, WARMUP, LR, MIN_RATIO = 60, 5, 0.01, 0.1


# ------------------------------------------------------------------------------- data
def test_sites_and_test_set_hold_disjoint_packages_and_no_test_files():
    # Prepare / Execute
    site_files = {s: set(charlm_data.source_files(p)) for s, p in charlm_data.SITE_PACKAGES.items()}
    test_files = set(charlm_data.source_files(charlm_data.TEST_PACKAGES))
    # Assert
    assert not site_files["site-a"] & site_files["site-b"] and not test_files & (site_files["site-a"] | site_files["site-b"])
    everything = site_files["site-a"] | site_files["site-b"] | test_files
    assert not any({"test", "tests", "idle_test"} & set(p.parts) for p in everything)
    assert charlm_data.corpus(charlm_data.TEST_PACKAGES, 5000) == charlm_data.corpus(charlm_data.TEST_PACKAGES, 5000)


def test_all_is_both_sites_rows_and_windows_refuse_short_text():
    a = charlm_data.split_rows("charlm:site-a", 20000)
    b = charlm_data.split_rows("charlm:site-b", 20000)
    assert np.array_equal(charlm_data.split_rows("charlm:all", 20000), np.concatenate([a, b]))
    assert a.dtype == np.uint8 and a.shape[1] == charlm_data.WINDOW
    with pytest.raises(ValueError, match="shorter than one window of 129 bytes"):
        charlm_data.windows(b"x" * 100)
    with pytest.raises(ValueError, match="unknown site data 'charlm:site-c'"):
        charlm_data.split_rows("charlm:site-c")
    with pytest.raises(ValueError, match="context 40 needs 41"):
        charlm_data.sample_batch(np.zeros((3, 33), np.uint8), 2, 40, np.random.default_rng(0))


# ------------------------------------------------------------------------------- models
@pytest.mark.torch
@pytest.mark.paddle
def test_torch_and_paddle_models_have_the_same_parameters_and_outputs():
    import paddle
    import torch

    from hybridfleet.frameworks import get_adapter
    from hybridfleet.frameworks.layout import param_layout

    # Prepare
    t = charlm_model.build_torch(layers=2, d_model=32, context=16, heads=4)
    p = charlm_model.build_paddle(layers=2, d_model=32, context=16, heads=4)
    tokens = np.random.default_rng(0).integers(0, 256, (3, 16))
    # Execute
    t_params = {n: tuple(v.shape) for n, v in t.named_parameters()}
    p_params = {n: tuple(v.shape) for n, v in p.named_parameters()}
    mapping = param_layout(list(t_params), get_adapter("torch").module_kinds(t), "torch", "paddle")
    # Assert: one tied embedding, the names and layouts the checkpoint converter maps, the same count
    assert "tok.weight" in t_params and not any("head" in n for n in t_params)
    assert t_params == charlm_model.shapes(2, 32, 16)
    assert {name: (tuple(reversed(t_params[src])) if transpose else t_params[src])
            for src, (name, transpose) in mapping.items()} == p_params
    assert sum(math.prod(s) for s in t_params.values()) == sum(math.prod(s) for s in p_params.values()) == \
        sum(v.numel() for v in t.parameters())
    # the same initial values: the same logits
    want = t(torch.from_numpy(tokens)).detach().numpy()
    got = p(paddle.to_tensor(tokens)).numpy()
    assert want.shape == (3, 16, 256)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_default_model_is_the_issues_4_layers_d256_context_128():
    shapes = charlm_model.shapes()
    assert shapes["tok.weight"] == (256, 256) and shapes["pos.weight"] == (128, 256)
    assert {n.split(".")[1] for n in shapes if n.startswith("blocks.")} == {"0", "1", "2", "3"}
    assert not any(charlm_model.decayed(n) for n in ("tok.weight", "pos.weight", "ln_f.weight", "blocks.0.fc.bias"))
    assert charlm_model.decayed("blocks.3.qkv.weight")


@pytest.mark.paddle
def test_paddle_schedule_gives_the_torch_schedules_rates():
    sched = charlm_optim.paddle_schedule(LR, STEPS, WARMUP, MIN_RATIO)
    got = []
    for _ in range(STEPS):
        got.append(sched())
        sched.step()
    want = [LR * charlm_optim.lr_factor(s, STEPS, WARMUP, MIN_RATIO) for s in range(STEPS)]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------- the real job
@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("charlm-data")
    subprocess.run([sys.executable, str(CHARLM / "pack_sites.py"), "--out", str(out), "--max-bytes", "60000",
                    "--window", "33"], check=True, capture_output=True)
    return out


def _job(tmp_path: Path, example: str, packed: Path) -> Path:
    data = example_job(example)
    data["sites"]["hospital"]["data"] = str(packed / "site-a")
    data["sites"]["cloud"]["data"] = str(packed / "site-b")
    data["args"] = TINY_ARGS
    data["ps"]["shards"] = 1
    data["train"] = {"steps": STEPS, "batch_size": 16, "seed": 0, "eval_every_steps": 20, "site_baselines": True}
    data["checkpoint"] = {"every_steps": 1000, "keep_last": 1, "keep_best": "test_bpc:min"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("example", ["charlm-hybrid.yaml", "charlm-hybrid-paddle.yaml"])
def test_charlm_joint_bpc_beats_each_site_alone_with_the_scripts_schedule(tmp_path, packed, example):
    # Prepare
    job = _job(tmp_path, example, packed)
    spec = load_spec(job)
    # Execute
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs", report=False,
                         metrics=False)
    # Assert
    run_dir = Path(summary["run_dir"])
    assert summary["status"] == "completed", summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = {r["process"]: r for r in records if r.get("final")}
    joint = summary["joint_metrics"]["test_bpc"]  # the saved model's (rank 0's final report)
    alone = {site: m["test_bpc"] for site, m in summary["site_alone_metrics"].items()}
    assert joint == final["worker-hospital-0"]["test_bpc"] and set(alone) == {"hospital", "cloud"}
    assert summary["test_accuracy"] is None and summary["test_accuracy_by_worker"] == {}  # no accuracy reported
    assert joint < 0.75 * 8.0  # an untrained byte model is at about 8 bits per character
    assert all(joint < a for a in alone.values()), (joint, alone)
    assert final["worker-cloud-0"]["test_bpc"] == pytest.approx(joint, rel=1e-6)  # BSP: one model
    # the rate each report says its step used is the script's warmup + cosine schedule
    reported = [r for r in records if r["process"] == "worker-hospital-0" and "lr" in r]
    assert [r["step"] for r in reported] == [20, 40, 60]
    for r in reported:
        assert r["lr"] == pytest.approx(LR * charlm_optim.lr_factor(r["step"] - 1, STEPS, WARMUP, MIN_RATIO))
    assert "script_optimizer_overridden" not in (run_dir / "logs" / "worker-hospital-0.log").read_text()
