"""A real Prometheus scrapes a real `hfleet run` through the file-based discovery file it writes;
the series exist, carry the identity labels, move while the job trains, and pass `promtool`."""

from __future__ import annotations

import json

import pytest

from hybridfleet.obs.discovery import read_targets
from tests.obs_fixtures import promtool_check

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # the session's demo runs include the torch one


def test_prometheus_discovers_every_process_of_the_run_with_identity_labels(demo_run):
    # Prepare
    targets = read_targets(demo_run.run_dir)
    job = demo_run.summary["job"]
    # Execute
    ours = demo_run.active_targets  # while the run was live
    after = demo_run.prometheus.targets_of(job)
    # Assert
    assert {t.labels["process"] for t in targets} >= {"hfleet-run", "shard-0", "shard-1", "worker-hospital-0",
                                                      "worker-cloud-1", "baseline-hospital"}
    assert not after  # retired when the run ended
    assert {t["labels"]["process"] for t in ours} == {t.labels["process"] for t in targets}
    worker = next(t for t in ours if t["labels"]["process"] == "worker-hospital-1")
    assert worker["labels"]["site"] == "hospital" and worker["labels"]["role"] == "worker"
    assert worker["labels"]["rank"].isdigit()


def test_series_exist_and_move_while_the_demo_trains(demo_run):
    # Prepare
    prom, job = demo_run.prometheus, demo_run.summary["job"]
    end = demo_run.finished
    # Execute
    steps = prom.query(f'sum by (site) (max_over_time(hybridfleet_worker_steps_total{{job="{job}",role="worker"}}[5m]))', at=end)
    uplink = prom.query(f'sum by (site) (max_over_time(hybridfleet_worker_bytes_total{{job="{job}",direction="uplink"}}[5m]))', at=end)
    downlink = prom.query(f'sum by (site) (max_over_time(hybridfleet_worker_bytes_total{{job="{job}",direction="downlink"}}[5m]))', at=end)
    rounds = prom.query(f'max(max_over_time(hybridfleet_shard_rounds_total{{job="{job}"}}[5m]))', at=end)
    phases = prom.query(f'sum by (phase) (max_over_time(hybridfleet_worker_step_phase_seconds_total{{job="{job}"}}[5m]))', at=end)
    live = prom.query(f'max(max_over_time(hybridfleet_shard_members{{job="{job}",state="live"}}[5m]))', at=end)
    snapshots = prom.query(f'sum(max_over_time(hybridfleet_snapshot_duration_seconds_count{{job="{job}"}}[5m]))', at=end)
    accuracy = prom.query(f'max_over_time(hybridfleet_reported_value{{job="{job}",metric="test_accuracy"}}[5m])', at=end)
    # Assert
    assert demo_run.steps_rate_during_run > 0, "rate of hybridfleet_worker_steps_total never rose above 0"
    assert {r["metric"]["site"]: float(r["value"][1]) > 0 for r in steps} == {"hospital": True, "cloud": True}
    assert {r["metric"]["site"] for r in uplink if float(r["value"][1]) > 0} == {"hospital", "cloud"}
    assert {r["metric"]["site"] for r in downlink if float(r["value"][1]) > 0} == {"hospital", "cloud"}
    assert float(rounds[0]["value"][1]) >= 150
    assert {r["metric"]["phase"] for r in phases if float(r["value"][1]) > 0} == {"compute", "encode", "transfer", "wait"}
    assert float(live[0]["value"][1]) == demo_run.summary["workers"]  # every worker pushes (no site aggregation)
    assert float(snapshots[0]["value"][1]) >= 2
    assert accuracy and all(0.0 < float(r["value"][1]) <= 1.0 for r in accuracy)


def test_every_exported_endpoint_passes_promtool_with_bounded_labels_and_no_created_series(demo_run):
    # Prepare
    assert {"shard-0", "worker-cloud-0", "hfleet-run"} <= set(demo_run.expositions)
    for process, text in demo_run.expositions.items():
        # Execute
        result = promtool_check(text)
        # Assert
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (process, result)
        assert "_created" not in text
        names = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
        assert all(n.startswith("hybridfleet_") for n in names), process
        for forbidden in ("step=", "tensor=", "key=", 'worker="'):
            assert forbidden not in text, (process, forbidden)


def test_run_writes_a_scrape_config_promtool_accepts(demo_run):
    # Prepare
    from tests.obs_fixtures import promtool

    config = demo_run.run_dir / "prometheus" / "prometheus.yml"
    import subprocess

    # Execute
    result = subprocess.run([promtool(), "check", "config", str(config)], capture_output=True, text=True, timeout=30)
    # Assert
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((demo_run.run_dir / "prometheus" / "targets.json").read_text())
