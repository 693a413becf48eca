"""The per-process metrics: exposition passes promtool, a busy port is a clear error, reported
names are capped, and reported values reach TensorBoard (torch) and VisualDL (paddle) files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridfleet.errors import LaunchError
from hybridfleet.obs.metrics import (MAX_REPORTED_NAMES, ProcessMetrics, StepTimer, SupervisorMetrics,
                                     serve_metrics)
from hybridfleet.obs.scalars import ScalarWriter, resolve_writer
from tests.obs_fixtures import promtool_check

REPO = Path(__file__).resolve().parents[1]


def test_metrics_port_in_use_is_an_error_naming_the_port_and_serves_nothing():
    # Prepare
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Execute / Assert
        with pytest.raises(LaunchError, match=rf"metrics port {port} on 127.0.0.1 is in use"):
            serve_metrics(port, metrics=ProcessMetrics())


def test_busy_metrics_port_stops_a_shard_with_that_message(tmp_path):
    # Prepare
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"PYTHONPATH": str(REPO / "src"), "HFLEET_METRICS_PORT": str(port), "PATH": "/usr/bin:/bin"}
        # Execute
        result = subprocess.run([sys.executable, "-m", "hybridfleet", "ps", "serve", str(REPO / "examples" / "digits-hybrid.yaml"),
                                 "--shard", "0", "--port", "0", "--insecure-plaintext", "--no-auth",
                                 "--port-file", str(tmp_path / "port")], env=env, capture_output=True, text=True,
                                timeout=60, cwd=tmp_path)
    # Assert
    assert result.returncode == 8
    assert f"metrics port {port} on 127.0.0.1 is in use" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "port").exists()


def test_step_timer_and_supervisor_counters_pass_promtool_without_created_series():
    # Prepare
    metrics = ProcessMetrics()
    timer = StepTimer(metrics)
    sup = metrics.group(SupervisorMetrics)
    # Execute
    for _ in range(3):
        timer.begin()
        for phase in ("encode", "transfer", "wait"):
            timer.mark(phase)
        timer.end(4096)
    sup.restarts.labels("worker").inc()
    metrics.report(3, {"loss": 0.25, "test_accuracy": 0.9})
    text = metrics.exposition().decode()
    # Assert
    result = promtool_check(text)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result
    assert "hybridfleet_worker_steps_total 3.0" in text
    assert 'hybridfleet_reported_value{metric="loss"} 0.25' in text
    assert "_created" not in text


def test_reported_names_are_capped_so_labels_stay_bounded():
    # Prepare
    metrics = ProcessMetrics()
    # Execute
    metrics.report(1, {f"m{i}": float(i) for i in range(MAX_REPORTED_NAMES + 10)})
    text = metrics.exposition().decode()
    # Assert
    assert text.count("hybridfleet_reported_value{") == MAX_REPORTED_NAMES


def test_an_unknown_scalar_writer_is_refused_with_the_choices():
    with pytest.raises(LaunchError, match="must be one of auto, tensorboard, visualdl, off"):
        resolve_writer("wandb", "torch")


@pytest.mark.parametrize("framework,kind", [("torch", "tensorboard"), ("paddle", "visualdl")])
def test_auto_picks_the_framework_writer_and_its_files_read_back(tmp_path, framework, kind):
    # Prepare
    pytest.importorskip(kind)
    chosen = resolve_writer("auto", framework)
    writer = ScalarWriter(chosen, tmp_path / "w")
    # Execute
    writer.add(10, {"loss": 0.5, "test_accuracy": 0.8})
    writer.add(20, {"loss": 0.25, "test_accuracy": 0.9})
    writer.close()
    # Assert
    assert chosen == kind
    assert read_scalars(tmp_path / "w", kind, "loss") == [(10, 0.5), (20, 0.25)]


def read_scalars(logdir: Path, kind: str, tag: str) -> list[tuple[int, float]]:
    if kind == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(logdir))
        acc.Reload()
        return [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)]
    from visualdl import LogReader

    (log,) = [p for p in logdir.iterdir() if p.name.startswith("vdlrecords")]
    return [(r.id, round(r.value, 5)) for r in LogReader(file_path=str(log)).get_data("scalar", tag)]


@pytest.mark.slow
def test_demo_workers_write_scalars_for_their_framework(demo_run):
    # Prepare
    kind = "tensorboard" if demo_run.framework == "torch" else "visualdl"
    logdir = demo_run.run_dir / "scalars" / "worker-hospital-0"
    # Execute
    points = read_scalars(logdir, kind, "test_accuracy")
    # Assert
    assert [step for step, _ in points][:4] == [50, 100, 150, 200]
    assert all(0 < v <= 1 for _, v in points)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_launch_helper_report_serves_on_port_base_plus_local_rank_and_writes_scalars(tmp_path, framework):
    # Prepare: a rank as `hfleet launch` starts it (local rank 1), reporting through the helpers
    from hybridfleet.launch.preflight import free_port

    base = free_port()
    while True:  # base + 1 must be free too
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                base = free_port()
    rank_vars = {"torch": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
                 "paddle": {"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2", "PADDLE_LOCAL_RANK": "1"}}[framework]
    script = (f"import {framework}, sys, urllib.request\n"
              "from hybridfleet.launch import helpers\n"
              "helpers.report(7, loss=0.5, test_accuracy=0.75)\n"
              f"print(urllib.request.urlopen('http://127.0.0.1:{base + 1}/metrics').read().decode())\n")
    env = {**os.environ, **rank_vars, "PYTHONPATH": str(REPO / "src"), "HFLEET_METRICS_PORT_BASE": str(base),
           "HFLEET_SCALARS_DIR": str(tmp_path / "scalars"), "HFLEET_PROCESS_NAME": "rank-1"}
    env.pop("HFLEET_METRICS_PORT", None)
    # Execute
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    # Assert
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'hybridfleet_reported_value{metric="test_accuracy"} 0.75' in result.stdout
    assert "hybridfleet_reported_step 7.0" in result.stdout
    kind = "tensorboard" if framework == "torch" else "visualdl"
    assert read_scalars(tmp_path / "scalars" / "rank-1", kind, "loss") == [(7, 0.5)]


def test_supervisor_counts_restarts_exits_and_live_processes_by_role(tmp_path):
    # Prepare
    from hybridfleet.launch.supervisor import ProcessSpec, Supervisor
    from hybridfleet.obs.metrics import process_metrics

    registry = process_metrics().registry

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    before = (value("hybridfleet_supervisor_restarts_total", process_role="probe"),
              value("hybridfleet_supervisor_exits_total", process_role="probe", outcome="failed"))
    spec = ProcessSpec("flaky", [sys.executable, "-c", "raise SystemExit(3)"], max_restarts=3, restart_delay_s=0,
                       role="probe")
    # Execute
    with Supervisor(tmp_path, echo=False) as sup:
        sup.start(spec)
        codes = sup.wait(timeout_s=60)
    # Assert
    assert codes == {"flaky": 3}
    assert value("hybridfleet_supervisor_restarts_total", process_role="probe") - before[0] == 3
    assert value("hybridfleet_supervisor_exits_total", process_role="probe", outcome="failed") - before[1] == 4
    assert value("hybridfleet_supervisor_live_processes", process_role="probe") == 0
