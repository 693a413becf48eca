"""A shard lost for good is replaced by a new process at a new address, and BSP training stays exact.

Shards run as real `hfleet ps serve` processes (TLS + tokens) writing ``shard-<i>.port``;
the victim is SIGKILLed and its port is held so it can never come back there; the
replacement restores the newest snapshot and workers (threads of this process, each with
its own client) follow the port file to it. The reference is the plain script on both
workers' batches together, as in the script-optimizer equivalence tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import script_optim_helpers as h
from hybridfleet.ckpt import list_checkpoints
from hybridfleet.ps.server.snapshot import snapshot_url
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.config import WorkerConfig
from hybridfleet.ps.worker.resolve import port_file, port_file_resolver
from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
from hybridfleet.spec import load_spec

STEPS, KILL_AT = 16, 6


def _job_file(tmp_path: Path, framework: str, snapshot_every: int | None = 1, **ps) -> Path:
    (tmp_path / "train.py").write_text("")
    doc = {"name": "elastic", "framework": framework, "entrypoint": "train.py", "sites": {"a": {"workers": 2}},
           "ps": {"shards": 2, "sync": "bsp", "block_size_bytes": 1024, "snapshot_every_steps": snapshot_every,
                  "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 30.0, **ps}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _serve(job: Path, shard: int, run_dir: Path, certs: Path, store: str, env: dict | None = None):
    argv = [sys.executable, "-m", "hybridfleet", "ps", "serve", str(job), "--shard", str(shard), "--port", "0",
            "--port-file", str(port_file(run_dir, shard)), "--certs", str(certs), "--snapshot-store", store,
            "--expected-workers", "2"]
    log = open(run_dir / f"shard-{shard}.{time.monotonic_ns()}.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (if still running), then SIGKILL what has not exited after 30 s (a loaded machine)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _wait_for(predicate, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def elastic_cluster(tmp_path):
    """Start the two shard processes of a framework's job (each cluster its own process list, which
    a replacement joins); stops every process it started."""
    clusters: list[list[subprocess.Popen]] = []
    held: list[socket.socket] = []

    def start(framework: str, snapshot_every: int | None = 1, root: str = "", **ps):
        """``root``: a folder of its own under the test's, for a second cluster in one test."""
        base = tmp_path / root
        base.mkdir(exist_ok=True)
        job = _job_file(base, framework, snapshot_every, **ps)
        certs = base / "certs"
        make_dev_pki(certs)
        generate_signing_key(certs)
        run_dir = base / "run"
        run_dir.mkdir()
        store = f"file://{base / 'snap'}"
        procs = [_serve(job, i, run_dir, certs, store) for i in range(2)]
        clusters.append(procs)
        resolve = port_file_resolver(run_dir)
        _wait_for(lambda: all(resolve(i) for i in range(2)), "the shards' port files")
        return job, certs, run_dir, store, procs, held

    yield start
    every = [p for procs in clusters for p in procs]
    for p in every:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in every:
        _stop(p)
    for s in held:
        s.close()


@pytest.fixture(scope="module")
def secure_runs():
    """framework -> an uninterrupted run's values under secure aggregation, made by the first test that needs it."""
    return {}


def _config(job: Path, certs: Path, run_dir: Path, rank: int) -> WorkerConfig:
    spec = load_spec(job)
    token = TokenIssuer.from_dir(certs).issue(spec.name, "a", "worker", 600, worker=f"a-{rank}")
    sec = ClientSecurity.from_files(str(load_pki(certs).ca_cert), token=token)
    resolve = port_file_resolver(run_dir)
    return WorkerConfig(job=spec, site="a", rank=rank, site_rank=rank, servers=[resolve(0), resolve(1)],
                        security=sec, shard_port_dir=str(run_dir))


def _framework(name: str):
    import importlib

    return importlib.import_module(f"script_optim_{name}"), importlib.import_module(f"hybridfleet.{name}")


def _concat(parts):
    import numpy as np

    return tuple(np.concatenate(p) for p in zip(*parts))


def _train_killing_shard_0(f, hf, name: str, cluster, snapshot_of: int | None, both_waiting: bool = False):
    """Two workers (threads, each with its own client) train STEPS steps; at the start of step KILL_AT
    rank 0 SIGKILLs shard 0, holds its port so it never comes back there and starts its replacement
    (once the snapshot of version ``snapshot_of``, if any, is in the store; ``both_waiting``: while
    rank 1 waits at the start of the same step, so both learn of the replacement in that step's push).
    Returns each worker's final values, their frontends and the address shard 0 had."""
    job, certs, run_dir, store, procs, held = cluster
    old_address = port_file_resolver(run_dir)(0)
    lock = threading.Lock()  # workers are threads here: one forward/backward at a time (paddle's autograd)
    joined = threading.Barrier(2)  # both in the quorum before the first round (a slow start is no dropout)
    at_kill, killed = threading.Barrier(2), threading.Barrier(2)
    frontends = [None, None]

    def kill_shard_0(step, _m, _opt):
        if step != KILL_AT:
            return
        if both_waiting:
            at_kill.wait(120)
        if snapshot_of is not None:
            url = snapshot_url(store, 0)
            _wait_for(lambda: any(c.step == snapshot_of for c in list_checkpoints(url)), f"the snapshot of {snapshot_of}")
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        held.append(socket.create_server(("127.0.0.1", int(old_address.rsplit(":", 1)[1]))))
        port_file(run_dir, 0).unlink()
        procs.append(_serve(job, 0, run_dir, certs, store))
        if both_waiting:
            killed.wait(120)

    def wait_for_the_kill(step, _m, _opt):
        if step == KILL_AT and both_waiting:
            at_kill.wait(120)
            killed.wait(120)

    def worker(rank):
        with lock:
            m = f.model()
            opt, sched = f.make(name, m)
        ps = frontends[rank] = hf.connect(m, opt, config=_config(job, certs, run_dir, rank))
        joined.wait(120)
        f.train(m, opt, sched, h.batches(1 + rank, STEPS), ps=ps, lock=lock,
                on_step=kill_shard_0 if rank == 0 else wait_for_the_kill)
        ps.close()
        return f.values(m)

    return h.run_workers(worker, 2), frontends, old_address


@pytest.mark.slow
@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "momentum_nesterov", marks=pytest.mark.paddle)])
def test_sigkilled_shard_replaced_at_a_new_address_ends_equal_to_an_uninterrupted_run(elastic_cluster, framework,
                                                                                       name):
    # Prepare: the plain script on both workers' batches together, and two real shard processes
    f, hf = _framework(framework)
    ref = f.model()
    opt, sched = f.make(name, ref)
    f.train(ref, opt, sched, map(_concat, zip(h.batches(1, STEPS), h.batches(2, STEPS))))
    cluster = elastic_cluster(framework)
    _, _, run_dir, _, procs, _ = cluster

    # Execute: shard 0 killed with KILL_AT rounds applied and their snapshot written
    got, _, old_address = _train_killing_shard_0(f, hf, name, cluster, snapshot_of=KILL_AT)

    # Assert: the replacement served from a new address and training ended where the plain script did
    new_address = port_file_resolver(run_dir)(0)
    assert new_address and new_address != old_address
    assert procs[0].returncode == -signal.SIGKILL and procs[-1].poll() is None
    h.assert_close(got[0], f.values(ref))
    h.assert_close(got[1], f.values(ref))


@pytest.mark.slow
@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "momentum_nesterov", marks=pytest.mark.paddle)])
@pytest.mark.parametrize("both_waiting", [True, False], ids=["both-in-the-push", "anywhere"])
def test_under_secure_aggregation_a_replaced_shard_gets_every_workers_step_again(elastic_cluster, secure_runs,
                                                                                  monkeypatch, framework, name,
                                                                                  both_waiting, capfd):
    """The replacement restores the round but no keys: each worker advertises a fresh key to it and
    pushes the step there again, masked anew, and the shard that stayed up gets it once (a worker
    that saw the restart while masking had pushed it nowhere yet). No round lacks a worker, so
    every round is unmasked and training ends where an uninterrupted secure run does, up to the
    random rounding of the step masked again (a step lost or doubled moves the values ~1e-3)."""
    # Prepare: an uninterrupted run under secure aggregation (once per framework), then two real shard processes
    f, hf = _framework(framework)
    if framework not in secure_runs:
        with monkeypatch.context() as never:
            never.setattr(sys.modules[__name__], "KILL_AT", STEPS + 1)
            clean = elastic_cluster(framework, root="uninterrupted", secure_aggregation=True)
            secure_runs[framework] = _train_killing_shard_0(f, hf, name, clean, snapshot_of=None)[0][0]
    cluster = elastic_cluster(framework, root="killed", secure_aggregation=True)
    _, _, run_dir, _, procs, _ = cluster
    capfd.readouterr()

    # Execute: shard 0 killed with KILL_AT rounds applied and their snapshot written
    got, frontends, _ = _train_killing_shard_0(f, hf, name, cluster, snapshot_of=KILL_AT, both_waiting=both_waiting)

    # Assert: every step of both workers went into every shard's rounds, masked again for the replacement
    assert [ps.session.step_count for ps in frontends] == [STEPS, STEPS]
    assert procs[-1].poll() is None  # the replacement serves
    replacement = "".join(p.read_text() for p in run_dir.glob("shard-0.*.log"))
    logs = capfd.readouterr()
    assert '"event":"secagg_failed"' not in logs.out + logs.err + replacement
    assert (logs.out + logs.err).count('"event":"secagg_step_finished","shard":0') >= 2  # each worker, anew
    for k in got[0]:
        assert (got[0][k] == got[1][k]).all(), k
    h.assert_close(got[0], secure_runs[framework], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "momentum_nesterov", marks=pytest.mark.paddle)])
def test_a_replacement_holding_an_older_snapshot_loses_those_rounds_and_training_goes_on(elastic_cluster, framework,
                                                                                         name, capfd):
    # Prepare: snapshots every 4 rounds, so the replacement of a shard killed with 6 rounds applied
    # restores version 4 (the third row of docs/SCALE.md's table)
    f, hf = _framework(framework)
    cluster = elastic_cluster(framework, snapshot_every=4)
    run_dir, procs = cluster[2], cluster[4]

    # Execute: the kill while both workers wait at the start of step KILL_AT (see docs/SCALE.md for
    # workers that learn of it in different steps)
    got, frontends, _ = _train_killing_shard_0(f, hf, name, cluster, snapshot_of=4, both_waiting=True)

    # Assert: every step ran, the lost rounds were said, and both workers hold the same parameters
    logs = capfd.readouterr()
    assert procs[0].returncode == -signal.SIGKILL
    assert any('"event":"snapshot_restored","shard":0,"version":4' in p.read_text() for p in run_dir.glob("shard-0.*.log"))
    assert '"event":"shard_restarted"' in logs.out + logs.err
    assert [ps.session.step_count for ps in frontends] == [STEPS, STEPS]
    h.assert_close(got[0], got[1])


@pytest.mark.slow
@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "momentum_nesterov", marks=pytest.mark.paddle)])
def test_a_replacement_without_any_snapshot_is_given_the_workers_values_and_training_goes_on(elastic_cluster,
                                                                                             framework, name, capfd):
    # Prepare: a job without snapshots, so shard 0's replacement comes back holding no parameters
    f, hf = _framework(framework)
    cluster = elastic_cluster(framework, snapshot_every=None)
    run_dir, procs = cluster[2], cluster[4]

    # Execute: the kill while both workers wait at the start of step KILL_AT
    got, frontends, _ = _train_killing_shard_0(f, hf, name, cluster, snapshot_of=None, both_waiting=True)

    # Assert: the initialising worker gave the replacement its values of version KILL_AT, which the
    # shard went on from, and both pushed step KILL_AT to it again; every step ran and both workers
    # hold the same parameters
    logs = capfd.readouterr()
    replacement = max(run_dir.glob("shard-0.*.log"), key=lambda p: int(p.name.split(".")[1])).read_text()
    assert procs[0].returncode == -signal.SIGKILL
    assert '"event":"snapshot_restored"' not in replacement
    assert f'"event":"shard_initialised_again","shard":0,"worker":"a-0","version":{KILL_AT}' in replacement
    assert '"event":"shard_initialised_again","worker":"a-0","shard":0' in logs.out + logs.err
    assert (logs.out + logs.err).count('"event":"pushed_again"') == 2  # each worker's step KILL_AT, as from a snapshot
    assert [ps.session.step_count for ps in frontends] == [STEPS, STEPS]
    h.assert_close(got[0], got[1])


def test_restarted_shard_whose_port_is_taken_serves_on_a_new_port_and_says_so_in_its_port_file(tmp_path):
    # Prepare: a port file naming a port another process holds, as a restarted shard finds it
    job = _job_file(tmp_path, "torch")
    certs = tmp_path / "certs"
    make_dev_pki(certs)
    generate_signing_key(certs)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as holder:
        taken = holder.getsockname()[1]
        port_file(run_dir, 0).write_text(f"127.0.0.1:{taken}\n")
        # Execute
        proc = _serve(job, 0, run_dir, certs, f"file://{tmp_path / 'snap'}", env={"HFLEET_RESTART_COUNT": "1"})
        try:
            _wait_for(lambda: port_file_resolver(run_dir)(0) != f"127.0.0.1:{taken}" or proc.poll() is not None,
                      "the shard's new port file")
            # Assert
            assert proc.poll() is None, "the shard exited instead of serving on a new port"
            host, port = port_file_resolver(run_dir)(0).rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) != taken
            socket.create_connection((host, int(port)), timeout=5).close()
        finally:
            _stop(proc)


def test_port_file_resolver_names_no_address_while_a_file_is_missing_or_not_host_port(tmp_path):
    resolve = port_file_resolver(tmp_path)
    assert resolve(0) is None
    port_file(tmp_path, 0).write_text("127.0.0.1:")
    assert resolve(0) is None
    port_file(tmp_path, 0).write_text("garbage\n")
    assert resolve(0) is None
    port_file(tmp_path, 1).write_text("127.0.0.1:5555\n")
    assert resolve(1) == "127.0.0.1:5555"
