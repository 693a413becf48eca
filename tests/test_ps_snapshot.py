"""Shard snapshots: saved through the checkpoint module, restored after a SIGKILL, workers carry on."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt import list_checkpoints, load_tensors_checkpoint
from hybridfleet.ps.server.shard import ShardState
from hybridfleet.ps.server.snapshot import Snapshotter
from tests.ps_helpers import join_and_init, start_cluster
from tests.test_ps_run import _job
from tests.test_ps_server import encoded, grads


def test_snapshot_restores_params_optimizer_state_and_worker_clocks(tmp_path):
    # Prepare: an Adam shard that applied three pushes, then a snapshot
    cluster = start_cluster(tmp_path, sync="asp", optimizer={"name": "adam", "lr": 0.1})
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        for value in (1.0, -2.0, 0.5):
            client.push(encoded(client, grads(value)), codec="none")
        state = cluster.servers[0].state
        url = f"file://{tmp_path / 'snap'}"
        saved = Snapshotter(state, url, every_steps=1, every_s=None).save()
        # Execute: a fresh shard restores it
        fresh = ShardState(0, cluster.spec.ps, flavour="torch")
        restored = Snapshotter(fresh, url, every_steps=1, every_s=None).restore_newest()
        # Assert
        assert restored == saved == 3
        assert fresh.version == 3 and fresh.members["a-0"].clock == 3
        for key, value in state.params.items():
            np.testing.assert_array_equal(fresh.params[key], value)
        before = {k: v.copy() for k, v in state.params.items()}
        g = {k: np.full(v.size, 0.3, np.float32) for k, v in before.items()}
        for key in before:  # the next Adam step is identical on both: the optimizer state came back too
            state.optimizer.step(key, state.params[key], g[key])
            fresh.optimizer.step(key, fresh.params[key], g[key])
            np.testing.assert_array_equal(fresh.params[key], state.params[key])
        client.close()
    finally:
        cluster.stop()


def test_step_snapshots_are_taken_at_every_multiple_of_every_steps(tmp_path):
    # Prepare: an ASP shard whose snapshotter saves every 3 versions
    cluster = start_cluster(tmp_path, sync="asp")
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        state = cluster.servers[0].state
        snapshotter = Snapshotter(state, f"file://{tmp_path / 'snap'}", every_steps=3, every_s=None, keep_last=10)
        snapshotter.start()
        # Execute: 7 pushes, each applied on arrival, as fast as the client can go
        for value in range(1, 8):
            client.push(encoded(client, grads(float(value))), codec="none")
        deadline = time.monotonic() + 10
        while len(snapshotter.saved) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        snapshotter.stop()
        # Assert: versions 3 and 6 were captured exactly, none other
        assert snapshotter.saved == [3, 6]
        client.close()
    finally:
        cluster.stop()


def test_no_snapshot_means_a_fresh_shard(tmp_path):
    fresh = ShardState(0, start_cluster.__globals__["job_spec"]().ps)
    assert Snapshotter(fresh, f"file://{tmp_path / 'none'}", 1, None).restore_newest() is None
    assert fresh.version == 0 and fresh.plan is None


def test_replay_is_still_rejected_after_a_restore(tmp_path):
    cluster = start_cluster(tmp_path, sync="asp")
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        payloads = encoded(client, grads(1.0))
        client.push(payloads, codec="none")
        state = cluster.servers[0].state
        url = f"file://{tmp_path / 'snap'}"
        Snapshotter(state, url, 1, None).save()
        fresh = ShardState(0, cluster.spec.ps, flavour="torch")
        Snapshotter(fresh, url, 1, None).restore_newest()
        from hybridfleet.ps.wire.reject import Reject

        with pytest.raises(Reject, match="replays an applied step"):
            fresh.push("a-0", "a", "GRADIENT", 1, 1, "none", payloads)
        client.close()
    finally:
        cluster.stop()


@pytest.mark.torch  # trains or probes torch
@pytest.mark.slow
def test_sigkilled_shard_restarts_from_its_snapshot_and_workers_carry_on(tmp_path):
    from hybridfleet.launch.psjob import run_ps_job
    from hybridfleet.ps.worker.status import ShardStatusProbe
    from hybridfleet.spec import load_spec

    job = _job(tmp_path, "digits-hybrid.yaml", max_restarts=1, train__site_baselines=False, train__steps=200,
               ps__snapshot_every_steps=10)
    killed = {}

    def kill_shard(sup, layout):
        def watch():
            from hybridfleet.launch.psjob import snapshot_store
            from hybridfleet.ps.server.snapshot import snapshot_url

            probe = ShardStatusProbe(layout.shard_addresses[0], layout.certs_dir, layout.tokens["admin"])
            url = snapshot_url(snapshot_store(load_spec(job), layout.run_dir), 0)
            deadline = time.monotonic() + 120
            # kill once the version-40 snapshot is written and training has gone past it
            while time.monotonic() < deadline and not (
                    probe.version() >= 45 and any(c.step >= 40 for c in list_checkpoints(url))):
                time.sleep(0.05)
            killed["at_round"] = probe.version()
            sup.kill("shard-0")
            probe.close()

        threading.Thread(target=watch, daemon=True).start()

    summary = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         on_started=kill_shard)
    assert killed["at_round"] >= 45
    assert summary["status"] == "completed", summary
    assert summary["restarts"] == 1
    assert summary["test_accuracy"] >= 0.95
    log = (Path(summary["run_dir"]) / "logs" / "shard-0.log").read_text()
    restored = [json.loads(line) for line in log.splitlines() if '"snapshot_restored"' in line]
    assert len(restored) == 1 and 40 <= restored[0]["version"] <= killed["at_round"]
    assert restored[0]["version"] % 10 == 0  # step snapshots land on multiples of snapshot_every_steps


def test_final_snapshot_writes_the_version_held_and_the_one_a_newer_capture_replaced(tmp_path):
    # Prepare: an ASP shard whose snapshot writer never ran (its thread is not started), so each
    # applied version's capture replaced the one before, as when writing falls behind
    url = f"file://{tmp_path / 'snap'}"
    with _unstarted_snapshotter(tmp_path, url, keep_last=3) as (client, state, snapshotter):
        for value in range(1, 6):
            client.push(encoded(client, grads(float(value))), codec="none")
        assert snapshotter.saved == [] and state.version == 5
        # Execute: the hand-over's stop
        snapshotter.stop(final=True)
        # Assert: versions 4 and 5 (the newest and the one before it) were written, with their own values
        assert snapshotter.saved == [4, 5]
        assert [c.step for c in list_checkpoints(url)] == [4, 5]
        version, tensors, meta = load_tensors_checkpoint(url, step=5)
        assert version == meta["version"] == 5
        for key, value in state.params.items():
            np.testing.assert_array_equal(tensors[f"param/{key}"], value)


def test_a_plain_stop_writes_no_final_snapshot(tmp_path):
    with _unstarted_snapshotter(tmp_path, f"file://{tmp_path / 'snap'}") as (client, state, snapshotter):
        client.push(encoded(client, grads(1.0)), codec="none")
        snapshotter.stop()
        assert snapshotter.saved == [] and not (tmp_path / "snap").exists()


@contextmanager
def _unstarted_snapshotter(tmp_path, url: str, **options):
    """An initialised ASP shard, one client, and a `Snapshotter` (every version, its writer thread not
    started) that each applied version hands its capture to: (client, shard state, snapshotter)."""
    cluster = start_cluster(tmp_path, sync="asp")
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        state = cluster.servers[0].state
        snapshotter = Snapshotter(state, url, every_steps=1, every_s=None, **options)
        state.on_applied = snapshotter._on_applied
        yield client, state, snapshotter
        client.close()
    finally:
        cluster.stop()
