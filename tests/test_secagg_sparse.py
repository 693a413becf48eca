"""SecAgg+ over a sparse graph: 20 pushers of degree 8 against a real TLS + token shard.

The sum is the plain sum within the quantisation bound; pushers that drop within the
threshold are unmasked out from their neighbours' pair seeds alone; more dropouts among
one pusher's share holders stop the round with the cause and change no parameter; and
what the shard can strip off one push still leaves its neighbours' pair masks on it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from scipy import stats

from hybridfleet.errors import ProtocolError
from hybridfleet.ps.secagg import server as server_mod
from hybridfleet.ps.secagg.masks import prg

from ps_helpers import start_cluster
from secagg_helpers import Pusher, init, run_round, updates

N, DEGREE = 20, 8
SITES = {f"s{i:02d}": {"workers": 1} for i in range(N)}


@pytest.fixture
def sparse(tmp_path, monkeypatch):
    seen: dict[str, list[np.ndarray]] = {}  # every ring vector the shard received, by pusher
    add = server_mod.MaskedRound.add

    def recording(self, contributor, update, weight=1):
        seen.setdefault(contributor, []).append(update["ring"].copy())
        return add(self, contributor, update, weight)

    monkeypatch.setattr(server_mod.MaskedRound, "add", recording)
    cluster = start_cluster(tmp_path, expected_workers=N, sites=SITES, secure_aggregation={"degree": DEGREE},
                            optimizer={"name": "sgd", "lr": 1.0})
    pushers = [Pusher(cluster, s) for s in SITES]
    init(cluster, pushers)
    yield cluster, pushers, seen
    cluster.stop()


def _drop_before_pushing(pusher: Pusher) -> None:
    """``pusher`` masks and sends its shares for the open round, then leaves before pushing."""
    pusher.secure._mask_one(0, pusher.client.versions[0], pusher.blocks(updates(1, 99)[0]), 1)
    pusher.client.close(leave=True)


def test_twenty_pushers_on_a_sparse_graph_sum_exactly_and_recover_dropouts_within_the_threshold(sparse):
    cluster, pushers, seen = sparse
    state = cluster.servers[0].state
    sa = state.secagg
    us = updates(N, 0)
    run_round(pushers, us)

    # every party derived the same 8-regular graph from the roster; shares went to neighbours only
    assert len(sa.graph) == N and all(len(nb) == DEGREE for nb in sa.graph.values())
    assert all(p.secure.maskers[0].neighbours == sa.graph[p.client.worker_id] for p in pushers)
    threshold = pushers[0].secure.maskers[0].threshold
    assert threshold == 5  # c <= 2 colluders < t; each survivor keeps t with up to 2 dropped neighbours
    s = pushers[0].settings
    mean = sum(u["b"] for u in us) / N
    assert np.max(np.abs(-cluster.params()["b"] - mean)) <= s.clip / s.limit + 1e-6
    assert sa.last_unmask["dropped"] == () and not sa.last_unmask["pair_seeds"]

    # two pushers drop after sending their shares: each surviving neighbour reveals its pair seed
    gone = [pushers[3], pushers[11]]
    for p in gone:
        _drop_before_pushing(p)
    rest = [p for p in pushers if p not in gone]
    before = cluster.params()["b"]
    us = updates(N - 2, 1)
    run_round(rest, us)
    last = sa.last_unmask
    dropped = tuple(sorted(p.client.worker_id for p in gone))
    assert last["dropped"] == dropped
    expected_pairs = {(q, p.client.worker_id) for p in gone for q in p.secure.maskers[0].neighbours
                      if q in last["survivors"]}
    assert last["pair_seeds"] == expected_pairs and len(expected_pairs) <= 2 * DEGREE  # O(k), not O(n)
    assert np.max(np.abs((before - cluster.params()["b"]) - sum(u["b"] for u in us) / (N - 2))) <= \
        s.clip / s.limit + 1e-6
    assert state.version == 2 and set(dropped).isdisjoint(sa.roster)

    # what the shard can strip off one push (its self mask) leaves its 8 pair masks: uniform, no guess
    w = rest[0].client.worker_id
    y = seen[w][-1]
    stripped = y - prg(last["self_seeds"][w], y.size, y.dtype)
    assert stats.kstest(stripped.astype(np.float64) / 2.0 ** 32, "uniform").pvalue > 1e-4
    assert stats.kstest(y.astype(np.float64) / 2.0 ** 32, "uniform").pvalue > 1e-4


def test_more_dropouts_among_one_pushers_share_holders_than_the_threshold_allows_stop_the_round(sparse):
    cluster, pushers, _ = sparse
    state = cluster.servers[0].state
    run_round(pushers, updates(N, 2))
    params, version = cluster.params(), state.version
    victim = pushers[0]
    t = victim.secure.maskers[0].threshold
    holders = DEGREE + 1
    # holders - t + 1 of the victim's neighbours drop: it keeps t - 1 holders, one short
    nb = victim.secure.maskers[0].neighbours[:holders - t + 1]
    gone = [p for p in pushers if p.client.worker_id in nb]
    for p in gone:
        _drop_before_pushing(p)
    rest = [p for p in pushers if p not in gone]

    with pytest.raises(ProtocolError, match=rf"pusher \S+ has \d+ surviving share holder\(s\) of {holders} \(itself "
                                            rf"and its neighbours\); the threshold is {t}"):
        run_round(rest, updates(len(rest), 3))

    assert state.version == version
    assert all(np.array_equal(v, params[k]) for k, v in cluster.params().items())
    assert "cannot be unmasked" in state.secagg.failed


def test_the_shard_unmasks_without_holding_its_lock(sparse, monkeypatch):
    cluster, pushers, _ = sparse
    state = cluster.servers[0].state
    started, release = threading.Event(), threading.Event()
    unmask = server_mod.SecAggServer._unmask

    def held_open(rnd, sr, total):
        started.set()
        assert release.wait(60)
        return unmask(rnd, sr, total)

    monkeypatch.setattr(server_mod.SecAggServer, "_unmask", staticmethod(held_open))
    errors: list[BaseException] = []
    rounds = threading.Thread(target=lambda: _collect(errors, run_round, pushers, updates(N, 5)))
    rounds.start()
    try:
        assert started.wait(60)
        # the unmask is under way and the lock is free: the shard answers meanwhile
        assert state.cond.acquire(timeout=30)
        try:
            assert state.version == 0 and state.secagg.rounds[0].unmasking
        finally:
            state.cond.release()
    finally:
        release.set()
        rounds.join(60)
    assert not errors and state.version == 1 and state.secagg.rounds == {}


def _collect(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as err:  # noqa: BLE001 - the test thread asserts on it
        errors.append(err)
