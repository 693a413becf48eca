"""Secure aggregation against real TLS + token shards: sums, dropouts, identity binding, uniform pushes.

In-process pushers (`SecureRounds` over real `PSClient`s) drive one gRPC shard; each
test is a few rounds of a small model, so the protocol's every message crosses the wire.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from scipy import stats

from hybridfleet.errors import SECURE_ROUND_HINT, AuthError, ProtocolError, exit_code_for
from hybridfleet.ps.secagg.masks import prg
from hybridfleet.ps.secagg.ring import RING_DTYPES, dequantise
from hybridfleet.ps.secagg.rounds import SecureRounds
from hybridfleet.ps.wire._proto import secagg_pb2 as pb

from ps_helpers import start_cluster
from secagg_helpers import PARAMS, Pusher, init, run_round, updates
from script_optim_helpers import run_workers

SITES = {"a": {"workers": 1}, "b": {"workers": 1}, "c": {"workers": 1}}


@pytest.fixture
def cluster(tmp_path):
    c = start_cluster(tmp_path, expected_workers=3, sites=SITES, secure_aggregation={"threshold": 2},
                      optimizer={"name": "sgd", "lr": 1.0})
    yield c
    c.stop()


def test_the_shard_applies_the_mean_of_the_masked_updates_within_the_quantisation_bound(cluster):
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    us = updates(3, 0)
    run_round(pushers, us)
    s = pushers[0].settings
    # each pusher's rounding error < clip/L, the mean divides the sum's by 3; plus float32 rounding
    bound = 3 * s.clip / s.limit / 3 + 1e-6
    params = cluster.params()
    mean = {k: -sum(u[k] for u in us).reshape(-1) / 3 for k in ("w", "b")}  # sgd, lr 1, from zeros
    got = {"w": np.concatenate([params[k] for k in sorted(params) if k.startswith("w")]), "b": params["b"]}
    for k in mean:
        assert np.max(np.abs(got[k] - mean[k])) <= bound, k
    state = cluster.servers[0].state
    assert state.version == 1 and state.secagg.last_unmask["dropped"] == ()


def test_what_the_shard_receives_from_one_pusher_is_uniform_over_the_ring(cluster, monkeypatch):
    """The same (constant) update every round; the shard's view of it must look like uniform noise."""
    from hybridfleet.ps.secagg import server as server_mod

    seen: list[np.ndarray] = []  # every vector the shard received from pusher a-0
    add = server_mod.MaskedRound.add

    def recording(self, contributor, update, weight=1):
        if contributor == "a-0":
            seen.append(update["ring"].copy())
        return add(self, contributor, update, weight)

    monkeypatch.setattr(server_mod.MaskedRound, "add", recording)
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    constant = {"w": np.full((64, 64), 0.25, np.float32), "b": np.full(64, -0.25, np.float32)}
    applied = np.zeros(64, np.float64)
    for r in range(12):
        others = updates(2, r)
        run_round(pushers, [constant, *others])
        applied += (constant["b"] + others[0]["b"] + others[1]["b"]) / 3
    state = cluster.servers[0].state
    assert state.version == 12
    assert len(seen) == 12
    values = np.concatenate(seen)  # 12 rounds x 4160 coordinates, all of the same plaintext per coordinate
    u = values.astype(np.float64) / 2.0 ** 32
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    counts = np.bincount(values.view(np.uint8), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4
    bits = np.unpackbits(values.view(np.uint8)).mean()
    assert abs(bits - 0.5) < 0.005
    # the same tests tell the unmasked ring vector apart at once
    from hybridfleet.ps.secagg.ring import quantise

    s = pushers[0].settings
    plain = np.concatenate([quantise(np.concatenate([constant["b"], constant["w"].reshape(-1)]), s.clip, s.limit,
                                     s.bits, np.random.default_rng(0)) for _ in range(12)])
    assert stats.kstest(plain.astype(np.float64) / 2.0 ** 32, "uniform").pvalue < 1e-10
    assert stats.chisquare(np.bincount(plain.view(np.uint8), minlength=256)).pvalue < 1e-10
    # while each round's result is the plaintext mean (within the quantisation bound): sgd, lr 1, from zeros
    assert np.max(np.abs(-cluster.params()["b"] - applied)) <= 12 * s.clip / s.limit + 1e-5


def test_a_pusher_that_drops_before_pushing_is_unmasked_out_from_pair_seeds(cluster):
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    run_round(pushers, updates(3, 1))
    before = cluster.params()
    # c masks and sends its shares, then vanishes before pushing
    c = pushers[2]
    base = list(c.client.versions)
    c.secure._mask_one(0, base[0], c.blocks(updates(1, 9)[0]), 1)
    c.client.close(leave=True)
    us = updates(2, 2)
    run_round(pushers[:2], us)
    state = cluster.servers[0].state
    last = state.secagg.last_unmask
    assert last["dropped"] == ("c-0",) and last["survivors"] == ("a-0", "b-0")
    assert {(q, d) for q, d in last["pair_seeds"]} == {("a-0", "c-0"), ("b-0", "c-0")}
    after = cluster.params()
    s = pushers[0].settings
    mean = (us[0]["b"] + us[1]["b"]) / 2
    assert np.max(np.abs((before["b"] - after["b"]) - mean)) <= 2 * s.clip / s.limit + 1e-6
    assert "c-0" not in state.secagg.roster and "c-0" not in state.secagg.keys  # evicted
    from hybridfleet.obs.psmetrics import shard_families

    families = {f.name: f.samples[0].value for f in shard_families(state) if f.name.startswith("hybridfleet_shard_sec")}
    assert families == {"hybridfleet_shard_secagg_rounds": 2, "hybridfleet_shard_secagg_dropped": 1,
                        "hybridfleet_shard_secagg_roster": 2}
    # it comes back (a new process: Join again) with a fresh key and is in the next round's roster
    old_key = c.secure.maskers[0].keypair.public
    back = Pusher(cluster, "c")
    back.client.pull(full=True)
    assert back.secure.maskers[0].keypair.public != old_key
    trio, us = [*pushers[:2], back], updates(3, 4)

    def push(rank: int) -> None:
        # a and b push once c-0's new key is in the roster: a round that opened before it closes without it
        # (its shares refused as late, the worker's catch-up: tests/test_ps_catch_up.py)
        deadline = time.monotonic() + 20
        while rank < 2 and "c-0" not in state.secagg.roster and time.monotonic() < deadline:
            time.sleep(0.01)
        trio[rank].push(us[rank])

    run_workers(push, 3)
    assert state.secagg.last_unmask["survivors"] == ("a-0", "b-0", "c-0") and state.secagg.epoch == 3
    assert state.secagg.roster["c-0"] == back.secure.maskers[0].keypair.public


def test_a_pusher_that_drops_after_pushing_is_recovered_from_shares_and_stays_masked(cluster):
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    c = pushers[2]
    captured = {}
    push = c.client.push

    def capture(payloads, **kw):
        captured.update(payloads)
        return push(payloads, **kw)

    c.client.push = capture
    us = updates(3, 3)

    def c_pushes_then_dies():
        c.push(us[2], unmask=False)
        c.client.close(leave=True)

    t = threading.Thread(target=c_pushes_then_dies)
    t.start()
    run_round(pushers[:2], us[:2])
    t.join(30)
    state = cluster.servers[0].state
    last = state.secagg.last_unmask
    assert last["survivors"] == ("a-0", "b-0", "c-0") and last["dropped"] == ()
    assert last["revealed_by"] == ("a-0", "b-0") and not last["pair_seeds"]
    # the round's result is still the mean of all three
    s = pushers[0].settings
    after = cluster.params()["b"]
    assert np.max(np.abs(-after - sum(u["b"] for u in us) / 3)) <= s.clip / s.limit + 1e-6
    # what the shard can strip off c's push (its self mask) leaves c's pair masks on it: not its update
    dtype = RING_DTYPES[s.bits][0]
    # (each key's payload: its values, then its presence flag; the masked vector: all values, then all flags)
    parts = [np.frombuffer(captured[b.key], dtype) for b in c.client.plan.blocks_for_shard(0)]
    y_c = np.concatenate([p[:-1] for p in parts] + [p[-1:] for p in parts])
    stripped = y_c - prg(last["self_seeds"]["c-0"], y_c.size, dtype)
    guess = dequantise(stripped[:-len(parts)], s.clip, s.limit, s.bits)
    truth = np.concatenate([c.blocks(us[2])[b.key] for b in c.client.plan.blocks_for_shard(0)])
    assert np.mean(np.abs(guess - truth) < 0.01) < 0.01  # no better than chance
    assert stats.kstest(stripped.astype(np.float64) / 2.0 ** 32, "uniform").pvalue > 1e-4


def test_a_pusher_restarted_before_it_answers_is_recovered_from_shares_and_rejoins_with_its_new_key(cluster):
    # Prepare: c pushes round 1, then its process is replaced (Join again, a fresh key) before it answers
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    state = cluster.servers[0].state
    us = updates(3, 5)
    restarted = {}

    def c_pushes_then_restarts():
        pushers[2].push(us[2], unmask=False)
        back = Pusher(cluster, "c")
        back.client.pull(full=True)
        back.secure._setup(0)  # advertises its fresh key; the roster holding it follows the round
        restarted["back"] = back

    t = threading.Thread(target=c_pushes_then_restarts)
    t.start()
    # Execute: a and b answer; the round must not wait for the old c
    run_round(pushers[:2], us[:2])
    t.join(60)
    # Assert
    last = state.secagg.last_unmask
    assert last["survivors"] == ("a-0", "b-0", "c-0") and last["revealed_by"] == ("a-0", "b-0")
    back = restarted["back"]
    assert state.secagg.roster["c-0"] == back.secure.maskers[0].keypair.public
    s = pushers[0].settings
    assert np.max(np.abs(-cluster.params()["b"] - sum(u["b"] for u in us) / 3)) <= s.clip / s.limit + 1e-6
    back.client.pull(full=True)  # the new c catches up with the round it missed
    run_round([*pushers[:2], back], updates(3, 6))  # the next round runs with the new c
    assert state.secagg.last_unmask["survivors"] == ("a-0", "b-0", "c-0")


def test_a_step_retried_after_another_shard_refused_it_does_not_answer_a_round_twice(cluster):
    # Prepare: a round pushed and answered by everyone
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    run_round(pushers, updates(3, 7))
    state = cluster.servers[0].state
    before = (state.version, dict(state.secagg.last_unmask), cluster.params())
    sent = [p.secure.bytes_key_material for p in pushers]
    # Execute: the worker's retried step asks to unmask the same round again (its push came back ALREADY_EXISTS)
    for p in pushers:
        p.secure.unmask([0])
    # Assert: nothing is sent, nothing changes, and a second answer is still refused if a shard asks for one
    assert [p.secure.bytes_key_material for p in pushers] == sent
    assert (state.version, state.secagg.last_unmask) == before[:2]
    assert all(np.array_equal(v, before[2][k]) for k, v in cluster.params().items())
    with pytest.raises(ProtocolError, match="asked twice to unmask round 0"):
        pushers[0].secure.maskers[0].answer(0, ["a-0", "b-0", "c-0"], [], {})


def test_a_token_for_one_worker_cannot_act_for_another_and_nothing_changes(cluster):
    pushers = [Pusher(cluster, s) for s in "ab"]
    state = cluster.servers[0].state
    mallory = cluster.client("c", retry_timeout_s=1.0, token=cluster.token("c", worker="c-0"))
    mallory.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
    stub = SecureRounds(mallory, pushers[0].settings, cluster.spec.ps)._stub(0)
    meta = mallory._metadata
    with pytest.raises(grpc.RpcError) as err:
        stub.Advertise(pb.AdvertiseRequest(worker_id="a-0", public_key=bytes(32)), metadata=meta)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "token is for worker 'c-0'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Reveal(pb.RevealRequest(worker_id="b-0", round=0), metadata=meta)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert state.secagg.keys == {} and state.secagg.epoch == 0
    assert [p.client.worker_id for p in pushers] == ["a-0", "b-0"]


@pytest.mark.parametrize("request_kw, code, message", [
    ({"public_key": bytes(31)}, "INVALID_ARGUMENT", "public key of 31 bytes; an X25519 key is 32"),
    ({"worker_id": "z-0"}, "FAILED_PRECONDITION", "has not joined this shard"),
])
def test_bad_advertisements_are_refused_with_the_reason_and_change_nothing(cluster, request_kw, code, message):
    from hybridfleet.ps.wire.reject import Reject

    state = cluster.servers[0].state
    p = Pusher(cluster, "a")
    kw = {"worker_id": "a-0", "public_key": bytes(32), **request_kw}
    with state.cond, pytest.raises(Reject) as rej:
        state.secagg.advertise(kw["worker_id"], kw["public_key"])
    assert rej.value.code == code and message in rej.value.message
    assert state.secagg.keys == {} and state.secagg.epoch == 0
    p.client.close()


def test_a_second_advertisement_and_a_non_pusher_are_refused(tmp_path):
    sites = {"a": {"workers": 2, "aggregate": True}, "b": {"workers": 1}}
    cluster = start_cluster(tmp_path, sites=sites, secure_aggregation=True)
    try:
        from hybridfleet.ps.wire.reject import Reject

        state = cluster.servers[0].state
        leader, follower = cluster.client("a", 0), cluster.client("a", 1)
        for c in (leader, follower):
            c.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
        with state.cond:
            state.secagg.advertise("a-0", bytes(range(32)))
            with pytest.raises(Reject, match="already advertised a key"):
                state.secagg.advertise("a-0", bytes(32))
            with pytest.raises(Reject, match="does not push to the shards"):
                state.secagg.advertise("a-1", bytes(32))
            assert state.secagg.keys == {"a-0": bytes(range(32))}
    finally:
        cluster.stop()


def test_too_few_survivors_stop_the_round_with_the_cause(tmp_path):
    cluster = start_cluster(tmp_path, expected_workers=3, sites=SITES, secure_aggregation={"threshold": 3})
    try:
        pushers = [Pusher(cluster, s) for s in "abc"]
        init(cluster, pushers)
        run_round(pushers, updates(3, 1))
        c = pushers[2]
        c.secure._mask_one(0, c.client.versions[0], c.blocks(updates(1, 9)[0]), 1)
        c.client.close(leave=True)
        with pytest.raises(ProtocolError, match="only 2 of 3 pushers pushed; the threshold is 3") as refused:
            run_round(pushers[:2], updates(2, 2))
        assert cluster.servers[0].state.version == 1
        # the hint says what to do (not the wire-protocol one of other ProtocolErrors), with its exit code 10
        code = exit_code_for(refused.value)
        assert (code.code, code.hint) == (10, SECURE_ROUND_HINT) and "--resume RUN_DIR" in SECURE_ROUND_HINT
    finally:
        cluster.stop()


def test_a_key_no_pusher_had_a_gradient_for_is_not_stepped_and_one_some_had_is_averaged_over_all(cluster):
    # Prepare: every pusher flags "b" as without a gradient (zeros); only pusher a has one for "w"
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    us = updates(3, 5)
    for i, p in enumerate(pushers):
        present = {"w"} if i == 0 else set()
        push = p.secure.push
        p.secure.push = lambda g, base, contributors, optimizer_json="", present=present, push=push: push(
            g, base, contributors, optimizer_json, present=present)
        for key in list(us[i]):
            if key not in present:
                us[i][key] = np.zeros_like(us[i][key])
    # Execute
    run_round(pushers, us)
    # Assert: "b" untouched (not stepped); "w" is a's update over the round's three pushers (sgd, lr 1)
    s, after = pushers[0].settings, cluster.params()
    assert np.array_equal(after["b"], np.zeros(64, np.float32))
    assert np.max(np.abs(-after["w"] - us[0]["w"].reshape(-1) / 3)) <= s.clip / s.limit + 1e-6


def test_presence_counts_beyond_the_pushers_fail_the_round_and_change_nothing(cluster):
    # Prepare: pusher c flags its keys with 7 instead of 1 (the sum then exceeds the three pushers)
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    masker = pushers[2].secure.maskers[0]
    mask = masker.mask
    masker.mask = lambda rnd, vector, present=None: mask(rnd, vector, None if present is None else present * 7)
    state = cluster.servers[0].state
    # Execute / Assert
    from hybridfleet.ps.wire.bulk import BulkError

    with pytest.raises((ProtocolError, BulkError), match="presence counts exceed the 3 pusher"):
        run_round(pushers, updates(3, 6))
    assert state.version == 0
    assert all(np.array_equal(v, np.zeros_like(v)) for v in cluster.params().values())


def test_a_spec_refuses_what_cannot_be_masked():
    from hybridfleet.errors import SpecError
    from hybridfleet.spec import parse_spec

    job = {"name": "j", "framework": "torch", "entrypoint": "t.py", "sites": {"a": {}}, "ps": {"secure_aggregation": True}}
    with pytest.raises(SpecError, match="has 1 pusher; secure aggregation hides one update among others"):
        parse_spec(job)
    assert AuthError  # imported for the identity tests' error family


def test_shared_seed_randomk_masks_only_the_coordinates_every_pusher_keeps(tmp_path):
    from hybridfleet.ps.secagg.server import kept_indices

    cluster = start_cluster(tmp_path, expected_workers=3, sites=SITES, secure_aggregation=True,
                            compression={"codec": "randomk", "ratio": 0.25}, optimizer={"name": "sgd", "lr": 1.0})
    try:
        pushers = [Pusher(cluster, s) for s in "abc"]
        init(cluster, pushers)
        sizes = []
        push = pushers[0].client.push
        pushers[0].client.push = lambda payloads, **kw: sizes.append(sum(map(len, payloads.values()))) or \
            push(payloads, **kw)
        us = updates(3, 5)
        run_round(pushers, us)
        b = -cluster.params()["b"]
        kept = kept_indices("b", 0, 64, 0.25)
        # only the kept coordinates travel (32-bit ring), with one presence element per key
        assert kept.size == 16 and sizes == [4 * (16 + 1024 + 2)]
        s = pushers[0].settings
        assert np.max(np.abs(b[kept] - sum(u["b"] for u in us)[kept] / 3)) <= s.clip / s.limit + 1e-6
        assert not np.delete(b, kept).any()
    finally:
        cluster.stop()


def test_norm_clip_bounds_each_pusher_before_masking(tmp_path):
    cluster = start_cluster(tmp_path, expected_workers=3, sites=SITES, secure_aggregation=True,
                            aggregate={"rule": "norm_clip", "clip_norm": 0.1}, optimizer={"name": "sgd", "lr": 1.0})
    try:
        pushers = [Pusher(cluster, s) for s in "abc"]
        init(cluster, pushers)
        attack = {"w": np.full((64, 64), 1000.0, np.float32), "b": np.full(64, 1000.0, np.float32)}
        run_round(pushers, [attack, *updates(2, 6)])
        params = cluster.params()
        moved = np.sqrt(sum(float(np.dot(v, v)) for v in params.values()))
        assert moved <= 0.1 + 1e-3  # the mean of three updates each of norm <= 0.1 on this shard
    finally:
        cluster.stop()


def test_bad_shares_are_refused_with_the_reason_and_change_nothing(cluster):
    from hybridfleet.ps.wire.reject import Reject

    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    run_round(pushers, updates(3, 7))  # a roster (epoch 1) and one round
    state = cluster.servers[0].state
    blob = bytes(94)
    good = [("b-0", blob), ("c-0", blob)]
    cases = [
        (dict(rnd=1, epoch=1, shares=[("b-0", blob)]), "INVALID_ARGUMENT", "each neighbour in the roster's graph once"),
        (dict(rnd=1, epoch=1, shares=[("b-0", blob), ("z-0", blob)]), "INVALID_ARGUMENT", "each neighbour in the roster"),
        (dict(rnd=1, epoch=1, shares=[("b-0", blob), ("c-0", bytes(10))]), "INVALID_ARGUMENT", "is not 94 bytes"),
        (dict(rnd=1, epoch=7, shares=good), "FAILED_PRECONDITION", "the roster is at epoch 1"),
        (dict(rnd=0, epoch=1, shares=good), "FAILED_PRECONDITION", "shares for round 0; round 1 is open"),
    ]
    for kw, code, message in cases:
        with state.cond, pytest.raises(Reject) as rej:
            state.secagg.shares("a-0", kw["rnd"], kw["epoch"], kw["shares"])
        assert rej.value.code == code and message in rej.value.message, (kw, rej.value.message)
        assert state.secagg.rounds == {} and state.version == 1
    with state.cond, pytest.raises(Reject, match="send the round-1 shares"):
        state.secagg.admit_push("a-0", 1)


def test_a_push_after_the_round_closed_for_unmasking_is_refused_and_the_sum_is_untouched(cluster):
    pushers = [Pusher(cluster, s) for s in "abc"]
    init(cluster, pushers)
    run_round(pushers, updates(3, 8))
    state = cluster.servers[0].state
    a = pushers[0]
    a.secure._mask_one(0, 1, a.blocks(updates(1, 9)[0]), 1)  # a's shares for round 1 ...
    with state.cond:
        state.secagg.rounds[1].survivors = ("b-0", "c-0")        # ... but the round closed without a
    with pytest.raises(grpc.RpcError) as err:
        a.client.push({b.key: bytes(4 * (b.stop - b.start + 1)) for b in a.client.plan.blocks}, codec="secagg32",
                      base_versions=[1])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "round 1 is being unmasked without worker a-0" in err.value.details()
    assert 1 not in state.rounds and state.version == 1


def test_a_worker_session_clips_and_noises_with_dp_then_masks(tmp_path):
    """PSSession end to end (the path the training scripts take): DP on the pusher, then masking."""
    from hybridfleet.ps.worker.client import ClientSecurity
    from hybridfleet.ps.worker.session import PSSession, WorkerConfig
    from hybridfleet.security import load_pki

    cluster = start_cluster(tmp_path, expected_workers=3, sites=SITES, secure_aggregation=True,
                            privacy={"clip_norm": 0.5, "noise_multiplier": 1e-6}, optimizer={"name": "sgd", "lr": 1.0})
    try:
        shapes = {"w": (64, 64), "b": (64,)}
        zeros = {k: np.zeros(v, np.float32) for k, v in shapes.items()}
        sessions = []
        for site in "abc":
            sec = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert),
                                            token=cluster.token(site, worker=f"{site}-0"))
            cfg = WorkerConfig(job=cluster.spec, site=site, rank="abc".index(site), servers=cluster.addresses,
                               security=sec)
            sessions.append(PSSession(shapes, cfg, "torch"))
        starts = [threading.Thread(target=s.start, args=(zeros,)) for s in sessions]
        for t in starts:
            t.start()
        for t in starts:
            t.join(60)
        big = {"w": np.full((64, 64), 3.0, np.float32), "b": np.full(64, 3.0, np.float32)}
        out: dict = {}
        steps = [threading.Thread(target=lambda s=s: out.setdefault(s.config.site, s.step(big))) for s in sessions]
        for t in steps:
            t.start()
        for t in steps:
            t.join(60)
        moved = np.sqrt(sum(float(np.dot(v.reshape(-1), v.reshape(-1))) for v in out["a"].values()))
        assert moved == pytest.approx(0.5, rel=1e-3)  # each push clipped to 0.5 before masking; mean of three
        assert cluster.servers[0].state.secagg.last_unmask["survivors"] == ("a-0", "b-0", "c-0")
        assert all(s.bytes_moved()["sent_secagg"] > 0 for s in sessions)
        for s in sessions:
            s.close()
    finally:
        cluster.stop()
