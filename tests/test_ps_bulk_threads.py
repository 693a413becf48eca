"""The shard's thread use does not grow with its workers: the bulk plane's event loop and fixed pool.

A real `ShardServer` (plaintext, auth off, in this process) and N real connections speaking the
bulk protocol byte by byte from this test's one thread (no client threads): every worker pushes,
every worker's pull waits for the BSP round at once, and the shard's threads are counted from
/proc/self/status while all N pulls wait. The parameters are compared with a second shard fed
the same pushes directly (no network), so a push lost or applied twice would show.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.ps.server import bulk_server
from hybridfleet.ps.server.bulk_server import server_ssl_context
from hybridfleet.ps.server.limits import GRPC_THREADS_WITH_BULK
from hybridfleet.ps.server.service import ServerSecurity, ShardServer
from hybridfleet.ps.server.shard import ShardState
from hybridfleet.ps.wire import bulk
from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire import tls
from hybridfleet.ps.wire.protocol import GRPC_OPTIONS, SERVICE
from hybridfleet.ps.worker.bulk_channel import client_ssl_context
from hybridfleet.security import load_pki, make_dev_pki
from tests.ps_helpers import PARAMS, initial_values, job_spec, raw
from tests.test_ps_tls_native import needs_native  # skipped only outside CI, naming the install step

NONE = get_codec("none")
# Threads the shard may start beyond the test process's own, whatever N: the bulk pool, its
# event loop and watchdog, the reaper, and gRPC's own threads.
THREAD_BOUND = bulk_server.POOL_THREADS + 16


def _threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _state(n: int) -> ShardState:
    spec = job_spec(sites={"a": {"workers": n}}, heartbeat_timeout_s=1e9).ps
    state = ShardState(0, spec, sites={"a": n})
    for i in range(n):
        state.join(f"a-{i}", "a", PARAMS, 1, spec.block_size_bytes, "none")
    state.push("a-0", "a", "INIT", 0, 0, "none", raw(initial_values()))
    return state


def _grad(state: ShardState, i: int) -> dict[str, bytes]:
    return {k: NONE.encode(np.arange(state.params[k].size, dtype=np.float32) * 0.01 + i) for k in state.keys}


def _connect(port: int, ctx: ssl.SSLContext | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if ctx is not None:
        sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    hello = {"magic": bulk.MAGIC, "wire_version": 1, "token": ""}
    sock.sendall(bulk._frame(bytes([bulk.OP_HELLO]), json.dumps(hello).encode()))
    assert bulk._read_response(sock) == ("OK", b"")
    return sock


def _push(sock: socket.socket, worker: str, payloads: dict[str, bytes]) -> ps_pb2.PushResponse:
    header = ps_pb2.PushHeader(worker_id=worker, step=1, base_version=0, codec="none",
                               keys=[ps_pb2.KeyBytes(key=k, nbytes=len(v)) for k, v in payloads.items()])
    sock.sendall(bulk._frame(bytes([bulk.OP_PUSH]), header.SerializeToString()) + b"".join(payloads.values()))
    status, body = bulk._read_response(sock)
    assert status == "OK", body
    return ps_pb2.PushResponse.FromString(body)


def _send_pull(sock: socket.socket, worker: str, version: int, timeout_s: float = 60.0) -> None:
    req = ps_pb2.PullRequest(worker_id=worker, since_version=version - 1, wait_for_version=version,
                             timeout_s=timeout_s)
    sock.sendall(bulk._frame(bytes([bulk.OP_PULL]), req.SerializeToString()))


def _read_pull(sock: socket.socket) -> tuple[int, dict[str, np.ndarray]]:
    status, body = bulk._read_response(sock)
    assert status == "OK", body
    meta = json.loads(body)
    return meta["version"], {k: bulk.recv_exact(sock, n).view(np.float32) for k, _, n in meta["items"]}


def _until(what, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, "the shard never got there"
        time.sleep(0.01)


def _round_with_every_pull_waiting(n: int, pki: Path | None = None) -> tuple[int, dict, dict]:
    """N workers push a BSP round over the bulk plane (TLS with the certificates in ``pki``, else
    plaintext), all N pulls waiting at once before the last push; returns (the shard's extra
    threads while they waited, the values pulled, a reference)."""
    state = _state(n)
    reference = _state(n)
    security, client_ctx = ServerSecurity(insecure=True), None
    if pki is not None:  # gRPC stays plaintext here: only the bulk plane is under test
        paths = load_pki(pki)
        security.ssl_context = server_ssl_context(str(paths.server_cert), str(paths.server_key))
        client_ctx = client_ssl_context(str(paths.ca_cert))
    before = _threads()
    server = ShardServer(state, "127.0.0.1", 0, security, 1 << 20, num_workers=n).start()
    socks = []
    try:
        # the last worker's second connection too
        socks = [_connect(server.bulk.port, client_ctx) for _ in range(n + 1)]
        for i in range(n - 1):
            assert _push(socks[i], f"a-{i}", _grad(state, i)).version == 0
        for i in range(n):
            _send_pull(socks[i], f"a-{i}", 1)
        _until(lambda: server.bulk.parked_pulls == n)
        extra = _threads() - before
        assert state.version == 0 and state.status()["pull_waiters"] == n
        _push(socks[n], f"a-{n - 1}", _grad(state, n - 1))  # closes the round
        answers = [_read_pull(s) for s in socks[:n]]
        assert all(version == 1 for version, _ in answers)
        assert all(values.keys() == answers[0][1].keys() for _, values in answers)
        for i in range(n):
            reference.push(f"a-{i}", "a", "GRADIENT", 1, 0, "none", _grad(reference, i))
        assert reference.version == 1
        return extra, answers[0][1], {k: reference.params[k] for k in reference.keys}
    finally:
        for s in socks:
            s.close()
        server.stop(grace_s=0)


def test_thread_count_stays_under_one_bound_at_20_and_200_workers_and_every_push_is_applied_once():
    # Prepare / Execute: the same round at N = 20 and N = 200
    extra_20, values_20, reference_20 = _round_with_every_pull_waiting(20)
    extra_200, values_200, reference_200 = _round_with_every_pull_waiting(200)

    # Assert: one bound for both N (one thread per connection would be 200 more)
    assert extra_20 <= THREAD_BOUND and extra_200 <= THREAD_BOUND, (extra_20, extra_200)
    assert extra_200 <= extra_20 + bulk_server.POOL_THREADS, (extra_20, extra_200)  # pool threads start on demand
    # every worker's push applied exactly once: what each pulled equals the shard fed directly
    for values, reference in ((values_20, reference_20), (values_200, reference_200)):
        assert values.keys() == reference.keys()
        for key, ref in reference.items():
            np.testing.assert_array_equal(values[key], ref)


@pytest.mark.parametrize("native", [pytest.param("1", id="native-tls", marks=needs_native),
                                    pytest.param("0", id="ssl-module")])
def test_tls_handshakes_run_in_the_event_loop_and_forty_tls_workers_need_no_thread_each(tmp_path, monkeypatch,
                                                                                        native):
    # Prepare: the shard's TLS on the native extension or on the ssl module (HFLEET_NATIVE_TLS)
    monkeypatch.setenv(tls.ENV_SWITCH, native)
    make_dev_pki(tmp_path / "pki", clients=[])

    # Execute: 41 TLS connections, 40 pulls waiting at once
    extra, values, reference = _round_with_every_pull_waiting(40, tmp_path / "pki")

    # Assert: the same bound as in plaintext; what was pulled equals the shard fed directly
    assert extra <= THREAD_BOUND, extra
    for key, ref in reference.items():
        np.testing.assert_array_equal(values[key], ref)


def test_a_parked_pull_whose_time_is_up_is_answered_with_the_reason_and_the_connection_serves_on():
    # Prepare: two workers; a-0's pull waits for a round a-1 never pushes, for 0.6 s
    state = _state(2)
    server = ShardServer(state, "127.0.0.1", 0, ServerSecurity(insecure=True), 1 << 20, num_workers=2).start()
    sock = _connect(server.bulk.port)
    try:
        assert _push(sock, "a-0", _grad(state, 0)).version == 0
        _send_pull(sock, "a-0", 1, timeout_s=0.6)

        # Execute
        status, body = bulk._read_response(sock)

        # Assert: refused with what it waited for; nothing changed; the gate slot is free again
        assert status == "DEADLINE_EXCEEDED"
        assert body.decode() == "round 0 waits for ['a-1']"
        assert state.version == 0 and server.bulk.parked_pulls == 0 and state.status()["pull_waiters"] == 0
        assert server.servicer.gate.active() == 0
        _send_pull(sock, "a-0", 0)  # a ready pull on the same connection is answered at once
        version, values = _read_pull(sock)
        assert version == 0 and values.keys() == set(state.keys)
    finally:
        sock.close()
        server.stop(grace_s=0)


def test_grpc_threads_are_fixed_with_the_bulk_plane_and_waiting_grpc_pulls_are_bounded():
    # Prepare: a shard for 100 workers; its gRPC pull bound lowered to one so a second one meets it
    state = _state(3)
    server = ShardServer(state, "127.0.0.1", 0, ServerSecurity(insecure=True), 1 << 20, num_workers=100).start()
    assert server.grpc_threads == GRPC_THREADS_WITH_BULK  # not 4 x 100 + 8
    assert server.servicer.grpc_pull_limit == GRPC_THREADS_WITH_BULK // 2
    server.servicer.grpc_pull_limit = 1
    channel = grpc.insecure_channel(server.address, options=GRPC_OPTIONS)
    pull = channel.unary_stream(f"/{SERVICE}/Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
                                response_deserializer=bytes)
    try:
        waiting = pull(ps_pb2.PullRequest(worker_id="a-0", since_version=0, wait_for_version=5, timeout_s=2.0))
        _until(lambda: state.status()["pull_waiters"] == 1)

        # Execute
        with pytest.raises(grpc.RpcError) as err:
            list(pull(ps_pb2.PullRequest(worker_id="a-1", since_version=0, wait_for_version=5, timeout_s=2.0)))

        # Assert: refused with the reason; the first pull still waits and ends by its own deadline
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == (f"1 pulls are waiting on this shard's gRPC port already; pulls go by its "
                                       f"bulk data plane (port {server.bulk.port})")
        assert state.version == 0 and state.status()["pull_waiters"] == 1
        with pytest.raises(grpc.RpcError) as late:
            list(waiting)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        channel.close()
        server.stop(grace_s=0)


def test_a_worker_trickling_frames_on_both_its_connections_holds_one_pool_thread_and_others_go_on(
        tmp_path, monkeypatch):
    # Prepare: a TLS + token shard whose bulk pool has 2 threads; a-0 joined and initialised
    from tests.ps_helpers import join_and_init, start_cluster
    from tests.test_ps_server import encoded, grads
    from hybridfleet.ps.worker.bulk_channel import BulkChannel

    monkeypatch.setattr(bulk_server, "POOL_THREADS", 2)
    cluster = start_cluster(tmp_path)
    server = cluster.servers[0].bulk
    client = cluster.client("a")
    stalled = []
    try:
        assert server.pool_threads == 2
        join_and_init(cluster, client)
        # b-0 starts a push frame on each of its two connections and stops mid-header
        for _ in range(2):
            chan = BulkChannel("127.0.0.1", server.port, cluster.client("b").security.ssl_context, None,
                               cluster.token("b", worker="b-0"))
            sock = chan._connect()
            sock.sendall(b"\x02" + struct.pack("<I", 100) + bytes(10))
            stalled.append(sock)
        # the second waits behind the first (same worker) instead of taking the other thread
        _until(lambda: len(server._queued.get("b-0", ())) == 1)
        expired = server.deadlines.expired

        # Execute: a-0 pushes and pulls meanwhile
        client.push(encoded(client, grads(1.0)), codec="none", base_versions=[0])
        pulled = client.pull(wait_for_versions=[1])

        # Assert: served while both of b-0's frames still stall (no deadline has cut them)
        assert cluster.servers[0].state.version == 1 and client.versions == [1] and pulled
        assert server.deadlines.expired == expired
        assert "b-0" in server._serving
    finally:
        for sock in stalled:
            sock.close()
        client.close()
        cluster.stop()
