"""`ps.sync: local` (local SGD / DiLoCo): outer rounds on real TLS shards, whole jobs with torch and paddle
workers (one SIGKILLed mid-run and resumed), and the refusals of bad local-mode settings."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.codec.int4 import INT4_CHUNK_SIZE
from hybridfleet.errors import SpecError
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.local import LocalRounds
from hybridfleet.ps.worker.session import PSSession, WorkerConfig
from hybridfleet.security import load_pki
from hybridfleet.spec import load_spec, parse_spec
from tests.ps_helpers import initial_values, kill_when_round, start_cluster

REPO = Path(__file__).resolve().parents[1]
SHAPES = {k: v.shape for k, v in initial_values().items()}


def _session(cluster, site: str) -> PSSession:
    sec = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert), token=cluster.token(site))
    config = WorkerConfig(job=cluster.spec, site=site, rank=0 if site == "a" else 1, servers=cluster.addresses,
                          security=sec)
    return PSSession(SHAPES, config, "torch")


def test_outer_round_applies_nesterov_sgd_to_the_mean_pseudo_gradient(tmp_path):
    # Prepare: two workers; each "inner optimizer" moves the parameters by its own amount
    cluster = start_cluster(tmp_path, expected_workers=2, sync="local", local_steps=3,
                            optimizer={"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True})
    init = initial_values()
    moved = {"a": 0.3, "b": 0.1}
    results: dict[str, dict] = {}
    sessions = {site: _session(cluster, site) for site in moved}
    try:
        for site, s in sessions.items():
            s.start(init)

        def work(site: str) -> None:
            rounds = LocalRounds(sessions[site], optimizer=object())
            params = {k: v.copy() for k, v in init.items()}
            for _ in range(3):  # three inner steps of -moved/3 each
                for v in params.values():
                    v -= moved[site] / 3
                new = rounds.after_inner_step(lambda: params)
            results[site] = {"new": new, "inner_steps": rounds.inner_steps, "rounds": rounds.outer_rounds}

        threads = [threading.Thread(target=work, args=(site,)) for site in moved]
        # Execute
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # Assert: pseudo-gradient mean 0.2; Nesterov's first step moves by lr * (1 + momentum) * g
        expected = {k: v - np.float32(0.7 * 1.9 * 0.2) for k, v in init.items()}
        for site in moved:
            assert results[site]["inner_steps"] == 3 and results[site]["rounds"] == 1
            for k, v in expected.items():
                np.testing.assert_allclose(results[site]["new"][k], v, rtol=0, atol=1e-5)
        shard = cluster.params()
        np.testing.assert_allclose(shard["fc.bias"], expected["fc.bias"], atol=1e-5)
        assert cluster.servers[0].state.version == 1
    finally:
        for s in sessions.values():
            s.close()
        cluster.stop()


def test_no_outer_round_before_local_steps_inner_steps(tmp_path):
    cluster = start_cluster(tmp_path, sync="local", local_steps=4)
    session = _session(cluster, "a")
    try:
        session.start(initial_values())
        rounds = LocalRounds(session, optimizer=object())
        returned = [rounds.after_inner_step(initial_values) for _ in range(3)]
        assert returned == [None, None, None]
        assert cluster.servers[0].state.version == 0 and cluster.servers[0].state.applied_pushes == 0
    finally:
        session.close()
        cluster.stop()


# -------------------------------------------------------------------------------- refusals
BASE = {"name": "x", "framework": "torch", "entrypoint": "train.py"}


@pytest.mark.parametrize("ps, message", [
    ({"sync": "local", "local_steps": 0}, "ps.local_steps: input should be greater than or equal to 1 (got 0)"),
    ({"local_steps": 10}, "ps.local_steps: only applies to sync: local (sync is 'bsp')"),
    ({"sync": "local", "optimizer": {"name": "adam", "lr": 0.001}},
     "ps.optimizer: with sync: local it is the outer optimizer on the shards and must be sgd (got 'adam')"),
    ({"optimizer": {"name": "adam"}, "compression": {"codec": "topk"}},
     "ps.optimizer: server-side adam with compression codec 'topk' trains a poor model"),
    ({"sync": "ssp", "optimizer": {"name": "adamw"}, "compression": {"codec": "sign"}},
     "ps.optimizer: server-side adamw with compression codec 'sign'"),
    ({"optimizer": {"name": "adam"}, "compression": {"codec": "int4"}},
     "ps.optimizer: server-side adam with compression codec 'int4' trains a poor model"),
])
def test_bad_local_mode_settings_are_refused_naming_the_field(ps, message):
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, "ps": ps})
    assert message in str(err.value)


def test_local_mode_defaults_to_the_diloco_outer_optimizer():
    spec = parse_spec({**BASE, "ps": {"sync": "local"}})
    opt = spec.ps.optimizer
    assert (opt.name, opt.lr, opt.momentum, opt.nesterov, spec.ps.local_steps) == ("sgd", 0.7, 0.9, True, 50)
    assert parse_spec({**BASE, "ps": {"optimizer": {"name": "adam"}, "compression": {"codec": "int8"}}})
    assert parse_spec({**BASE, "ps": {"sync": "local", "compression": {"codec": "int4"}}})


def test_spec_check_refuses_server_adam_with_topk_and_hfleet_run_starts_nothing(tmp_path):
    import subprocess
    import sys

    data = yaml.safe_load((REPO / "examples/digits-hybrid.yaml").read_text())
    data["ps"]["compression"] = {"codec": "topk", "ratio": 0.01}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))

    def hfleet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hybridfleet", *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)

    checked = hfleet("spec", "check", str(job))
    assert checked.returncode != 0
    assert "ps.optimizer: server-side adam with compression codec 'topk'" in checked.stderr
    assert "use sync: local" in checked.stderr and "Traceback" not in checked.stderr
    ran = hfleet("run", str(job), "--run-root", str(tmp_path / "runs"))
    assert ran.returncode == checked.returncode
    assert not (tmp_path / "runs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_local_mode_without_an_optimizer_is_refused_before_joining(tmp_path, framework):
    spec = parse_spec({**BASE, "framework": framework, "ps": {"sync": "local"}})
    config = WorkerConfig(job=spec, servers=["127.0.0.1:9"])  # nothing listens: joining would fail differently
    if framework == "torch":
        import torch

        import hybridfleet.torch as hf

        model = torch.nn.Linear(3, 2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"pass it, ps = hf.connect\(model, optimizer\)"):
            hf.connect(model, config=config)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    else:
        import paddle

        import hybridfleet.paddle as hf

        model = paddle.nn.Linear(3, 2)
        before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"pass it, ps = hf.connect\(model, optimizer\)"):
            hf.connect(model, config=config)
        assert all(np.array_equal(before[k], v.numpy()) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------ whole jobs
def _local_job(tmp_path: Path, framework: str) -> Path:
    data = yaml.safe_load((REPO / "examples/digits-local.yaml").read_text())
    if framework == "paddle":
        data["framework"], data["entrypoint"] = "paddle", "examples/digits/train_paddle.py"
    data["entrypoint"] = str(REPO / data["entrypoint"])
    for site in data["sites"].values():  # packed site datasets ship in the repository
        site["data"] = str(REPO / site["data"])
    data["train"]["site_baselines"] = False
    data["sites"]["cloud"]["aggregate"] = False  # cloud's workers push on their own, the hospital's leader for both
    data["max_restarts"] = 1
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_local_mode_job_reaches_095_and_a_sigkilled_worker_resumes_its_inner_state(tmp_path, framework):
    # Prepare: digits-local (2 sites x 2 workers, int8 pseudo-gradients, H=20, 20 outer rounds), the hospital
    # averaging its workers' pseudo-gradients first
    from hybridfleet.launch.psjob import run_ps_job

    job = _local_job(tmp_path, framework)
    spec = load_spec(job)
    killed: dict = {}
    # Execute: SIGKILL a cloud worker once 5 outer rounds are applied
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         on_started=kill_when_round(5, "worker-cloud-1", killed))
    # Assert
    assert killed["pid"] is not None and 5 <= killed["at_round"] < 20
    assert summary["status"] == "completed", summary
    assert summary["restarts"] == 1
    assert summary["test_accuracy"] >= 0.95
    run_dir = Path(summary["run_dir"])
    log = (run_dir / "logs" / "worker-cloud-1.log").read_text()
    assert "--- restart 1 ---" in log
    restored = [json.loads(line) for line in log.splitlines() if '"inner_state_restored"' in line]
    assert len(restored) == 1 and restored[0]["saved_round"] >= killed["at_round"] - 1  # saved after its last round
    assert restored[0]["open_round"] >= restored[0]["saved_round"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finals = [m for m in metrics if m.get("final")]
    assert {m["step"] for m in finals} == {400}  # inner steps; every worker finished the job's steps
    for process in ("worker-hospital-0", "worker-hospital-1", "worker-cloud-0"):
        assert (run_dir / "inner" / process).is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_local_mode_with_int4_reaches_093_both_ways_4_bit_and_the_sigkilled_initialiser_resumes(tmp_path, framework):
    # Prepare: digits-local with 4-bit pseudo-gradients (error feedback) up and 4-bit parameter deltas down,
    # 10 outer rounds of H=20, the shards initialised by the cloud site's first worker instead of the job's
    # first site (the hospital)
    from hybridfleet.launch.psjob import run_ps_job

    job = _local_job(tmp_path, framework)
    data = yaml.safe_load(job.read_text())
    data["ps"]["compression"] = {"codec": "int4", "error_feedback": True}
    data["ps"]["init_site"] = "cloud"
    data["train"].update(steps=200, eval_every_steps=20)
    job.write_text(yaml.safe_dump(data))
    killed: dict = {}

    # Execute: SIGKILL the initialising worker once 4 outer rounds are applied
    summary = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         on_started=kill_when_round(4, "worker-cloud-0", killed))

    # Assert
    assert killed["pid"] is not None and 4 <= killed["at_round"] < 10
    assert summary["status"] == "completed", summary
    assert summary["restarts"] == 1
    assert summary["test_accuracy"] >= 0.93
    run_dir = Path(summary["run_dir"])
    restored = [json.loads(line) for line in (run_dir / "logs" / "worker-cloud-0.log").read_text().splitlines()
                if '"inner_state_restored"' in line]
    assert len(restored) == 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finals = {m["process"]: m for m in metrics if m.get("final") and "sent" in m}
    assert {m["step"] for m in finals.values()} == {200}
    numel = 64 * 128 + 128 + 128 * 10 + 10  # the digits MLP of the example (--hidden 128)
    model_bytes = 4 * numel
    four_bit_rounds = 10 * numel * (0.5 + 4 / INT4_CHUNK_SIZE)  # codes and scales of 10 rounds
    # the hospital's leader sent and received 10 rounds of 4-bit codes (plus framing and control) and
    # nothing else: the initial values came from the cloud, and the restarted initialiser did not push them again
    hospital = finals["worker-hospital-0"]
    assert four_bit_rounds < hospital["sent"] < four_bit_rounds * 1.2
    assert four_bit_rounds < hospital["received"] < four_bit_rounds * 1.2
    assert finals["worker-hospital-1"]["sent"] == 0  # its site's leader pushes for it
    assert finals["worker-cloud-0"]["sent"] < model_bytes  # after its restart: 4-bit rounds only, no second init


def test_init_site_must_name_a_site_of_the_job():
    data = yaml.safe_load((REPO / "examples/digits-local.yaml").read_text())
    data["ps"]["init_site"] = "lab"
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert "ps.init_site: 'lab' is not a site of this job (sites: hospital, cloud)" in str(err.value)


@pytest.mark.parametrize("init_site, site, rank, site_rank, expected", [
    (None, "hospital", 0, 0, True),       # default: global rank 0, the first site's first worker
    (None, "cloud", 2, 0, False),
    ("cloud", "hospital", 0, 0, False),
    ("cloud", "cloud", 2, 0, True),
    ("cloud", "cloud", 3, 1, False),
])
def test_the_first_worker_of_init_site_initialises_the_shards(init_site, site, rank, site_rank, expected):
    data = yaml.safe_load((REPO / "examples/digits-local.yaml").read_text())
    data["ps"]["init_site"] = init_site
    config = WorkerConfig(job=parse_spec(data), site=site, rank=rank, site_rank=site_rank)
    assert config.initialises is expected
