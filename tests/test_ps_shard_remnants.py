"""What a member of the job, or anyone who reaches a shard, still could do, and now cannot.

Real TLS + token shards on 127.0.0.1 (gRPC and the bulk plane); each refusal asserts its
message and that parameters, membership and rounds are unchanged.
"""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest

from hybridfleet.errors import AuthError

from hybridfleet.ps.server import bulk_server
from hybridfleet.ps.wire.sharding import ParamSpec
from tests.ps_attack_helpers import assert_unchanged, shard_state
from tests.ps_helpers import PARAMS, initial_values, raw, start_cluster


@pytest.fixture
def cluster(tmp_path):
    c = start_cluster(tmp_path, sites={"a": {"workers": 1}, "b": {"workers": 1}})
    yield c
    c.stop()


def _init_blocks(client) -> dict[str, bytes]:
    blocks = {}
    for name, arr in initial_values().items():
        blocks.update(client.plan.split(name, arr.reshape(-1)))
    return raw(blocks)


def test_a_join_declaring_a_dtype_the_shard_does_not_store_is_refused_and_nothing_is_allocated(cluster):
    # 1 Mi bool values pass a 1 MiB cap computed for bool, but the shard would allocate them as float32
    client = cluster.client("a")
    with pytest.raises(grpc.RpcError) as err:
        client.join([ParamSpec("mask", (1 << 20,), "bool")], cluster.spec.ps.block_size_bytes, "none", "torch")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "declares parameter 'mask' as bool; the shards store float32 values only" in err.value.details()
    state = cluster.servers[0].state
    assert state.plan is None and state.params == {} and state.members == {}
    client.close()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_init_from_a_member_other_than_the_initialising_worker_is_refused_and_parameters_stay(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport)
    try:
        a, b = cluster.client("a"), cluster.client("b")
        for c in (a, b):
            c.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
        before = shard_state(cluster)
        planted = {k: np.full(len(v) // 4, 9.0, "<f4").tobytes() for k, v in _init_blocks(b).items()}
        with pytest.raises(AuthError, match="refused push: worker b-0 may not initialise the parameters: the job "
                                            "names a-0"):
            b.push(planted, codec="none", kind="INIT")
        assert_unchanged(before, shard_state(cluster))
        assert not cluster.servers[0].state.is_initialized()
        a.push(_init_blocks(a), codec="none", kind="INIT")  # the job's initialising worker (global rank 0)
        params = cluster.params()
        np.testing.assert_array_equal(np.concatenate([params[k] for k in sorted(params)]),
                                      np.concatenate([np.frombuffer(v, "<f4") for _, v in
                                                      sorted(_init_blocks(a).items())]))
        a.close()
        b.close()
    finally:
        cluster.stop()


def test_an_init_naming_a_version_gives_an_empty_shard_that_version_and_one_past_the_bound_is_refused(cluster):
    # Prepare: the initialising worker joined an empty shard (as after a restart without a snapshot)
    a = cluster.client("a")
    a.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
    state = cluster.servers[0].state
    before = shard_state(cluster)

    # Execute / Assert: a version past the bound is refused and nothing changes
    with pytest.raises(grpc.RpcError) as err:
        a.push(_init_blocks(a), codec="none", kind="INIT", base_versions=[(1 << 62) + 1])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (f"INIT from worker a-0 names version {(1 << 62) + 1}; at most {1 << 62}; "
                                   "nothing changed")
    assert_unchanged(before, shard_state(cluster))
    assert not state.is_initialized() and state.version == 0

    # Execute / Assert: version 7 is taken up with the values; a second INIT changes neither
    a.push(_init_blocks(a), codec="none", kind="INIT", base_versions=[7])
    assert state.is_initialized() and state.version == 7 and set(state.key_version.values()) == {7}
    a.push({k: np.zeros(len(v) // 4, "<f4").tobytes() for k, v in _init_blocks(a).items()}, codec="none",
           kind="INIT", base_versions=[9])
    assert state.version == 7
    params = cluster.params()
    np.testing.assert_array_equal(params["fc.bias"], initial_values()["fc.bias"])
    a.close()


def test_init_site_names_the_initialising_worker(tmp_path):
    cluster = start_cluster(tmp_path, init_site="b")
    try:
        a, b = cluster.client("a"), cluster.client("b")
        for c in (a, b):
            c.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
        with pytest.raises(AuthError, match="worker a-0 may not initialise the parameters: the job names b-0"):
            a.push(_init_blocks(a), codec="none", kind="INIT")
        b.push(_init_blocks(b), codec="none", kind="INIT")
        assert cluster.servers[0].state.is_initialized()
        a.close()
        b.close()
    finally:
        cluster.stop()


def test_idle_connections_from_anywhere_do_not_lock_a_worker_out_of_the_bulk_plane(cluster):
    port = cluster.servers[0].bulk.port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(bulk_server.MAX_PENDING_HANDSHAKES + 16)]
    try:
        a = cluster.client("a")  # joins, then HELLOs on the bulk plane while the idle ones are still open
        a.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
        assert a.transport == ["bulk"]
        a.push(_init_blocks(a), codec="none", kind="INIT")
        a.pull(full=True)
        assert cluster.servers[0].state.is_initialized()
        assert len(cluster.servers[0].bulk._slots) <= bulk_server.PENDING_PER_SOURCE  # one source: its own bound
        a.close()
    finally:
        for s in idle:
            s.close()
