"""The shard count changes while a BSP job trains (2 -> 4 -> 3), and training ends where an
uninterrupted run does.

Shards run as real `hfleet ps serve` processes (TLS + tokens) writing ``shard-<i>.port``; the
hand-over is `hybridfleet.launch.scale.hand_over` (SIGUSR1 to every old shard, the snapshots
re-cut, the new count named in ``shards.json``, new shard processes started), run from a
thread while both workers (threads of this process, each with its own client) keep training.
The reference is the plain script on both workers' batches together, as in the elastic tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import script_optim_helpers as h
from test_ps_elastic import _concat, _framework, _stop, _wait_for
from hybridfleet.launch.scale import ScaleError, ScaleWatcher, check_scale, hand_over, request_scale
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.config import WorkerConfig
from hybridfleet.ps.worker.resolve import current_plan, port_file, port_file_resolver
from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
from hybridfleet.spec import load_spec

STEPS, GROW_AT, SHRINK_AT = 16, 4, 10


def _job_file(tmp_path: Path, framework: str, sync: str = "bsp") -> Path:
    (tmp_path / "train.py").write_text("")
    doc = {"name": "scale", "framework": framework, "entrypoint": "train.py", "sites": {"a": {"workers": 2}},
           "ps": {"shards": 2, "sync": sync, "block_size_bytes": 1024, "snapshot_every_steps": 1,
                  "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 30.0}}
    path = tmp_path / f"job-{sync}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _serve(job: Path, shard: int, shards: int, run_dir: Path, certs: Path, store: str):
    argv = [sys.executable, "-m", "hybridfleet", "ps", "serve", str(job), "--shard", str(shard), "--port", "0",
            "--port-file", str(port_file(run_dir, shard)), "--certs", str(certs), "--snapshot-store", store,
            "--expected-workers", "2", "--shards", str(shards)]
    log = open(run_dir / f"shard-{shard}.{time.monotonic_ns()}.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))


class Cluster:
    """Real shard processes of one job in ``run_dir``; `scale` hands over to another count."""

    def __init__(self, tmp_path: Path, framework: str):
        self.job = _job_file(tmp_path, framework)
        self.certs = tmp_path / "certs"
        make_dev_pki(self.certs)
        generate_signing_key(self.certs)
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.store = f"file://{tmp_path / 'snap'}"
        self.live: list[subprocess.Popen] = []
        self.all: list[subprocess.Popen] = []
        self.start(2)

    def start(self, n: int) -> None:
        self.live = [_serve(self.job, i, n, self.run_dir, self.certs, self.store) for i in range(n)]
        self.all += self.live
        resolve = port_file_resolver(self.run_dir)
        _wait_for(lambda: all(resolve(i) for i in range(n)), f"the port files of {n} shards")

    def hand_over_old(self) -> None:
        for p in self.live:
            p.send_signal(signal.SIGUSR1)
        for p in self.live:
            p.wait(60)
        assert [p.returncode for p in self.live] == [0] * len(self.live), "a shard did not hand over cleanly"

    def scale(self, n: int) -> dict:
        return hand_over(self.run_dir, self.store, len(self.live), n, self.hand_over_old, self.start)

    def config(self, rank: int) -> WorkerConfig:
        spec = load_spec(self.job)
        token = TokenIssuer.from_dir(self.certs).issue(spec.name, "a", "worker", 600, worker=f"a-{rank}")
        sec = ClientSecurity.from_files(str(load_pki(self.certs).ca_cert), token=token)
        resolve = port_file_resolver(self.run_dir)
        return WorkerConfig(job=spec, site="a", rank=rank, site_rank=rank, servers=[resolve(0), resolve(1)],
                            security=sec, shard_port_dir=str(self.run_dir))

    def close(self) -> None:
        for p in self.all:
            _stop(p)


@pytest.fixture
def cluster(tmp_path):
    made: list[Cluster] = []

    def make(framework: str) -> Cluster:
        made.append(Cluster(tmp_path, framework))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.slow
@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "momentum_nesterov", marks=pytest.mark.paddle)])
def test_shard_count_changed_2_4_3_mid_run_ends_equal_to_an_uninterrupted_run(cluster, framework, name):
    # Prepare: the plain script on both workers' batches together, and two real shard processes
    f, hf = _framework(framework)
    ref = f.model()
    opt, sched = f.make(name, ref)
    f.train(ref, opt, sched, map(_concat, zip(h.batches(1, STEPS), h.batches(2, STEPS))))
    c = cluster(framework)
    lock = threading.Lock()  # workers are threads here: one forward/backward at a time (paddle's autograd)
    joined = threading.Barrier(2)
    moves: list[dict] = []
    scalers: list[threading.Thread] = []
    failures: list[BaseException] = []

    def scale_in_background(n: int) -> None:
        def run():
            try:
                moves.append(c.scale(n))
            except BaseException as err:  # reported by the test below
                failures.append(err)

        scalers.append(threading.Thread(target=run))
        scalers[-1].start()

    def on_step(step, _m, _opt):
        """While the workers train on: 2 -> 4 shards at step GROW_AT, 4 -> 3 at SHRINK_AT."""
        if step == GROW_AT:
            scale_in_background(4)
        elif step == SHRINK_AT:
            scalers[0].join(120)
            scale_in_background(3)

    def worker(rank):
        with lock:
            m = f.model()
            opt, sched = f.make(name, m)
        ps = hf.connect(m, opt, config=c.config(rank))
        joined.wait(120)
        f.train(m, opt, sched, h.batches(1 + rank, STEPS), ps=ps, lock=lock, on_step=on_step if rank == 0 else None)
        ps.close()
        return f.values(m)

    # Execute
    got = h.run_workers(worker, 2)
    for t in scalers:
        t.join(120)
    # Assert: both changes happened mid-run, every block placed by the new plans, values as the plain run's
    assert not failures, failures
    assert [(m["from_shards"], m["to_shards"], m["generation"]) for m in moves] == [(2, 4, 1), (4, 3, 2)]
    assert all(0 < m["version"] < STEPS for m in moves) and moves[0]["moved_blocks"] > 0
    assert current_plan(c.run_dir) == (2, 3) and len(c.live) == 3 and all(p.poll() is None for p in c.live)
    h.assert_close(got[0], f.values(ref))
    h.assert_close(got[1], f.values(ref))


def _spec(tmp_path: Path, sync: str = "bsp", **ps):
    spec = load_spec(_job_file(tmp_path, "torch", sync))
    for k, v in ps.items():
        setattr(spec.ps, k, v)
    return spec


@pytest.mark.parametrize("shards", [0, -2, True, "3"])
def test_scale_refuses_a_count_below_one_or_not_an_integer(tmp_path, shards):
    with pytest.raises(ScaleError, match=r"--shards: must be an integer >= 1 .*nothing changed"):
        check_scale(_spec(tmp_path), 2, shards)


@pytest.mark.parametrize("sync", ["asp", "ssp"])
def test_scale_refuses_asp_and_ssp(tmp_path, sync):
    with pytest.raises(ScaleError, match=rf"ps.sync: {sync} cannot change while it trains: only bsp"):
        check_scale(_spec(tmp_path, sync), 2, 4)


def test_scale_to_the_current_count_is_a_no_op_and_a_job_without_snapshots_is_refused(tmp_path):
    assert check_scale(_spec(tmp_path), 2, 2) is False
    with pytest.raises(ScaleError, match="keeps no shard snapshots"):
        check_scale(_spec(tmp_path, snapshot_every_steps=None), 2, 4)
    spec = _spec(tmp_path)
    spec.checkpoint.keep_last = 1
    with pytest.raises(ScaleError, match=r"keeps 1 snapshot per shard \(checkpoint.keep_last\)"):
        check_scale(spec, 2, 4)


def _listing(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_scale_request_refuses_a_folder_that_is_not_a_running_job_and_writes_nothing(tmp_path):
    # Prepare: a plain folder, and the folder of a finished run
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    done = tmp_path / "done"
    (done / "logs").mkdir(parents=True)
    (done / "run.json").write_text("{}")
    (done / "summary.json").write_text("{}")
    before = {d: _listing(d) for d in (plain, done)}
    # Execute / Assert
    with pytest.raises(ScaleError, match="is not the folder of an `hfleet run` job; nothing changed"):
        request_scale(plain, 4)
    with pytest.raises(ScaleError, match="is not running .*nothing changed"):
        request_scale(done, 4)
    assert {d: _listing(d) for d in (plain, done)} == before


def test_scale_watcher_answers_refusals_and_no_ops_without_touching_the_shards(tmp_path):
    # Prepare: a watcher of a running job whose shard callbacks record any call
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    calls: list = []
    watcher = ScaleWatcher(_spec(tmp_path), run_dir, f"file://{tmp_path / 'snap'}",
                           stop_old=lambda n: calls.append(("stop", n)), start_new=lambda n: calls.append(n))
    try:
        # Execute
        answers = [watcher.handle(n) for n in (0, 2, "x")]
    finally:
        watcher.stop()
    # Assert
    assert [a["ok"] for a in answers] == [False, True, False]
    assert "must be an integer >= 1" in answers[0]["error"] and "already" in answers[1]["noop"]
    assert calls == [] and current_plan(run_dir) == (0, None) and watcher.current == 2
    assert not (run_dir / "shards.json").exists()


def test_scale_request_is_answered_by_the_running_supervisors_watcher(tmp_path):
    # Prepare: a run folder with a live watcher (the `hfleet run` side) refusing asp
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    watcher = ScaleWatcher(_spec(tmp_path, "asp"), run_dir, "file:///nowhere", stop_old=lambda n: None,
                           start_new=lambda n: None, poll_s=0.02).start()
    try:
        # Execute
        answer = request_scale(run_dir, 4, timeout_s=30)
    finally:
        watcher.stop()
    # Assert: the refusal came back, the request was consumed, nothing else was written
    assert answer["ok"] is False and "only bsp" in answer["error"]
    assert not (run_dir / "scale-request.json").exists() and not (run_dir / "shards.json").exists()
    assert json.loads((run_dir / "scale-result.json").read_text())["ok"] is False


@pytest.mark.torch
@pytest.mark.slow
def test_a_worker_whose_push_was_applied_pulls_and_one_whose_push_was_not_pushes_it_again(cluster):
    # Prepare: rank 1 is held after its push of step HOLD, before its pull; once the round closed
    # (rank 0 pulled it) the shards hand over 2 -> 4 and rank 1 is let go. Rank 1's push is in the
    # re-cut state (V == b + 1); rank 0's next push is not (V == b)
    f, hf = _framework("torch")
    name, hold = "adamw_amsgrad", 5
    ref = f.model()
    opt, sched = f.make(name, ref)
    f.train(ref, opt, sched, map(_concat, zip(h.batches(1, STEPS), h.batches(2, STEPS))))
    c = cluster("torch")
    lock = threading.Lock()
    joined = threading.Barrier(2)
    at_pull, release = threading.Event(), threading.Event()
    seen: dict[int, list] = {0: [], 1: []}
    moves: list[dict] = []

    def instrument(rank, session):
        wait_and_pull, carry_on, join_new = session._wait_and_pull, session._carry_on_new_plan, session._join_new_plan

        def held_pull(base, wait_round, full=False):
            if rank == 1 and session.step_count == hold and not at_pull.is_set():
                at_pull.set()
                assert release.wait(120), "the hand-over did not finish"
            return wait_and_pull(base, wait_round, full)

        def carry_on_recorded(changed, payloads, base, *rest):
            seen[rank].append(["base", max(base)])
            return carry_on(changed, payloads, base, *rest)

        def join_recorded(changed):
            version = join_new(changed)
            seen[rank][-1] += ["version", version]
            return version

        session._wait_and_pull, session._carry_on_new_plan, session._join_new_plan = (
            held_pull, carry_on_recorded, join_recorded)

    def on_step(step, _m, _opt):
        if step == hold:  # rank 0 pulled the round rank 1's held push closed
            assert at_pull.wait(120)
            moves.append(c.scale(4))
            release.set()

    def worker(rank):
        with lock:
            m = f.model()
            opt, sched = f.make(name, m)
        ps = hf.connect(m, opt, config=c.config(rank))
        instrument(rank, ps.session)
        joined.wait(120)
        f.train(m, opt, sched, h.batches(1 + rank, STEPS), ps=ps, lock=lock, on_step=on_step if rank == 0 else None)
        ps.close()
        return f.values(m)

    # Execute
    got = h.run_workers(worker, 2)
    # Assert: the hand-over was at version `hold`; rank 1 pulled it, rank 0 pushed again; values as the plain run's
    assert [(m["from_shards"], m["to_shards"], m["version"]) for m in moves] == [(2, 4, hold)]
    assert seen[1] == [["base", hold - 1, "version", hold]]
    assert seen[0] == [["base", hold, "version", hold]]
    h.assert_close(got[0], f.values(ref))
    h.assert_close(got[1], f.values(ref))


def test_scale_request_refuses_while_another_is_pending_and_changes_nothing(tmp_path):
    # Prepare: a running job's folder (its supervisor is this process) with a request not yet answered
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    (run_dir / "supervisor.pid").write_text(f"{os.getpid()}\n")
    (run_dir / "scale-request.json").write_text('{"shards": 4, "token": "t"}\n')
    before = _listing(run_dir)
    # Execute / Assert
    with pytest.raises(ScaleError, match="already pending .*nothing changed"):
        request_scale(run_dir, 3)
    assert _listing(run_dir) == before
