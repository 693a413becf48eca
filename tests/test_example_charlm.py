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

from hybridfleet.cli.run import _print_summary
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
    data["ps"]["heartbeat_timeout_s"] = 120  # a worker starved of CPU on a busy machine must not leave the quorum
    data["train"] = {"steps": STEPS, "batch_size": 16, "seed": 0, "eval_every_steps": 20, "site_baselines": True}
    data["checkpoint"] = {"every_steps": 1000, "keep_last": 1, "keep_best": "test_bpc:min"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("example", ["charlm-hybrid.yaml", "charlm-hybrid-paddle.yaml"])
def test_charlm_joint_bpc_beats_each_site_alone_with_the_scripts_schedule(tmp_path, packed, example, capsys):
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
    # the run's table shows the joint and per-site bpc, and no accuracy row for a job that reports none
    _print_summary(summary)
    table = capsys.readouterr().out
    assert "joint test_bpc" in table and f"{joint:.4f}" in table and f"{alone['cloud']:.4f}" in table
    assert "joint test accuracy" not in table


# ------------------------------------------------------------------------------- the script's optimizer on the shards
K = 12  # steps: past the warmup, into the cosine


def _train(framework: str, ps_connect=None, shards=None, probe=None):
    """The script's recipe (charlm_optim) for K steps on fixed batches of the site-a text; with ``ps_connect``
    ``ps.step()`` replaces ``optimizer.step()``. ``probe(step, shards)`` runs after each step."""
    rows = charlm_data.split_rows("charlm:site-a", 20000, 33)
    rng = np.random.default_rng(0)
    batches = [charlm_data.sample_batch(rows, 4, 32, rng) for _ in range(K)]
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        model = charlm_model.build_torch(**TINY, heads=2)
        opt = charlm_optim.torch_optimizer(model, LR, 0.1)
        sched = charlm_optim.torch_schedule(opt, K, WARMUP, MIN_RATIO)
        ps = ps_connect(model, opt) if ps_connect else None
        for step, b in enumerate(batches):
            b = torch.from_numpy(b)
            F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()).backward()
            ps.step() if ps else opt.step()
            opt.zero_grad()
            sched.step()
            if probe:
                probe(step, shards)
        values = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    else:
        import paddle
        import paddle.nn.functional as F

        model = charlm_model.build_paddle(**TINY, heads=2)
        opt = charlm_optim.paddle_optimizer(model, LR, 0.1)
        ps = ps_connect(model, opt) if ps_connect else None
        sched = charlm_optim.paddle_schedule(LR, K, WARMUP, MIN_RATIO)
        opt.set_lr_scheduler(sched)
        for step, b in enumerate(batches):
            b = paddle.to_tensor(b)
            F.cross_entropy(model(b[:, :-1]).reshape([-1, 256]), b[:, 1:].reshape([-1])).backward()
            ps.step() if ps else opt.step()
            opt.clear_grad()
            sched.step()
            if probe:
                probe(step, shards)
        # the layout of the torch twin, so one reference serves both (Linear weights transposed back)
        values = {n: (p.numpy().T if charlm_model.decayed(n) else p.numpy()).copy() for n, p in model.named_parameters()}
    if ps:
        ps.close()
    return values


def _applied(framework: str, shards) -> list[tuple[float, dict[str, float]]]:
    """What the shard's optimizer applied on its last step, per group: (lr, {param: weight decay}).
    Reads the shard's own optimizer object (internal state: there is no public view of it)."""
    state = shards.servers[0].state
    runner = state.script_optimizer._runner
    block_param = {b.key: b.param for b in state.plan.blocks}
    if framework == "torch":
        by_tensor = {id(t): block_param[k] for k, t in runner.tensors.items()}
        return [(g["lr"], {by_tensor[id(t)]: g["weight_decay"] for t in g["params"]}) for g in runner.opt.param_groups]
    decays = runner.opt._apply_decay_param_fun
    coeff = runner.opt._weight_decay
    return [(runner.opt.get_lr(), {block_param[k]: coeff if decays(t.name) else 0.0 for k, t in runner.tensors.items()})]


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_the_shard_applies_the_scripts_adamw_groups_and_schedule_like_the_plain_script(tmp_path, framework):
    import importlib

    import script_optim_helpers as h

    hf = importlib.import_module(f"hybridfleet.{framework}")
    # Prepare: the plain script, and the same recipe through one real TLS shard
    want = _train(framework)
    shards = h.start_shards(tmp_path, h.job(framework))
    seen: dict[int, list] = {}
    try:
        # Execute
        got = _train(framework, lambda m, o: hf.connect(m, o, config=shards.config(0)), shards,
                     probe=lambda step, s: seen.__setitem__(step, _applied(framework, s)))
        keys = set(shards.servers[0].state.plan.params)
    finally:
        shards.stop()
    # Assert: step for step the plain script's parameters
    h.assert_close(got, want)
    assert keys == set(charlm_model.shapes(**TINY))  # the tied embedding is one key, tok.weight
    assert sorted(seen) == list(range(K))
    for step, groups in seen.items():
        rate = LR * charlm_optim.lr_factor(step, K, WARMUP, MIN_RATIO)
        assert all(lr == pytest.approx(rate, rel=1e-6, abs=1e-12) for lr, _ in groups), (step, groups)
        decay = {name: wd for _, params in groups for name, wd in params.items()}
        assert decay == {n: (0.1 if charlm_model.decayed(n) else 0.0) for n in keys}
