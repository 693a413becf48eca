"""A run's processes bind their own metrics ports and the run lists what they bound.

The launcher once picked a free port per process, released it, and handed it over: a shard's
gRPC server (bound to port 0) was given the port picked for the other shard's metrics, and that
shard exited three times with "metrics port N is in use". Here real processes bind port 0
themselves, write the port to their file, and `RunTargets` lists exactly those ports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hybridfleet.launch.supervisor import ProcessSpec
from hybridfleet.launch.targets import RunTargets
from hybridfleet.obs.discovery import Target, read_targets

REPO = Path(__file__).resolve().parents[1]
SERVE = ("import sys, time\nfrom hybridfleet.obs.metrics import serve_from_env\n"
         "print(serve_from_env(), flush=True)\ntime.sleep(60)\n")


def _serve(p: ProcessSpec) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, **p.env, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", SERVE], env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip().isdigit(), line
    return proc, int(line)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def procs():
    return [ProcessSpec(name="shard-0", argv=["x"], role="shard"),
            ProcessSpec(name="shard-1", argv=["x"], role="shard"),
            ProcessSpec(name="worker-hospital-0", argv=["x"], role="worker",
                        env={"HFLEET_SITE": "hospital", "HFLEET_RANK": "0"})]


def test_each_process_binds_its_own_metrics_port_and_the_run_lists_exactly_those(tmp_path, procs):
    # Prepare
    own = Target("127.0.0.1:1", {"job": "ports", "role": "supervisor", "process": "hfleet-run"})
    targets = [own]
    run = RunTargets("ports", tmp_path, targets)
    run.attach(procs)
    running = []
    try:
        # Execute
        assert run.refresh() is True  # the run's own target, before any process reported
        assert read_targets(tmp_path) == [own]
        running = [_serve(p) for p in procs]
        changed = run.refresh()
        # Assert
        assert changed is True and run.refresh() is False  # written once per change
        assert all(p.env["HFLEET_METRICS_PORT"] == "0" for p in procs)  # nothing picked for them
        ports = [port for _, port in running]
        assert len(set(ports)) == 3
        assert [t.address for t in targets] == ["127.0.0.1:1", *(f"127.0.0.1:{port}" for port in ports)]
        assert read_targets(tmp_path) == targets
        assert targets[1].labels == {"job": "ports", "role": "shard", "process": "shard-0", "rank": "0"}
        assert targets[3].labels == {"job": "ports", "role": "worker", "process": "worker-hospital-0",
                                     "site": "hospital", "rank": "0"}
        for t in targets[1:]:
            with urllib.request.urlopen(f"http://{t.address}/metrics", timeout=5) as resp:
                assert resp.status == 200 and b"# HELP" in resp.read()
    finally:
        for proc, _ in running:
            _stop(proc)


def test_a_restarted_process_keeps_its_port_while_free_and_its_target_follows_a_new_one(tmp_path, procs):
    # Prepare
    targets: list[Target] = []
    run = RunTargets("ports", tmp_path, targets)
    run.attach(procs[:1])
    proc, first = _serve(procs[0])
    _stop(proc)
    # Execute: restarted with the port free, then with another process holding it
    proc, again = _serve(procs[0])
    _stop(proc)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        proc, moved = _serve(procs[0])
        try:
            run.refresh()
            listed = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
        finally:
            _stop(proc)
    # Assert
    assert again == first
    assert moved != first
    assert [t.address for t in targets] == [f"127.0.0.1:{moved}"]
    assert listed == [{"targets": [f"127.0.0.1:{moved}"], "labels": targets[0].labels}]


def test_a_process_that_has_not_served_yet_is_not_listed_and_a_bad_port_file_is_ignored(tmp_path, procs):
    # Prepare
    targets: list[Target] = []
    run = RunTargets("ports", tmp_path, targets)
    run.attach(procs)
    run.port_file("shard-0").parent.mkdir(parents=True)
    run.port_file("shard-0").write_text("not a port\n")
    run.port_file("shard-1").write_text("70000\n")
    # Execute
    run.refresh()
    # Assert
    assert targets == [] and read_targets(tmp_path) == []
