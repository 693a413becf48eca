"""Runs never share state by accident: every run's shard snapshots are its own, and only
`hfleet run --resume` continues an earlier run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridfleet.errors import EXIT_CODES, LaunchError
from hybridfleet.launch.psjob import resolve_resume, run_ps_job, snapshot_store
from hybridfleet.spec import load_spec
from tests.test_ps_run import _job


def _deploy_job(tmp_path: Path) -> Path:
    # the deploy example names a checkpoint store, which every run of the job used to share
    return _job(tmp_path, "digits-deploy.yaml", checkpoint={"store": f"file://{tmp_path / 'store'}"},
                train__steps=40, train__site_baselines=False, train__eval_every_steps=20)


@pytest.mark.torch
@pytest.mark.slow
def test_a_second_run_trains_afresh_and_only_resume_restores_the_first_runs_shards(tmp_path):
    # Prepare
    job = _deploy_job(tmp_path)
    spec = load_spec(job)
    runs = tmp_path / "runs"
    # Execute: the same job twice, then a third run resuming the first
    first = run_ps_job(spec, job, echo=False, show_progress=False, run_root=runs, report=False)
    second = run_ps_job(spec, job, echo=False, show_progress=False, run_root=runs, report=False)
    resumed = run_ps_job(spec, job, echo=False, show_progress=False, run_root=runs, report=False,
                         resume_from=Path(first["run_dir"]))
    # Assert: the second run trained as much as the first (it used to restore the first run's
    # final snapshot and "complete" after sending about a kilobyte)
    for summary in (first, second, resumed):
        assert summary["status"] == "completed", summary
    sent_first, sent_second = (sum(s["bytes_sent_by_site"].values()) for s in (first, second))
    assert sent_second > 0.5 * sent_first > 100_000
    assert second["test_accuracy"] >= 0.8
    assert second["resumed_from"] is None
    # each run's snapshots are its own, under the job's store keyed by job and run
    first_store, second_store = (snapshot_store(spec, Path(s["run_dir"])) for s in (first, second))
    assert first_store != second_store and first_store.endswith(f"/digits-deploy/{Path(first['run_dir']).name}")
    assert (tmp_path / "store" / "digits-deploy" / Path(second["run_dir"]).name / "ps" / "shard-0").is_dir()
    # the resumed run restored the first run's shards: nothing left to train, so it sent almost nothing
    assert resumed["resumed_from"] == str(Path(first["run_dir"]).resolve())
    assert sum(resumed["bytes_sent_by_site"].values()) < 0.1 * sent_first
    info = json.loads((Path(resumed["run_dir"]) / "run.json").read_text())
    assert info["resumed_from"] == str(Path(first["run_dir"]).resolve())


def test_resume_refuses_a_folder_that_is_no_run_of_this_job(tmp_path):
    job = _deploy_job(tmp_path)
    spec = load_spec(job)
    other = tmp_path / "runs" / "other-job" / "20260101-000000"
    other.mkdir(parents=True)
    (other / "run.json").write_text(json.dumps({"job": "other-job"}))
    with pytest.raises(LaunchError, match="that run is of job 'other-job', not 'digits-deploy'"):
        resolve_resume(spec, str(other))
    with pytest.raises(LaunchError, match="not a run directory"):
        resolve_resume(spec, str(tmp_path / "nowhere"))
    with pytest.raises(LaunchError, match="no earlier run of job digits-deploy"):
        resolve_resume(spec, "latest", tmp_path / "runs")
    mine = tmp_path / "runs" / "digits-deploy" / "20260101-000000"
    mine.mkdir(parents=True)
    (mine / "run.json").write_text(json.dumps({"job": "digits-deploy"}))
    assert resolve_resume(spec, "latest", tmp_path / "runs") == mine.resolve()


def test_cli_resume_of_a_missing_run_exits_with_the_launch_code_and_starts_nothing(tmp_path):
    from tests.test_registry_server import cli

    job = _deploy_job(tmp_path)
    code, _ = cli("run", str(job), "--quiet", "--run-root", str(tmp_path / "runs"), "--resume", str(tmp_path / "nope"))
    assert code == EXIT_CODES["launch"].code
    assert not (tmp_path / "runs" / "digits-deploy").exists()


@pytest.mark.torch
@pytest.mark.slow
def test_a_site_that_never_trains_fails_the_run_naming_the_site_and_its_error(tmp_path):
    from tests.test_registry_server import cli

    # Prepare: the cloud's data is a split its script does not know, so each of its workers dies at start
    job = _job(tmp_path, "digits-deploy.yaml", sites={"hospital": {"workers": 1, "data": "digits:site-a"},
                                                      "cloud": {"workers": 1, "data": "digits:site-z"}},
               ps={"shards": 1, "sync": "asp", "optimizer": {"name": "adam", "lr": 0.003}},
               train={"steps": 20, "batch_size": 32, "seed": 0}, checkpoint={})
    # Execute
    code, out = cli("run", str(job), "--quiet", "--no-metrics", "--run-root", str(tmp_path / "runs"))
    # Assert: not exit 0, and the summary says which site did not train and why
    assert code == EXIT_CODES["launch"].code
    summary = json.loads(next((tmp_path / "runs").glob("*/*/summary.json")).read_text())
    assert summary["status"] == "failed"
    assert list(summary["untrained_sites"]) == ["cloud"]
    assert "worker-cloud-0 exited" in summary["untrained_sites"]["cloud"]


def test_run_status_follows_the_jobs_site_policy(tmp_path):
    from hybridfleet.launch.run_summary import run_status

    spec = load_spec(_job(tmp_path, "digits-hybrid.yaml"))  # hospital 2 workers, cloud 2 workers
    everyone = ["worker-hospital-0", "worker-hospital-1", "worker-cloud-0", "worker-cloud-1"]
    assert run_status(spec, everyone) == ("completed", [])
    assert run_status(spec, everyone[:3]) == ("degraded", [])  # each site still had a worker train to the end
    assert run_status(spec, everyone[:2]) == ("failed", ["cloud"])  # by default every site must train
    relaxed = spec.model_copy(update={"min_sites": 1})
    assert run_status(relaxed, everyone[:2]) == ("degraded", ["cloud"])
    strict = spec.model_copy(update={"min_workers_per_site": 2})
    assert run_status(strict, everyone[:3]) == ("failed", ["cloud"])
    status, untrained = run_status(spec, [])
    assert status == "failed" and sorted(untrained) == ["cloud", "hospital"]


def test_a_privacy_block_without_its_package_is_refused_with_the_install_command(tmp_path, monkeypatch):
    import importlib.util

    from hybridfleet.errors import SpecError
    from hybridfleet.spec import preflight

    job = _job(tmp_path, "digits-hybrid.yaml", ps={"shards": 2, "sync": "bsp", "privacy": {"clip_norm": 1.0,
                                                                                           "noise_multiplier": 0.6}})
    spec = load_spec(job)
    preflight.check_here(spec)  # installed here: accepted
    # dp_accounting is installed on this machine; hide it to see what a machine without the extra is told
    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name, *a: None if name == "dp_accounting" else real(name, *a))
    with pytest.raises(SpecError, match="ps.privacy: needs the Python package 'dp_accounting'") as refused:
        preflight.check_here(spec)
    assert refused.value.hint == "pip install 'hybridfleet[privacy]'"
    with pytest.raises(SpecError, match="ps.privacy"):
        run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
