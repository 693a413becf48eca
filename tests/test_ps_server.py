"""Parameter-server shard over real gRPC + TLS + signed tokens: auth, push validation, consistency modes.

Every test runs twice: Push/Pull over the shard's bulk data plane (TLS socket) and over gRPC.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.errors import AuthError, UnreachableError
from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.server import recv_buffers
from tests.ps_helpers import PARAMS, initial_values, join_and_init, start_cluster

NONE = get_codec("none")


def grads(value: float) -> dict[str, np.ndarray]:
    return {"fc.weight": np.full((4, 3), value, np.float32), "fc.bias": np.full(4, value, np.float32)}


def values(pulled, key: str) -> np.ndarray:
    """The values of ``key`` in a pull's result."""
    entry = next(e for e in pulled if e.key == key and e.delta_version == 0)
    return np.frombuffer(entry.payload(), "<f4")


def encoded(client, g: dict[str, np.ndarray], codec=NONE) -> dict[str, bytes]:
    out = {}
    for name, arr in g.items():
        for key, part in client.plan.split(name, arr.reshape(-1)).items():
            out[key] = codec.encode(part)
    return out


@pytest.fixture(autouse=True)
def _every_payload_in_kept_buffers(monkeypatch):
    """The shards of this module keep receive buffers of any size (not only from 4 MiB), so the
    bulk plane's pushes here land in reused buffers round after round."""
    monkeypatch.setattr(recv_buffers, "MIN_POOLED_BYTES", 1)


@pytest.fixture(params=["auto", "grpc"], ids=["bulk", "grpc"])
def transport(request):
    return request.param


@pytest.fixture
def cluster(tmp_path, transport):
    c = start_cluster(tmp_path, transport=transport)
    yield c
    c.stop()


@pytest.fixture
def two_shards(tmp_path, transport):
    c = start_cluster(tmp_path, transport=transport, shards=2, block_size_bytes=1024)
    yield c
    c.stop()


# ----------------------------------------------------------------------------- auth
@pytest.mark.parametrize("case,expected", [
    ("forged", "signature"),
    ("expired", "expired"),
    ("wrong_role", "role"),
    ("wrong_job", "job"),
])
def test_bad_token_is_rejected_and_params_unchanged(cluster, tmp_path, case, expected):
    # Prepare: an initialised shard and a token that must not pass
    good = cluster.client("a")
    join_and_init(cluster, good)
    before = cluster.params()
    if case == "forged":
        from hybridfleet.security import TokenIssuer, generate_signing_key

        generate_signing_key(tmp_path / "other")
        token = TokenIssuer.from_dir(tmp_path / "other").issue(cluster.spec.name, "a", "worker", 600)
    elif case == "expired":
        token = cluster.token(ttl_s=60, issued_ago_s=600)
    elif case == "wrong_role":
        token = cluster.token(role="monitor")
    else:
        token = cluster.token(job="another-job")
    bad = cluster.client("a", token=token, worker_id="a-0")
    bad.plan = good.plan
    for shard, channel in enumerate(good._bulk):  # the bad token's pushes take the same path as good ones
        bad._set_bulk(shard, channel.port if channel is not None else 0)
    assert bad.transport == good.transport
    # Execute / Assert
    with pytest.raises(AuthError, match=expected):
        bad.push(encoded(good, grads(1.0)), codec="none", base_versions=[0])
    after = cluster.params()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert cluster.servers[0].state.version == 0
    good.close()
    bad.close()


def test_token_for_other_site_cannot_join_as_this_site(cluster):
    client = cluster.client("a", token=cluster.token(site="b"))
    with pytest.raises(AuthError, match="token is for site 'b'"):
        client.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
    client.close(leave=False)


def test_plaintext_client_cannot_talk_to_tls_shard(cluster):
    from hybridfleet.ps.worker.client import ClientSecurity, PSClient

    client = PSClient(cluster.addresses, ClientSecurity(insecure=True, token=cluster.token()), "a-0", "a", 0,
                      retry_timeout_s=0.5)
    with pytest.raises(UnreachableError, match="closed the connection during join") as err:
        client.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
    assert "drop --insecure-plaintext" in err.value.hint
    client.close(leave=False)


# ------------------------------------------------------------------- push validation
def _push_error(client, payloads, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        client.push(payloads, codec=kw.pop("codec", "none"), **kw)
    return err.value


def test_nan_gradient_is_rejected_and_params_unchanged(cluster):
    client = cluster.client("a")
    join_and_init(cluster, client)
    before = cluster.params()
    payloads = encoded(client, grads(1.0))
    # the codec refuses to encode NaN, so forge the frame a faulty client could send
    one, nan = np.float32(1.0).tobytes(), np.float32(np.nan).tobytes()
    assert one in payloads["fc.bias"]
    payloads["fc.bias"] = payloads["fc.bias"].replace(one, nan, 1)
    err = _push_error(client, payloads, base_versions=[0])
    assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT,)
    assert "non-finite" in err.details() or "NaN" in err.details()
    after = cluster.params()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert cluster.servers[0].state.version == 0
    client.close()


def test_wrong_shape_gradient_is_rejected_and_params_unchanged(cluster):
    client = cluster.client("a")
    join_and_init(cluster, client)
    before = cluster.params()
    payloads = encoded(client, grads(1.0))
    payloads["fc.bias"] = NONE.encode(np.ones(5, np.float32))
    err = _push_error(client, payloads, base_versions=[0])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'fc.bias'" in err.details() and "expected 4 elements" in err.details()
    assert all(np.array_equal(before[k], v) for k, v in cluster.params().items())
    client.close()


def test_malformed_payload_is_rejected_and_params_unchanged(cluster):
    client = cluster.client("a")
    join_and_init(cluster, client)
    before = cluster.params()
    payloads = encoded(client, grads(1.0))
    payloads["fc.weight"] = payloads["fc.weight"][:-3]  # truncated frame
    err = _push_error(client, payloads, base_versions=[0])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'fc.weight'" in err.details()
    assert all(np.array_equal(before[k], v) for k, v in cluster.params().items())
    client.close()


def test_unknown_key_is_rejected_and_a_missing_key_is_not_stepped(cluster):
    client = cluster.client("a")
    join_and_init(cluster, client)
    payloads = encoded(client, grads(1.0))
    payloads["fc.other"] = NONE.encode(np.ones(2, np.float32))
    client.plan.blocks.append(type(client.plan.blocks[0])("fc.other", "fc.other", 0, 0, 2))
    err = _push_error(client, payloads, base_versions=[0])
    assert "unknown key(s) for shard 0: fc.other" in err.details()
    assert cluster.servers[0].state.version == 0
    client.plan.blocks.pop()
    del payloads["fc.other"]
    del payloads["fc.bias"]  # no gradient this step: the key is not stepped
    client.clock -= 1  # the refused push did not count
    before = cluster.params()
    client.push(payloads, codec="none", base_versions=[0])
    after = cluster.params()
    assert cluster.servers[0].state.version == 1
    assert np.array_equal(after["fc.bias"], before["fc.bias"]) and not np.array_equal(after["fc.weight"],
                                                                                       before["fc.weight"])
    client.close()


def test_push_over_size_cap_is_rejected(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport, max_push_bytes=1024)
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        payloads = encoded(client, grads(1.0))
        payloads["fc.weight"] = payloads["fc.weight"] + b"\0" * 2048
        err = _push_error(client, payloads, base_versions=[0])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "exceeds the cap of 1024 bytes" in err.details()
        client.close()
    finally:
        cluster.stop()


def test_replayed_push_is_rejected_and_applied_once(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport, sync="asp")
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        payloads = encoded(client, grads(1.0))
        client.push(payloads, codec="none")
        after_first = cluster.params()
        client.clock -= 1  # send the same (worker, step) again
        err = _push_error(client, payloads)
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "replays an applied step" in err.details()
        assert all(np.array_equal(after_first[k], v) for k, v in cluster.params().items())
        assert cluster.servers[0].state.version == 1
        client.close()
    finally:
        cluster.stop()


def test_codec_mismatch_and_wire_version_are_refused_at_join(cluster):
    client = cluster.client("a")
    with pytest.raises(grpc.RpcError) as err:
        client.join(PARAMS, cluster.spec.ps.block_size_bytes, "topk", "torch")
    assert "codec 'topk' does not match this job's codec 'none'" in err.value.details()
    stub = client._stubs[0]
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(ps_pb2.JoinRequest(wire_version=99, worker_id="a-0", site="a"), metadata=client._metadata)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "wire version 99" in err.value.details()
    client.close(leave=False)


def test_different_model_is_refused_at_join(cluster):
    first = cluster.client("a")
    join_and_init(cluster, first)
    other = cluster.client("b")
    from hybridfleet.ps.wire.sharding import ParamSpec

    with pytest.raises(grpc.RpcError) as err:
        other.join([ParamSpec("fc.weight", (5, 3)), ParamSpec("fc.bias", (5,))], cluster.spec.ps.block_size_bytes,
                   "none", "torch")
    assert "parameters or shard count differ" in err.value.details()
    first.close()
    other.close(leave=False)


# ----------------------------------------------------------------- consistency modes
def test_bsp_applies_a_round_only_when_every_live_worker_pushed(cluster):
    a, b = cluster.client("a"), cluster.client("b")
    join_and_init(cluster, a)
    join_and_init(cluster, b, init=False)
    a.push(encoded(a, grads(1.0)), codec="none", base_versions=[0])
    assert cluster.servers[0].state.version == 0  # waits for b
    b.push(encoded(b, grads(3.0)), codec="none", base_versions=[0])
    assert cluster.servers[0].state.version == 1
    pulled = a.pull(wait_for_versions=[1])
    # SGD lr 0.5 on the average gradient 2.0: w - 1.0
    expected = initial_values()["fc.bias"] - 1.0
    np.testing.assert_allclose(values(pulled, "fc.bias"), expected, rtol=1e-6)
    a.close()
    b.close()


def test_bsp_silent_worker_leaves_quorum_and_round_completes(cluster):
    a, b = cluster.client("a"), cluster.client("b")
    join_and_init(cluster, a)
    join_and_init(cluster, b, init=False)
    b._hb_stop.set()  # b goes silent, as if killed
    a.push(encoded(a, grads(1.0)), codec="none", base_versions=[0])
    a.pull(wait_for_versions=[1], timeout_s=10)  # returns once b timed out (1 s) and the round applied
    state = cluster.servers[0].state
    assert state.version == 1
    assert state.live_members() == {"a-0"}
    # b rejoins and pulls the current parameters
    b.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
    assert "b-0" in state.live_members()
    pulled = b.pull(full=True)
    np.testing.assert_array_equal(values(pulled, "fc.bias"), state.params["fc.bias"])
    a.close()
    b.close()


def test_bsp_stale_push_is_rejected(cluster):
    a, b = cluster.client("a"), cluster.client("b")
    join_and_init(cluster, a)
    join_and_init(cluster, b, init=False)
    a.push(encoded(a, grads(1.0)), codec="none", base_versions=[0])
    b.push(encoded(b, grads(1.0)), codec="none", base_versions=[0])
    err = _push_error(a, encoded(a, grads(1.0)), base_versions=[0])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale push" in err.details()
    a.close()
    b.close()


def test_asp_applies_each_push_on_arrival(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport, sync="asp")
    try:
        a, b = cluster.client("a"), cluster.client("b")
        join_and_init(cluster, a)
        join_and_init(cluster, b, init=False)
        a.push(encoded(a, grads(1.0)), codec="none")
        assert cluster.servers[0].state.version == 1
        b.push(encoded(b, grads(1.0)), codec="none")
        assert cluster.servers[0].state.version == 2
        a.close()
        b.close()
    finally:
        cluster.stop()


def test_ssp_worker_too_far_ahead_waits_for_the_slowest(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport, sync="ssp", staleness_bound=1)
    try:
        fast, slow = cluster.client("a"), cluster.client("b")
        join_and_init(cluster, fast)
        join_and_init(cluster, slow, init=False)
        fast.push(encoded(fast, grads(1.0)), codec="none")
        fast.pull(timeout_s=2)  # 1 ahead: within the bound
        fast.push(encoded(fast, grads(1.0)), codec="none")
        with pytest.raises(grpc.RpcError) as err:  # 2 ahead: must wait
            fast.pull(timeout_s=0.5)
        assert "more than 1 steps ahead" in err.value.details()
        released = threading.Event()
        t = threading.Thread(target=lambda: (fast.pull(timeout_s=10), released.set()))
        t.start()
        time.sleep(0.2)
        assert not released.is_set()
        slow.push(encoded(slow, grads(1.0)), codec="none")
        t.join(10)
        assert released.is_set()
        fast.close()
        slow.close()
    finally:
        cluster.stop()


def test_pull_returns_only_keys_changed_since_client_version(two_shards):
    a = two_shards.client("a")
    join_and_init(two_shards, a)
    assert a.pull() == []  # nothing changed since the full pull
    a.close()


def test_two_shards_split_blocks_and_agree_on_the_plan(two_shards):
    a = two_shards.client("a")
    join_and_init(two_shards, a)
    shards = {b.shard for b in a.plan.blocks}
    assert shards == {0, 1}
    params = two_shards.params()
    assert sum(v.size for v in params.values()) == 16
    a.close()


def test_worker_holding_the_initial_values_skips_the_first_dense_pull(cluster):
    from hybridfleet.ps.server.shard import values_digest

    a, b = cluster.client("a"), cluster.client("b")
    join_and_init(cluster, a)
    b.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
    init = initial_values()
    same = [values_digest(init[blk.param].reshape(-1)[blk.start:blk.stop] for blk in b.plan.blocks_for_shard(0))]
    assert b.pull(full=True, init_digests=same) == []  # already holds version 0
    assert b.versions == [0]
    other = [values_digest([np.zeros(16, np.float32)])]
    assert {e.key for e in b.pull(full=True, init_digests=other)} == {"fc.weight", "fc.bias"}
    a.close()
    b.close()


def test_join_with_fewer_addresses_than_shards_is_refused_with_the_expected_count(two_shards):
    # Prepare: a worker given only shard 0's address for a 2-shard job
    from hybridfleet.ps.worker.client import ClientSecurity, PSClient
    from hybridfleet.security import load_pki

    sec = ClientSecurity.from_files(str(load_pki(two_shards.certs).ca_cert), token=two_shards.token("a"))
    client = PSClient(two_shards.addresses[:1], sec, "a-0", "a", 0, retry_timeout_s=2.0, transport=two_shards.transport)
    # Execute
    with pytest.raises(grpc.RpcError) as err:
        client.join(PARAMS, two_shards.spec.ps.block_size_bytes, "none", "torch")
    client.close(leave=False)
    # Assert: refused with the expected count, and the refused join changed nothing: no member, no plan
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the job has 2 shard(s) but the worker was given 1 shard address(es); expected 2" in err.value.details()
    assert all(not s.state.status()["members"] and s.state.plan is None for s in two_shards.servers)
