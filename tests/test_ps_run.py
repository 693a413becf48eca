"""`hfleet run` end to end: shards and workers as real subprocesses, real torch/paddle training,
TLS and tokens on, and a worker killed with SIGKILL mid-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridfleet.data import read_manifest
from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from hybridfleet.store import open_store
from tests.examples import example_job
from tests.ps_helpers import kill_when_round

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, example: str, **overrides) -> Path:
    data = example_job(example)
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("example", ["digits-hybrid.yaml", "digits-hybrid-paddle.yaml"])
def test_digits_hybrid_joint_accuracy_beats_each_site_alone(tmp_path, example):
    # Prepare
    job = _job(tmp_path, example)
    spec = load_spec(job)
    # Execute
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs")
    # Assert
    run_dir = Path(summary["run_dir"])
    assert summary["status"] == "completed", summary
    assert summary["test_accuracy"] >= 0.95
    alone = summary["site_alone_accuracy"]
    assert set(alone) == {"hospital", "cloud"}
    assert all(summary["test_accuracy"] > a for a in alone.values())
    for site, kinds in summary["bytes_sent_by_kind"].items():  # every sent byte has a kind
        assert sum(kinds.values()) == summary["bytes_sent_by_site"][site] and kinds["gradients"] > 0
    assert all(n > 0 for n in summary["bytes_sent_by_site"].values())
    for site, conf in spec.sites.items():  # each site trained on its packed dataset, named by its manifest digest
        assert summary["datasets_by_site"][site] == {conf.data: read_manifest(open_store(conf.data)).digest}
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("final") and m["process"] == "worker-hospital-0" for m in metrics)
    assert (run_dir / "logs" / "shard-0.log").stat().st_size > 0
    assert (run_dir / "certs" / "ca.pem").exists()
    # every worker ends with the same parameters in BSP, so the same accuracy
    assert len(set(summary["test_accuracy_by_worker"].values())) == 1


@pytest.mark.torch  # trains or probes torch
def test_bsp_run_completes_when_a_worker_is_sigkilled_for_good(tmp_path):
    job = _job(tmp_path, "digits-hybrid.yaml", max_restarts=0, train__steps=200, train__site_baselines=False)
    spec = load_spec(job)
    killed: dict = {}
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         on_started=kill_when_round(40, "worker-cloud-1", killed))
    assert killed["pid"] is not None and 40 <= killed["at_round"] < 200
    codes = summary["exit_codes"]
    assert codes["worker-cloud-1"] == -9
    assert all(codes[w] == 0 for w in ("worker-hospital-0", "worker-hospital-1", "worker-cloud-0"))
    assert summary["status"] == "degraded"
    assert set(summary["test_accuracy_by_worker"]) == {"worker-hospital-0", "worker-hospital-1", "worker-cloud-0"}
    assert summary["test_accuracy"] >= 0.9


@pytest.mark.torch  # trains or probes torch
def test_bsp_worker_sigkilled_is_restarted_rejoins_and_the_run_completes(tmp_path):
    job = _job(tmp_path, "digits-hybrid.yaml", max_restarts=1, train__steps=200, train__site_baselines=False)
    spec = load_spec(job)
    killed: dict = {}
    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         on_started=kill_when_round(40, "worker-hospital-1", killed))
    assert killed["pid"] is not None
    assert summary["status"] == "completed", summary
    assert summary["restarts"] == 1
    assert summary["test_accuracy"] >= 0.95
    log = (Path(summary["run_dir"]) / "logs" / "worker-hospital-1.log").read_text()
    assert "--- restart 1 ---" in log
    started = [json.loads(line) for line in log.splitlines() if '"worker_started"' in line]
    assert len(started) == 2 and started[1]["resumed_clock"] >= 40  # rejoined mid-run, not from step 0
    assert all(s["transport"] == ["bulk", "bulk"] for s in started)  # tensor bytes on each shard's bulk plane


def test_missing_entrypoint_is_a_clear_error_before_anything_starts(tmp_path):
    from hybridfleet.errors import SpecError

    job = _job(tmp_path, "digits-hybrid.yaml", entrypoint=str(tmp_path / "nope.py"))
    with pytest.raises(SpecError, match="entrypoint: .*nope.py' is not a file"):
        run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
