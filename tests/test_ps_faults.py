"""Lost connections during bsp or local-SGD training change nothing: the job ends with the
parameters of an uninterrupted run, to the bit, on every worker.

Two workers (threads, each with its own client) train a small model with the script's Adam
through two real TLS shards on the bulk data plane (bsp: the shards step the script's Adam;
local: the workers step it, two steps per outer round, and the shards average). The shards' side of chosen connections fails
the way a lost connection does, at each point of an exchange: a pull's frame cut short while it
is sent, a pull dropped while it waits for its round, a push's payload cut after 100 bytes, and a
push applied whose answer never reaches the worker. The failures are made inside the shard's own
serving code (its send and serve functions wrapped to close the connection at that point); the
connections, TLS, the worker's retries and re-joins are the real ones. Some runs fail one
connection, others several at once or one while the worker recovers from another (the pushes of
one step to both shards cut together, a re-push cut again).
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from hybridfleet.ps.server import bulk_server, downlink
from tests.script_optim_helpers import job, run_workers, start_shards

STEPS = 8
LOCAL_STEPS = 2  # sync local: the workers' steps per outer round
_BUILD = threading.Lock()  # the frameworks' global random state: one model built at a time


def _torch_worker():
    import torch

    import hybridfleet.torch as hf

    def build():
        with _BUILD:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def backward(model, x, y):
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()

    def values(model):
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    return hf.connect, build, backward, values


def _paddle_worker():
    import paddle

    import hybridfleet.paddle as hf

    def build():
        with _BUILD:
            paddle.seed(0)
            model = paddle.nn.Sequential(paddle.nn.Linear(6, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 3))
        return model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())

    def backward(model, x, y):
        paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()

    def values(model):
        return {k: np.array(v.numpy()) for k, v in model.state_dict().items()}

    return hf.connect, build, backward, values


def _batches(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(100 + rank)
    return [(rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int64))
            for _ in range(STEPS)]


def _train(tmp_path, framework: str, sync: str) -> tuple[list[dict], list[int], list[int]]:
    """Train the job; returns each worker's final values and step count, and the shards' versions.
    ``sync`` "secure": bsp under secure aggregation (see `_seeded_masks`)."""
    connect, build, backward, values = (_torch_worker if framework == "torch" else _paddle_worker)()
    local = {"local_steps": LOCAL_STEPS, "optimizer": {"name": "sgd", "lr": 1.0}} if sync == "local" else {}
    if sync == "secure":
        local, sync = {"secure_aggregation": True}, "bsp"
    spec = job(framework, workers=2, shards=2, sync=sync, **local)
    spec.train.steps = STEPS
    shards = start_shards(tmp_path, spec)

    def worker(rank):
        model, opt = build()
        ps = connect(model, opt, shards.config(rank))
        for x, y in _batches(rank)[ps.step_count:]:
            ps.zero_grad()
            backward(model, x, y)
            ps.step()
        result = values(model), ps.step_count
        ps.close()
        return result

    try:
        out = run_workers(worker, 2, timeout_s=60)
        return [v for v, _ in out], [n for _, n in out], [s["version"] for s in shards.status()]
    finally:
        shards.stop()


class _FailingConn:
    """A shard's connection that fails as a lost one does: ``on_send`` may raise before bytes go
    out; with ``recv_limit`` reading stops with a reset after that many bytes."""

    def __init__(self, conn, on_send=None, recv_limit: int | None = None):
        self._conn, self._on_send, self._left = conn, on_send, recv_limit

    def __getattr__(self, name):
        if name == "recv_exact_into" and self._left is not None:
            raise AttributeError(name)  # read piece by piece through recv_into below
        return getattr(self._conn, name)

    def sendall(self, data):
        if self._on_send is not None:
            self._on_send(data)
        return self._conn.sendall(data)

    def recv_into(self, view, n: int = 0):
        n = min(n or len(view), self._left)
        if n <= 0:
            raise ConnectionResetError("connection reset (test)")
        whole = getattr(self._conn, "recv_exact_into", None)
        if whole is not None:
            whole(view[:n])
            got = n
        else:
            got = self._conn.recv_into(view, n)
        self._left -= got
        return got


def _fail_connections(monkeypatch, cut_pulls=(), waiting_pulls=(), cut_pushes=(), lost_answers=()) -> list:
    """Make the shards fail the n-th pull sent / pull served / push served (1-based, counted over
    both shards) as listed; returns the list of failures made."""
    made: list[tuple[str, int]] = []
    count = {"sent": 0, "served": 0, "push": 0}
    send_values, serve_pull, serve_push = downlink.send_values, bulk_server.BulkServer._serve_pull, \
        bulk_server.BulkServer._serve_push

    def sending(sendall, items):
        pieces = [p for _, chunk, _, _ in items for p in chunk if len(p)]
        if pieces:
            count["sent"] += 1
            if count["sent"] in cut_pulls:
                made.append(("pull cut", count["sent"]))
                sendall(pieces[0][:max(len(pieces[0]) // 2, 1)])
                raise downlink.ValuesChanged("pull cut (test)")
        return send_values(sendall, items)

    def serving_pull(self, conn, header_bytes, token, park):
        count["served"] += 1
        if count["served"] in waiting_pulls:
            made.append(("waiting pull dropped", count["served"]))
            raise ConnectionResetError("connection reset (test)")
        return serve_pull(self, conn, header_bytes, token, park)

    def serving_push(self, conn, fd, header_bytes, token):
        count["push"] += 1
        n = count["push"]
        if n in lost_answers:
            def lose(_data):
                made.append(("push answer lost", n))
                raise ConnectionResetError("connection reset (test)")

            return serve_push(self, _FailingConn(conn, on_send=lose), fd, header_bytes, token)
        if n in cut_pushes:
            made.append(("push cut", n))
            return serve_push(self, _FailingConn(conn, recv_limit=100), fd, header_bytes, token)
        return serve_push(self, conn, fd, header_bytes, token)

    monkeypatch.setattr(bulk_server, "send_values", sending)
    monkeypatch.setattr(bulk_server.BulkServer, "_serve_pull", serving_pull)
    monkeypatch.setattr(bulk_server.BulkServer, "_serve_push", serving_push)
    return made


def _fail_secure_calls(monkeypatch, made: list, lost_shares=(), dropped_unmasks=(), lost_reveals=(),
                       dropped_reveals=()) -> None:
    """Under secure aggregation, make the shards fail the n-th Shares / Unmask / Reveal call (1-based,
    counted over both shards) as a lost connection does: Shares and Reveal taken in whose answer is
    lost, an Unmask request dropped while it waits, a Reveal dropped before it arrives. The worker
    sees UNAVAILABLE, as when the connection breaks, and re-joins."""
    from hybridfleet.ps.secagg.service import SecAggServicer

    count = {"Shares": 0, "Unmask": 0, "Reveal": 0}
    lose = {"Shares": set(lost_shares), "Unmask": set(), "Reveal": set(lost_reveals)}  # taken in, answer lost
    drop = {"Shares": set(), "Unmask": set(dropped_unmasks), "Reveal": set(dropped_reveals)}  # never taken in

    def failing(name):
        real = getattr(SecAggServicer, name)

        def call(self, request, context):
            count[name] += 1
            n = count[name]
            if n in drop[name]:
                made.append((f"{name.lower()} dropped", n))
            elif n in lose[name]:
                real(self, request, context)
                made.append((f"{name.lower()} answer lost", n))
            else:
                return real(self, request, context)
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost (test)")

        return call

    for name in count:
        monkeypatch.setattr(SecAggServicer, name, failing(name))


def _mixed(seed: int) -> dict:
    """Several failures of every kind at random points of the run."""
    rng = np.random.default_rng(seed)

    def pick(lo, k):
        return set(rng.choice(np.arange(lo, 36), k, replace=False).tolist())

    answers = pick(3, 4)
    return {"cut_pulls": pick(1, 6), "waiting_pulls": pick(1, 4), "lost_answers": answers,
            "cut_pushes": pick(3, 4) - answers}


def _mixed_secure(seed: int) -> dict:
    """Several failures of each secure aggregation call at random points of the run (4 of each per round)."""
    rng = np.random.default_rng(1000 + seed)

    def pick(k):
        return set(rng.choice(np.arange(1, 33), k, replace=False).tolist())

    reveals = pick(4)
    return {"lost_shares": pick(3), "dropped_unmasks": pick(3), "lost_reveals": set(sorted(reveals)[:2]),
            "dropped_reveals": set(sorted(reveals)[2:])}


# pushes 1-2 are the initial values (one per shard); 3-6 are round 1's (both workers to both shards)
CASES = {
    "pull cut while sent": {"cut_pulls": {3}},
    "pull dropped while it waits for its round": {"waiting_pulls": {6}},
    "push payload cut": {"cut_pushes": {4}},
    "push answer lost": {"lost_answers": {3}},
    "the start's pull dropped": {"waiting_pulls": {1}},
    "one step's pushes to both shards cut": {"cut_pushes": {5, 6}},
    "a push cut and its re-push cut again": {"cut_pushes": {7, 9, 10, 11}},
    **{f"mixed {seed}": _mixed(seed) for seed in (0, 1, 6, 9, 57)},
}
SECURE_CASES = {
    "shares answer lost": {"lost_shares": {2}},
    "unmask request dropped while it waits": {"dropped_unmasks": {3}},
    "reveal answer lost": {"lost_reveals": {1}},
    "reveal dropped before it arrives": {"dropped_reveals": {2}},
    "every secure call of one step fails once": {"lost_shares": {5}, "dropped_unmasks": {6}, "lost_reveals": {7},
                                                  "dropped_reveals": {8}},
    **{f"mixed secure {seed}": {**_mixed(seed), **_mixed_secure(seed)} for seed in (0, 6)},
}
RUNS = [("bsp", case) for case in CASES] + \
       [("local", case) for case in ("push answer lost", "one step's pushes to both shards cut", "mixed 0", "mixed 6")] + \
       [("secure", case) for case in [*CASES, *SECURE_CASES]]


def _seeded_masks(monkeypatch) -> None:
    """Secure aggregation quantises each update with random rounding; seeded per worker and shard,
    the draws are the same in every run, so a run with failures must end at the uninterrupted run's
    parameters to the bit (the masks cancel exactly in the ring, whatever their seeds)."""
    from hybridfleet.ps.secagg import pusher

    init = pusher.ShardMasker.__init__

    def seeded(self, me, shard, settings, rng=None):
        init(self, me, shard, settings, np.random.default_rng([int(me.rsplit("-", 1)[1]), shard]))

    monkeypatch.setattr(pusher.ShardMasker, "__init__", seeded)


@pytest.fixture(scope="module")
def uninterrupted():
    """(framework, sync) -> the uninterrupted run's (values, steps, versions), made by the first test
    that needs it."""
    return {}


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
@pytest.mark.parametrize("sync,case", RUNS)
def test_lost_connections_leave_the_job_as_an_uninterrupted_run_would(tmp_path, monkeypatch, uninterrupted,
                                                                     framework, sync, case):
    # Prepare: the uninterrupted run's result (once per framework and mode), then failing connections
    rounds = STEPS // LOCAL_STEPS if sync == "local" else STEPS
    if sync == "secure":
        _seeded_masks(monkeypatch)
    if (framework, sync) not in uninterrupted:
        uninterrupted[framework, sync] = _train(tmp_path / "uninterrupted", framework, sync)
    clean, steps, versions = uninterrupted[framework, sync]
    assert steps == [STEPS, STEPS] and versions == [rounds, rounds]
    expected = clean[0]
    faults = dict({**CASES, **SECURE_CASES}[case])
    secure = {k: faults.pop(k) for k in ("lost_shares", "dropped_unmasks", "lost_reveals", "dropped_reveals")
              if k in faults}
    made = _fail_connections(monkeypatch, **faults)
    _fail_secure_calls(monkeypatch, made, **secure)
    # Execute
    values, steps, versions = _train(tmp_path / "failing", framework, sync)
    # Assert: the failures happened; every worker took every step once, the shards closed every
    # round once, and both workers hold the uninterrupted run's parameters exactly
    assert made
    assert steps == [STEPS, STEPS] and versions == [rounds, rounds]
    for got in [*clean, *values]:
        assert set(got) == set(expected)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{case}: {name}")
