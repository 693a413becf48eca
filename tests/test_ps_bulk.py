"""The shard's bulk data plane on a real TLS socket: framing errors, auth, TLS trust, transport choice.

Push/Pull semantics (validation, consistency modes) are covered for both transports in
test_ps_server.py; these tests speak the bulk protocol byte by byte where a well-behaved
client never would.
"""

from __future__ import annotations

import json
import socket
import ssl

import grpc
import numpy as np
import pytest

from hybridfleet.ps.wire import bulk
from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire.bulk import BulkError
from hybridfleet.ps.worker.bulk_channel import BulkChannel, client_ssl_context
from hybridfleet.security import load_pki
from hybridfleet.ps.server import recv_buffers
from tests.ps_helpers import PARAMS, join_and_init, start_cluster
from tests.test_ps_server import encoded, grads


@pytest.fixture(autouse=True)
def _every_payload_in_kept_buffers(monkeypatch):
    """The shards of this module keep receive buffers of any size (not only from 4 MiB), so every
    test here also runs with payloads landing in reused buffers."""
    monkeypatch.setattr(recv_buffers, "MIN_POOLED_BYTES", 1)


@pytest.fixture
def cluster(tmp_path):
    c = start_cluster(tmp_path)
    yield c
    c.stop()


def _raw(cluster, token: str | None = None, hello: dict | None = None) -> tuple[ssl.SSLSocket, str, bytes]:
    """A TLS socket to shard 0's bulk port after a HELLO; returns (socket, status, body)."""
    ctx = client_ssl_context(str(load_pki(cluster.certs).ca_cert))
    sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", cluster.servers[0].bulk.port), timeout=10),
                           server_hostname="127.0.0.1")
    hello = hello if hello is not None else {"magic": bulk.MAGIC, "wire_version": 1,
                                             "token": cluster.token() if token is None else token}
    sock.sendall(bulk._frame(bytes([bulk.OP_HELLO]), json.dumps(hello).encode()))
    status, body = bulk._read_response(sock)
    return sock, status, body


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def _push_header(client, payloads: dict[str, bytes]) -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(worker_id=client.worker_id, step=client.clock + 1, base_version=0, codec="none",
                             keys=[ps_pb2.KeyBytes(key=k, nbytes=len(v)) for k, v in payloads.items()])


def test_truncated_push_changes_nothing_and_the_shard_serves_on(cluster):
    # Prepare: an initialised shard, and a push that stops half-way through its bytes
    client = cluster.client("a")
    join_and_init(cluster, client)
    before = cluster.params()
    payloads = encoded(client, grads(1.0))
    sock, status, _ = _raw(cluster)
    assert status == "OK"

    # Execute: header + 10 bytes, then the connection drops
    sock.sendall(bulk._frame(bytes([bulk.OP_PUSH]), _push_header(client, payloads).SerializeToString()))
    sock.sendall(b"\0" * 10)
    sock.close()
    client.push(payloads, codec="none", base_versions=[0])  # a whole push on the same shard afterwards

    # Assert: only the whole push counted, the truncated one left no trace
    state = cluster.servers[0].state
    assert state.version == 1
    after = cluster.params()
    assert all(not np.array_equal(before[k], after[k]) for k in before)
    assert state.members["a-0"].clock == 1
    client.close()


def test_malformed_push_header_is_refused_and_the_connection_closed(cluster):
    client = cluster.client("a")
    join_and_init(cluster, client)
    sock, _, _ = _raw(cluster)
    sock.sendall(bulk._frame(bytes([bulk.OP_PUSH]), b"\xff\xff\xff garbage"))
    status, body = bulk._read_response(sock)
    assert (status, body.decode()) == ("INVALID_ARGUMENT", "malformed push header")
    assert _closed(sock)
    assert cluster.servers[0].state.version == 0
    client.close()


def test_unknown_operation_is_refused_and_the_connection_closed(cluster):
    sock, _, _ = _raw(cluster)
    sock.sendall(bulk._frame(bytes([99]), b""))
    status, body = bulk._read_response(sock)
    assert (status, body.decode()) == ("INVALID_ARGUMENT", "unknown bulk operation 99")
    assert _closed(sock)


@pytest.mark.parametrize("hello,status,message", [
    ({"magic": "something-else"}, "INVALID_ARGUMENT", "malformed HELLO frame"),
    ({"magic": bulk.MAGIC, "wire_version": 99, "token": ""}, "FAILED_PRECONDITION", "wire version 99 != server's 1"),
    ({"magic": bulk.MAGIC, "wire_version": 1, "token": ""}, "UNAUTHENTICATED", "missing token"),
    ({"magic": bulk.MAGIC, "wire_version": 1, "token": "not.a.token"}, "UNAUTHENTICATED", "malformed"),
])
def test_bad_hello_is_refused_with_the_reason(cluster, hello, status, message):
    sock, got_status, body = _raw(cluster, hello=hello)
    assert got_status == status
    assert message in body.decode()
    assert _closed(sock)


def test_a_monitor_token_may_not_push_on_the_bulk_plane(cluster):
    channel = BulkChannel("127.0.0.1", cluster.servers[0].bulk.port,
                          client_ssl_context(str(load_pki(cluster.certs).ca_cert)), None, cluster.token(role="monitor"))
    with pytest.raises(BulkError) as err:
        channel.push(ps_pb2.PushHeader(worker_id="a-0", step=1), [])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role" in err.value.details()
    channel.close()


def test_push_over_the_cap_is_refused_and_the_connection_stays_usable(tmp_path):
    # Prepare: a 1 KiB push cap
    cluster = start_cluster(tmp_path, max_push_bytes=1024)
    try:
        client = cluster.client("a")
        join_and_init(cluster, client)
        payloads = encoded(client, grads(1.0))
        big = dict(payloads, **{"fc.weight": payloads["fc.weight"] + b"\0" * 4096})
        # Execute / Assert: refused with the cap named; the next push on the same connection works
        with pytest.raises(grpc.RpcError) as err:
            client.push(big, codec="none", base_versions=[0])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "exceeds the cap of 1024 bytes" in err.value.details()
        channel_socket = client._bulk[0]._sock
        client.clock -= 1  # the refused push did not count
        client.push(payloads, codec="none", base_versions=[0])
        assert client._bulk[0]._sock is channel_socket
        assert cluster.servers[0].state.version == 1
        client.close()
    finally:
        cluster.stop()


def test_client_that_does_not_trust_the_ca_cannot_connect(cluster, tmp_path):
    from hybridfleet.security import make_dev_pki

    other = make_dev_pki(tmp_path / "other-ca")
    channel = BulkChannel("127.0.0.1", cluster.servers[0].bulk.port, client_ssl_context(str(other.ca_cert)), None,
                          cluster.token())
    with pytest.raises(BulkError) as err:
        channel.pull(ps_pb2.PullRequest(worker_id="a-0"), timeout_s=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in err.value.details()


def test_plaintext_client_cannot_talk_to_the_tls_bulk_port(cluster):
    channel = BulkChannel("127.0.0.1", cluster.servers[0].bulk.port, None, None, cluster.token())
    with pytest.raises(BulkError) as err:
        channel.pull(ps_pb2.PullRequest(worker_id="a-0"), timeout_s=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_bulk_plane_wants_the_client_certificate(tmp_path):
    # Prepare: a shard of a job with mutual TLS
    from hybridfleet.ps.worker.client import ClientSecurity, PSClient
    from hybridfleet.ps.server.serve import server_security, start_shard
    from hybridfleet.security import TokenIssuer, generate_signing_key, make_dev_pki
    from hybridfleet.spec import parse_spec

    spec = parse_spec({"name": "unit", "framework": "torch", "entrypoint": "train.py",
                       "sites": {"a": {"workers": 1}}, "security": {"mutual_tls": True},
                       "ps": {"shards": 1, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}})
    pki = make_dev_pki(tmp_path / "certs", clients=["a"])  # one client certificate per site, CN = site
    generate_signing_key(tmp_path / "certs")
    server = start_shard(spec, 0, "127.0.0.1", 0, server_security(spec, tmp_path / "certs"))
    token = TokenIssuer.from_dir(tmp_path / "certs").issue("unit", "a", "worker", 600, worker="a-0")
    try:
        # Execute / Assert: without a client certificate the TLS handshake fails
        bare = BulkChannel("127.0.0.1", server.bulk.port, client_ssl_context(str(pki.ca_cert)), None, token)
        with pytest.raises(BulkError) as err:
            bare.pull(ps_pb2.PullRequest(worker_id="a-0"), timeout_s=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # with one, a worker joins and pushes on the bulk plane
        pair = pki.clients["a"]
        sec = ClientSecurity.from_files(str(pki.ca_cert), str(pair.cert), str(pair.key), token=token)
        client = PSClient([server.address], sec, "a-0", "a", 0, retry_timeout_s=2)
        client.join(PARAMS, spec.ps.block_size_bytes, "none", "torch")
        assert client.transport == ["bulk"]
        blocks = {}
        for name, shape in ((p.name, p.shape) for p in PARAMS):
            blocks.update(client.plan.split(name, np.zeros(int(np.prod(shape)), np.float32)))
        client.push({k: v.tobytes() for k, v in blocks.items()}, codec="none", kind="INIT")
        assert server.state.is_initialized()
        client.close()
    finally:
        server.stop(0)


def test_transport_grpc_in_the_job_means_no_bulk_listener_and_push_pull_on_grpc(tmp_path):
    # Prepare: a shard of a job that asks for gRPC only
    from hybridfleet.ps.server.serve import server_security, start_shard
    from hybridfleet.security import TokenIssuer, generate_signing_key, make_dev_pki
    from tests.ps_helpers import Cluster, job_spec

    spec = job_spec(transport="grpc")
    certs = tmp_path / "certs"
    make_dev_pki(certs)
    generate_signing_key(certs)
    server = start_shard(spec, 0, "127.0.0.1", 0, server_security(spec, certs))
    cluster = Cluster(spec, certs, TokenIssuer.from_dir(certs), [server], transport="grpc")
    try:
        # Execute: a client that would use the bulk plane if offered
        client = cluster.client("a", transport="auto")
        join_and_init(cluster, client)
        client.push(encoded(client, grads(1.0)), codec="none", base_versions=[0])
        # Assert
        assert server.bulk is None and client.transport == ["grpc"]
        assert server.state.version == 1
        client.close()
    finally:
        server.stop(0)


def test_bytes_are_counted_exactly_on_the_bulk_plane(cluster):
    # Prepare
    client = cluster.client("a")
    join_and_init(cluster, client)
    payloads = encoded(client, grads(1.0))
    before_sent, before_received = dict(client.bytes.sent), dict(client.bytes.received)

    # Execute: one push and one pull of the round it closed
    client.push(payloads, codec="none", base_versions=[0])
    client.pull(wait_for_versions=[1])

    # Assert: payload bytes to the byte; frames counted apart from them
    sent = {k: v - before_sent.get(k, 0) for k, v in client.bytes.sent.items()}
    received = {k: v - before_received.get(k, 0) for k, v in client.bytes.received.items()}
    assert sent["gradients"] == sum(len(v) for v in payloads.values())
    assert received["params"] == (12 + 4) * 4  # fc.weight and fc.bias values, float32
    assert sent["framing"] == 2 * 5  # op + header length, per request
    assert received["control"] > 0 and sent["control"] > 0
    client.close()


def test_a_shard_side_failure_is_reported_as_internal_and_changes_nothing(cluster, monkeypatch):
    # Prepare: the shard's state fails unexpectedly while applying a push
    client = cluster.client("a")
    join_and_init(cluster, client)
    before = cluster.params()

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(cluster.servers[0].state, "push", broken)

    # Execute
    with pytest.raises(grpc.RpcError) as err:
        client.push(encoded(client, grads(1.0)), codec="none", base_versions=[0])

    # Assert
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in err.value.details()
    assert all(np.array_equal(before[k], v) for k, v in cluster.params().items())
    client.close()


def test_a_transfer_that_stops_moving_fails_fast_as_unavailable(monkeypatch):
    # Prepare: a stand-in shard (plain TCP, speaking the bulk frames) that stalls half-way through a pull reply
    import threading
    import time

    from hybridfleet.ps.worker import bulk_channel

    monkeypatch.setattr(bulk_channel, "IDLE_TIMEOUT_S", 0.5)
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def stalling_shard():
        conn, _ = listener.accept()
        with conn:
            for _ in range(2):  # HELLO, then the PULL request
                size = bulk._U32.unpack(bulk.recv_exact(conn, 5)[1:].tobytes())[0]
                bulk.recv_exact(conn, size)
                if _ == 0:
                    conn.sendall(bulk._response("OK"))
            meta = json.dumps({"version": 1, "items": [["fc.weight", 0, 1000]]}).encode()
            conn.sendall(bulk._response("OK", meta) + b"\0" * 10)
            release.wait(10)

    thread = threading.Thread(target=stalling_shard, daemon=True)
    thread.start()
    channel = BulkChannel("127.0.0.1", listener.getsockname()[1], None, None, "token")

    # Execute: the pull may wait 60 s for its round, but the reply stops moving
    start = time.monotonic()
    with pytest.raises(BulkError) as err:
        channel.pull(ps_pb2.PullRequest(worker_id="a-0"), timeout_s=60)
    waited = time.monotonic() - start

    # Assert
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "timed out" in err.value.details()
    assert waited < 10
    release.set()
    listener.close()


def test_status_names_the_bulk_port(cluster):
    client = cluster.client("a")
    join_and_init(cluster, client)
    (status,) = client.status()
    assert status["bulk_port"] == cluster.servers[0].bulk.port == client._bulk[0].port
    client.close()


def test_the_retry_window_starts_at_the_first_failure_not_at_the_call():
    # Prepare: a call that waits longer than the retry window, fails once as unavailable, then works
    import time

    from hybridfleet.ps.worker.client import ClientSecurity, PSClient

    client = PSClient(["127.0.0.1:9"], ClientSecurity(insecure=True), "a-0", "a", 0, retry_timeout_s=0.3)
    calls = []

    def slow_then_fine(stub):
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.5)  # e.g. a pull held until its round closes
            raise BulkError(grpc.StatusCode.UNAVAILABLE, "connection dropped")
        return "ok"

    # Execute / Assert
    assert client._call(0, slow_then_fine, what="pull") == "ok"
    assert len(calls) == 2
    client.close(leave=False)


def test_allocator_tuning_applies_where_glibc_is_the_libc():
    import platform

    from hybridfleet.ps.alloc import tune_allocator

    assert tune_allocator(trim_bytes=64 << 20) is (platform.libc_ver()[0] == "glibc")


def test_a_burst_of_connections_from_one_address_all_get_in(cluster):
    # Prepare: 30 workers' channels from one address (a site behind one NAT address joining at once);
    # the shard keeps at most PENDING_PER_SOURCE handshakes of one address and ends the oldest (its
    # bulk plane serves 32 connections here)
    import threading

    from hybridfleet.ps.server.bulk_server import PENDING_PER_SOURCE

    ctx = client_ssl_context(str(load_pki(cluster.certs).ca_cert))
    bulk_server = cluster.servers[0].bulk
    channels = [BulkChannel("127.0.0.1", bulk_server.port, ctx, None, cluster.token(worker=f"a-{i}"))
                for i in range(30)]
    start, socks, errors = threading.Barrier(len(channels)), {}, []

    def connect(i: int) -> None:
        start.wait()
        try:
            socks[i] = channels[i]._connect()
        except Exception as err:  # noqa: BLE001 - collected for the assertion below
            errors.append(repr(err))

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(len(channels))]

    # Execute
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    # Assert: handshakes were ended by the burst, and every channel got in on a later attempt
    assert bulk_server._slots.evicted > 0, f"the burst never exceeded {PENDING_PER_SOURCE} pending handshakes"
    assert errors == [] and len(socks) == len(channels)
    for s in socks.values():
        s.close()


def test_a_connection_closed_in_its_handshake_is_retried_without_touching_the_scripts_rng(monkeypatch):
    # Prepare: a listener that ends each connection at once (a shard evicting pending handshakes);
    # the script's own `random` state, which its checkpoints record for an exact resume
    import random
    import threading

    from hybridfleet.ps.worker import bulk_channel

    monkeypatch.setattr(bulk_channel, "CONNECT_ATTEMPTS", 3)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve() -> None:
        for _ in range(3):
            conn, _ = listener.accept()
            accepted.append(conn)
            conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    random.seed(1234)
    before = random.getstate()
    channel = BulkChannel("127.0.0.1", listener.getsockname()[1], None, None, "token")

    # Execute
    with pytest.raises((EOFError, ConnectionError)):
        channel._connect()
    server.join(10)
    listener.close()

    # Assert: three attempts, and the script's generator is where it was
    assert len(accepted) == 3
    assert random.getstate() == before


def test_a_refused_connection_is_not_tried_again(monkeypatch):
    # Prepare: a port nobody listens on
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    channel = BulkChannel("127.0.0.1", port, None, None, "token")
    attempts = []
    once = channel._connect_once
    monkeypatch.setattr(channel, "_connect_once", lambda: attempts.append(1) or once())

    # Execute / Assert: refused once, raised at once
    with pytest.raises(ConnectionRefusedError):
        channel._connect()
    assert attempts == [1]
