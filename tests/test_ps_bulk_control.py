"""Heartbeat and Leave on the bulk data plane, so that a shard holds one connection per worker.

Real TLS + token shards on 127.0.0.1 (tests/ps_helpers.py: heartbeat every 0.2 s, a worker
silent for 1 s is dropped). A worker whose bulk connection is up sends its heartbeats and its
Leave there; its gRPC channel, idle after the Join, closes its connection. While the connection
is busy (a push arriving, a pull waiting for its round) no heartbeat goes on it, and the shard
counts that as the worker being alive, as long as the connection stays open.
"""

from __future__ import annotations

import json
import ssl
import threading
import time

import numpy as np
import pytest

from hybridfleet.ps.worker import client as client_module
from hybridfleet.ps.wire import bulk
from hybridfleet.ps.wire._proto import ps_pb2
from tests.ps_attack_helpers import wait_until
from tests.ps_helpers import join_and_init, start_cluster
from tests.test_ps_bulk import _closed, _raw
from tests.test_ps_server import encoded, grads


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setattr(client_module, "IDLE_CHANNEL_MS", 1000)  # gRPC's shortest idle timeout
    c = start_cluster(tmp_path, expected_workers=2)
    yield c
    c.stop()


def _clients_of(port: int) -> set[int]:
    """The peers' ports of the ESTABLISHED TCP connections whose local port is ``port``."""
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                peers.add(int(fields[2].rsplit(":", 1)[1], 16))
    return peers


def _established_to(port: int) -> int:
    """TCP connections in state ESTABLISHED whose local port is ``port`` (the server's ends)."""
    return len(_clients_of(port))


def test_a_channel_carrying_heartbeats_keeps_its_connection_between_them(tmp_path, monkeypatch):
    # Prepare: a worker on gRPC alone (transport grpc), heartbeats 1.5 s apart, longer than the
    # idle timeout a channel whose calls went to the bulk plane closes its connection after
    monkeypatch.setattr(client_module, "IDLE_CHANNEL_MS", 1000)
    cluster = start_cluster(tmp_path, expected_workers=1, transport="grpc", sites={"a": {"workers": 1}},
                            heartbeat_interval_s=1.5, heartbeat_timeout_s=6.0)
    try:
        a = cluster.client("a")
        join_and_init(cluster, a)
        shard = cluster.servers[0]
        first = _clients_of(shard.port)

        # Execute: watch the shard's gRPC connections over four heartbeats
        seen = []
        deadline = time.monotonic() + 4 * 1.5
        while time.monotonic() < deadline:
            seen.append(_clients_of(shard.port))
            time.sleep(0.1)

        # Assert: one connection, the same one throughout (no reconnect per heartbeat), and the
        # worker is still a member
        assert len(first) == 1
        assert all(peers == first for peers in seen), [p for p in seen if p != first][:3]
        assert shard.state.live_members() == {"a-0"}
        a.close()
    finally:
        cluster.stop()


def _two_members(cluster):
    """Workers a-0 (which initialised the shard) and b-0, both joined."""
    a, b = cluster.client("a"), cluster.client("b")
    join_and_init(cluster, a)
    join_and_init(cluster, b, init=False)
    return a, b


def test_a_worker_stays_in_the_quorum_on_its_bulk_connection_alone(cluster):
    # Prepare: two workers joined; their gRPC channels carried the Join and nothing since
    a, b = _two_members(cluster)
    shard = cluster.servers[0]

    # Execute: wait well past the heartbeat timeout
    closed = wait_until(lambda: _established_to(shard.port) == 0)
    time.sleep(2.5 * cluster.spec.ps.heartbeat_timeout_s)

    # Assert: no gRPC connection left, one bulk connection per worker, both still members
    assert closed and _established_to(shard.port) == 0
    assert _established_to(shard.bulk.port) == 2
    assert shard.state.live_members() == {"a-0", "b-0"}
    # and the channel opens again when a call needs it
    assert a.status()[0]["members"]["a-0"]["alive"] is True
    a.close()
    b.close()


def test_a_pull_waiting_past_the_heartbeat_timeout_keeps_its_worker(cluster):
    # Prepare: a has pushed round 0 and waits for it; b has not pushed yet
    a, b = _two_members(cluster)
    shard = cluster.servers[0]
    a.push(encoded(a, grads(1.0)), codec="none")
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(v=a.pull(wait_for_versions=[1], timeout_s=30)))

    # Execute: a's pull waits 2.5x the heartbeat timeout (no heartbeat can go on its busy connection)
    waiter.start()
    assert wait_until(lambda: shard.bulk.parked_pulls == 1)
    time.sleep(2.5 * cluster.spec.ps.heartbeat_timeout_s)
    alive_while_waiting = shard.state.live_members()
    b.push(encoded(b, grads(3.0)), codec="none")
    waiter.join(10)

    # Assert: a was never dropped, and the round closed with both pushes
    assert alive_while_waiting == {"a-0", "b-0"}
    assert not waiter.is_alive() and a.versions == [1]
    assert shard.state.version == 1
    a.close()
    b.close()


def test_a_pull_whose_worker_vanishes_is_dropped_and_the_worker_times_out(cluster):
    # Prepare: b parks a pull on a raw bulk connection and sends no heartbeat otherwise
    a, b = _two_members(cluster)
    shard = cluster.servers[0]
    b.close(leave=False)  # its own connections and heartbeats stop
    sock, status, _ = _raw(cluster, token=cluster.token("b"))
    assert status == "OK"
    pull = ps_pb2.PullRequest(worker_id="b-0", since_version=0, wait_for_version=1, timeout_s=60)
    sock.sendall(bulk._frame(bytes([bulk.OP_PULL]), pull.SerializeToString()))
    assert wait_until(lambda: shard.bulk.parked_pulls == 1)
    time.sleep(2.0 * cluster.spec.ps.heartbeat_timeout_s)
    alive_while_parked = "b-0" in shard.state.live_members()

    # Execute: the connection closes under the waiting pull (the worker was killed)
    sock.close()

    # Assert: the pull is let go and b is dropped by the heartbeat timeout; a stays
    assert alive_while_parked
    assert wait_until(lambda: shard.bulk.parked_pulls == 0, 5)
    assert wait_until(lambda: "b-0" not in shard.state.live_members(), 5)
    assert "a-0" in shard.state.live_members()
    assert shard.state.version == 0
    a.close()


def test_leave_goes_by_the_bulk_connection(cluster):
    a, b = _two_members(cluster)

    def refuse(*args, **kwargs):
        raise AssertionError("Leave went by gRPC")

    a._stubs[0].Leave = refuse
    a.close()
    assert cluster.servers[0].state.live_members() == {"b-0"}
    b.close()


def test_a_shard_without_control_calls_on_its_bulk_plane_gets_heartbeats_by_grpc(cluster):
    # Prepare: the shard's bulk plane answers pushes and pulls only (as one built before these calls)
    shard = cluster.servers[0]
    shard.bulk._control = {}
    a, b = _two_members(cluster)

    # Execute: past the heartbeat timeout
    time.sleep(2.5 * cluster.spec.ps.heartbeat_timeout_s)

    # Assert: both fell back to gRPC heartbeats and are members; the bulk plane still moves data
    assert a._control_on_grpc == [True] and b._control_on_grpc == [True]
    assert shard.state.live_members() == {"a-0", "b-0"}
    a.push(encoded(a, grads(1.0)), codec="none")
    b.push(encoded(b, grads(1.0)), codec="none")
    assert a.pull(wait_for_versions=[1], timeout_s=10) is not None and a.versions == [1]
    a.close()
    b.close()


def test_a_heartbeat_or_leave_naming_another_worker_is_refused_and_changes_nothing(cluster):
    # Prepare: a and b joined; a raw bulk connection with a's token
    a, b = _two_members(cluster)
    state = cluster.servers[0].state
    sock, _, _ = _raw(cluster, token=cluster.token("a"))
    b.close(leave=False)  # b's own heartbeats stop: only the refused ones below could refresh it
    seen = state.members["b-0"].last_seen

    for op, request in ((bulk.OP_HEARTBEAT, ps_pb2.HeartbeatRequest(worker_id="b-0")),
                        (bulk.OP_LEAVE, ps_pb2.LeaveRequest(worker_id="b-0"))):
        # Execute
        sock.sendall(bulk._frame(bytes([op]), request.SerializeToString()))
        status, body = bulk._read_response(sock)

        # Assert: refused with the reason; b neither refreshed nor removed; the connection serves on
        assert (status, body.decode()) == ("PERMISSION_DENIED", "token is for worker 'a-0'; the request names "
                                                                "worker 'b-0'")
        assert state.members["b-0"].last_seen == seen and state.members["b-0"].alive
    sock.sendall(bulk._frame(bytes([bulk.OP_HEARTBEAT]), ps_pb2.HeartbeatRequest(worker_id="a-0").SerializeToString()))
    status, body = bulk._read_response(sock)
    assert status == "OK" and "a-0" in ps_pb2.HeartbeatResponse.FromString(body).live_workers
    a.close()


def test_a_malformed_heartbeat_is_refused_and_the_connection_closed(cluster):
    a = cluster.client("a")
    join_and_init(cluster, a)
    state = cluster.servers[0].state
    seen = state.members["a-0"].last_seen
    a.close(leave=False)
    sock, _, _ = _raw(cluster)
    sock.sendall(bulk._frame(bytes([bulk.OP_HEARTBEAT]), b"\xff\xff\xff garbage"))
    status, body = bulk._read_response(sock)
    assert (status, body.decode()) == ("INVALID_ARGUMENT", "malformed heartbeat request")
    assert _closed(sock)
    assert state.members["a-0"].last_seen == seen


def test_a_worker_dropped_from_the_quorum_is_told_on_the_bulk_plane_and_joins_again(cluster):
    a, b = _two_members(cluster)
    state = cluster.servers[0].state
    with state.cond:
        state.members["a-0"].alive = False  # as the reaper does when a worker falls silent

    assert wait_until(lambda: a._needs_rejoin, 5)
    a.pull()  # the next call joins again first
    assert "a-0" in state.live_members()
    a.close()
    b.close()


def test_a_pull_still_being_sent_when_a_round_closes_without_its_worker_gets_its_version_whole(tmp_path):
    # Prepare: a bsp shard of a 64 MiB model (more than loopback buffers hold), a on the bulk plane,
    # b on gRPC; the first round closes with both
    from hybridfleet.codec import get_codec
    from hybridfleet.ps.wire.sharding import ParamSpec

    cluster = start_cluster(tmp_path, expected_workers=2)
    numel = 16 << 20
    specs = [ParamSpec("w", (numel,), "float32")]
    a, b = cluster.client("a"), cluster.client("b", transport="grpc")
    sock = None
    try:
        block = cluster.spec.ps.block_size_bytes
        a.join(specs, block, "none", "torch")
        a.push({k: v.tobytes() for k, v in a.plan.split("w", np.ones(numel, np.float32)).items()},
               codec="none", kind="INIT")
        b.join(specs, block, "none", "torch")

        def push(client, g: float, base: int) -> None:
            parts = client.plan.split("w", np.full(numel, g, np.float32))
            client.push({k: get_codec("none").encode(v) for k, v in parts.items()}, codec="none",
                        base_versions=[base])

        push(a, 1.0, 0)
        push(b, 3.0, 0)
        state = cluster.servers[0].state
        assert wait_until(lambda: state.version == 1)
        # b asks for the round's values on a raw bulk connection and reads nothing yet, so the
        # shard's send stops once the socket buffers are full
        sock, status, _ = _raw(cluster, token=cluster.token("b"))
        assert status == "OK"
        pull = ps_pb2.PullRequest(worker_id="b-0", since_version=0, wait_for_version=1, timeout_s=60)
        sock.sendall(bulk._frame(bytes([bulk.OP_PULL]), pull.SerializeToString()))
        time.sleep(0.5)

        # Execute: b leaves (by gRPC) and a's push closes the next round without it while the pull
        # is being sent from the parameters; then b reads what comes
        b.close()
        push(a, 5.0, 1)
        assert wait_until(lambda: state.version == 2)
        status, body = bulk._read_response(sock)
        meta = json.loads(body)
        expected = sum(n for _, _, n in meta["items"])
        received = np.empty(expected, np.uint8)
        bulk.recv_exact_into(sock, memoryview(received))

        # Assert: the frame named version 1 and carried version 1's values whole (SGD lr 0.5 on the
        # mean gradient 2: 0.0), the round stepped copies, and the shard went on to version 2
        # (gradient 5 more)
        assert status == "OK" and meta["version"] == 1
        assert (received.view(np.float32) == np.float32(1.0 - 0.5 * 2.0)).all()
        assert state.detached_values == len(meta["items"])
        values = cluster.params()
        assert sum(v.size for v in values.values()) == numel
        for v in values.values():
            np.testing.assert_array_equal(v, np.float32(1.0 - 0.5 * 2.0 - 0.5 * 5.0))
    finally:
        if sock is not None:
            sock.close()
        a.close()
        cluster.stop()
