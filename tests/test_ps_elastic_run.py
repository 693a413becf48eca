"""`hfleet run` with shards that change: a shard lost for good at its address comes back at a new one,
and a resumed run re-cuts the snapshots for another shard count."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml

from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from tests.test_ps_run import _job


def _hold(port: int, timeout_s: float = 10.0) -> socket.socket:
    """Bind ``port`` as soon as the killed shard's socket is gone (before its restart can)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


@pytest.mark.torch  # trains torch
@pytest.mark.slow
def test_shard_whose_address_is_taken_after_a_sigkill_comes_back_at_a_new_port_and_workers_follow(tmp_path):
    # Prepare
    from hybridfleet.ps.worker.status import ShardStatusProbe

    job = _job(tmp_path, "digits-hybrid.yaml", max_restarts=1, train__site_baselines=False, train__steps=120,
               ps__snapshot_every_steps=1)
    held: dict = {}

    def take_shard_0s_address(sup, layout):
        def watch():
            probe = ShardStatusProbe(layout.shard_addresses[0], layout.certs_dir, layout.tokens["admin"])
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and probe.version() < 30:
                time.sleep(0.05)
            probe.close()
            held["address"] = layout.shard_addresses[0]
            sup.kill("shard-0")
            held["socket"] = _hold(int(held["address"].rsplit(":", 1)[1]))

        threading.Thread(target=watch, daemon=True).start()

    # Execute
    try:
        summary = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                             on_started=take_shard_0s_address, report=False)
    finally:
        if "socket" in held:
            held["socket"].close()
    # Assert: the restarted shard served elsewhere and the workers trained on with it
    run_dir = Path(summary["run_dir"])
    assert summary["status"] == "completed", summary
    assert summary["restarts"] == 1
    assert summary["test_accuracy"] >= 0.9  # 120 steps (shrunk from the example's 200)
    assert (run_dir / "shard-0.port").read_text().strip() != held["address"]
    log = (run_dir / "logs" / "shard-0.log").read_text()
    assert '"shard_replaced_at_new_port"' in log
    workers = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log") if not p.name.startswith("shard"))
    assert '"shard_moved"' in workers


@pytest.mark.torch
@pytest.mark.slow
def test_resume_with_three_shards_recuts_a_two_shard_runs_snapshots(tmp_path):
    # Prepare: a finished two-shard run
    job = _job(tmp_path, "digits-deploy.yaml", checkpoint={"store": f"file://{tmp_path / 'store'}"},
               train__steps=40, train__site_baselines=False, train__eval_every_steps=20)
    runs = tmp_path / "runs"
    first = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=runs, report=False)
    assert first["status"] == "completed", first
    data = yaml.safe_load(job.read_text())
    data["ps"]["shards"] = 3
    job.write_text(yaml.safe_dump(data))
    # Execute
    resumed = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=runs, report=False,
                         resume_from=Path(first["run_dir"]))
    # Assert: all three shards restored one version, re-cut from the two shards' snapshots
    assert resumed["status"] == "completed", resumed
    assert resumed["test_accuracy"] >= 0.8
    logs = Path(resumed["run_dir"]) / "logs"
    versions = set()
    for shard in range(3):
        lines = (logs / f"shard-{shard}.log").read_text().splitlines()
        restored = [json.loads(line) for line in lines if '"snapshot_restored"' in line]
        assert len(restored) == 1, f"shard {shard} restored {len(restored)} snapshot(s)"
        versions.add(restored[0]["version"])
    assert len(versions) == 1 and versions.pop() > 0


def _final_model(summary: dict) -> dict:
    from hybridfleet.ckpt import load_tensors_checkpoint

    _, tensors, _ = load_tensors_checkpoint(summary["model"]["url"], step=summary["model"]["final_step"])
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("example", [pytest.param("digits-hybrid.yaml", marks=pytest.mark.torch),
                                     pytest.param("digits-hybrid-paddle.yaml", marks=pytest.mark.paddle)])
def test_hfleet_ps_scale_changes_a_running_jobs_shards_2_4_3_and_training_ends_as_without(tmp_path, example):
    # Prepare: the same shrunk digits job run uninterrupted and with `hfleet ps scale` twice mid-run
    import numpy as np
    from typer.testing import CliRunner

    from hybridfleet.cli.app import app
    from hybridfleet.ps.worker.status import ShardStatusProbe

    # 100 steps: after the first change (at version 10, a hand-over of 1-2 s) the job must still
    # be short of version 25 and then run long enough for a 0.2 s poll to see it there; with 40
    # steps a fast host finished the last 30 in 1.3 s, before the poll saw 25
    steps = 100
    job = _job(tmp_path, example, train__site_baselines=False, train__steps=steps,
               train__eval_every_steps=steps, checkpoint={"every_steps": steps, "keep_last": 2},
               registry={}, ps__snapshot_every_steps=1)
    plain = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "plain",
                       report=False, metrics=False)
    answers: list = []
    scaler: list[threading.Thread] = []

    def scale_twice(sup, layout):
        def version_now() -> int:
            """Shard 0's version; -1 while it cannot say (its port file is rewritten by a hand-over)."""
            try:
                probe = ShardStatusProbe((layout.run_dir / "shard-0.port").read_text().strip(), layout.certs_dir,
                                         layout.tokens["admin"])
            except OSError:
                return -1
            try:
                return probe.version()
            except Exception:
                return -1
            finally:
                probe.close()

        def at(version: int, shards: int) -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and version_now() < version:
                time.sleep(0.2)
            result = CliRunner().invoke(app, ["ps", "scale", str(layout.run_dir), "--shards", str(shards)])
            answers.append((result.exit_code, result.output, repr(result.exception)))

        scaler.append(threading.Thread(target=lambda: (at(10, 4), at(25, 3)), daemon=True))
        scaler[0].start()

    # Execute
    scaled = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "scaled",
                        on_started=scale_twice, report=False, metrics=False)
    scaler[0].join(60)  # the second answer may be read just after the job ends
    # Assert: both changes were answered mid-run, three shards ended the job, the model is the plain run's
    assert plain["status"] == "completed" and scaled["status"] == "completed", scaled
    assert [code for code, _, _ in answers] == [0, 0], answers
    moved = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in answers]
    assert [(m["from_shards"], m["to_shards"]) for m in moved] == [(2, 4), (4, 3)]
    run_dir = Path(scaled["run_dir"])
    assert json.loads((run_dir / "shards.json").read_text()) == {"generation": 2, "shards": 3}
    want, got = _final_model(plain), _final_model(scaled)
    assert set(want) == set(got) and scaled["model"]["final_step"] == plain["model"]["final_step"] == steps
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
