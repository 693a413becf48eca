"""The parameter server under attack, in-process against a real TLS + token shard (gRPC and bulk plane).

Each test trains a legitimate two-site job (a-0, b-0) through the shard, attacks it
between or during rounds, asserts each refusal's message and that parameters,
membership and round state are unchanged, then lets the job finish: its accuracy
must reach 0.95, and this process (which hosts the shard) must stay below 2 GiB of
resident memory throughout the attack.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import grpc
import numpy as np
import pytest

from hybridfleet.codec.frame import pack_frame
from hybridfleet.errors import AuthError
from hybridfleet.ps.wire._proto import ps_pb2
from hybridfleet.ps.wire.protocol import WIRE_VERSION
from hybridfleet.ps.wire.sharding import ParamSpec
from tests.ps_attack_helpers import (
    GIB, LegitJob, RssWatch, assert_unchanged, grpc_stub, shard_state, wait_until,
)
from tests.ps_helpers import PARAMS, start_cluster

TOTAL_STEPS = 40
ATTACKER = {"a": {"workers": 1}, "b": {"workers": 1}, "c": {"workers": 1}}  # c: an insider site


@pytest.fixture(params=["auto", "grpc"], ids=["bulk", "grpc"])
def transport(request):
    return request.param


def _finish(job: LegitJob, watch: RssWatch) -> None:
    job.train(TOTAL_STEPS - job.steps_done)
    assert job.accuracy() >= 0.95
    assert watch.peak < 2 * GIB, f"shard process RSS reached {watch.peak / GIB:.2f} GiB"
    job.close()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def _join_request(worker_id: str, site: str, params=PARAMS, block: int | None = None, shards: int = 1,
                  spec=None) -> ps_pb2.JoinRequest:
    return ps_pb2.JoinRequest(
        wire_version=WIRE_VERSION, worker_id=worker_id, site=site, num_shards=shards, codec="none",
        block_size_bytes=block if block is not None else spec.ps.block_size_bytes, framework="torch",
        params=[ps_pb2.TensorSpec(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in params])


# ------------------------------------------------------------------ identity (item 1)
def test_a_worker_cannot_act_as_another_worker_site_or_role(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport)
    job = LegitJob(cluster)
    try:
        with RssWatch() as watch:
            job.train(10)
            before = shard_state(cluster)
            a_token = cluster.token("a", worker="a-0")
            stub, md, channel = grpc_stub(cluster, a_token)
            spec = cluster.spec
            cases = [
                (lambda: stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id="b-0"), metadata=md, timeout=5),
                 "PERMISSION_DENIED", "token is for worker 'a-0'; the request names worker 'b-0'"),
                (lambda: stub.Leave(ps_pb2.LeaveRequest(worker_id="b-0"), metadata=md, timeout=5),
                 "PERMISSION_DENIED", "token is for worker 'a-0'; the request names worker 'b-0'"),
                (lambda: stub.Join(_join_request("b-0", "b", spec=spec), metadata=md, timeout=5),
                 "PERMISSION_DENIED", "token is for site 'a', join claims site 'b'"),
                (lambda: stub.Join(_join_request("a-7", "a", spec=spec), metadata=md, timeout=5),
                 "PERMISSION_DENIED", "token is for worker 'a-0'; the request names worker 'a-7'"),
                (lambda: list(stub.Pull(ps_pb2.PullRequest(worker_id="b-0"), metadata=md, timeout=5)),
                 "PERMISSION_DENIED", "token is for worker 'a-0'; the request names worker 'b-0'"),
            ]
            # a token the issuer bound to a worker id the job does not define (site a has one worker)
            extra = cluster.token("a", worker="a-1")
            cases.append((lambda: stub.Join(_join_request("a-1", "a", spec=spec),
                                            metadata=(("authorization", f"Bearer {extra}"),), timeout=5),
                          "PERMISSION_DENIED", "worker id 'a-1' is not one of site 'a'"))
            # roles that are not a worker, and a site-wide token naming no worker
            for role, message in [("admin", "role 'admin' is not allowed"), ("shard", "role 'shard' is not allowed")]:
                tok = cluster.token("a", role=role)
                cases.append((lambda tok=tok: stub.Join(_join_request("a-0", "a", spec=spec),
                                                        metadata=(("authorization", f"Bearer {tok}"),), timeout=5),
                              "PERMISSION_DENIED", message))
            site_wide = cluster.issuer.issue(spec.name, "a", "worker", 600)
            cases.append((lambda: stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id="a-0"),
                                                 metadata=(("authorization", f"Bearer {site_wide}"),), timeout=5),
                          "PERMISSION_DENIED", "token names no worker"))
            for call, code, message in cases:
                err = _refused(call)
                assert err.code().name == code, (message, err.details())
                assert message in err.details()
            # pushes naming another worker, on the job's transport (bulk plane or gRPC)
            impostor = cluster.client("a", worker_id="b-0", token=a_token)
            impostor.plan = job.clients["a"].plan
            impostor._set_bulk(0, cluster.servers[0].bulk.port)
            payloads = job._encoded(impostor, {"fc.weight": np.ones((4, 3), np.float32),
                                               "fc.bias": np.ones(4, np.float32)})
            with pytest.raises(AuthError) as err:  # the client turns an auth refusal into AuthError
                impostor.push(payloads, codec="none", base_versions=[before[0]["version"]])
            assert "token is for worker 'a-0'; the request names worker 'b-0'" in str(err.value)
            impostor.close(leave=False)
            channel.close()
            assert_unchanged(before, shard_state(cluster))
            _finish(job, watch)
    finally:
        cluster.stop()


def test_revoked_token_is_refused_within_a_second_and_the_job_goes_on(tmp_path):
    from hybridfleet.security.tokens import revoke, unverified_claims

    cluster = start_cluster(tmp_path, sites=ATTACKER)
    job = LegitJob(cluster)
    try:
        with RssWatch() as watch:
            job.train(5)
            token = cluster.token("c", worker="c-0")
            stub, md, channel = grpc_stub(cluster, token)
            stub.Join(_join_request("c-0", "c", spec=cluster.spec), metadata=md, timeout=5)
            stub.Leave(ps_pb2.LeaveRequest(worker_id="c-0"), metadata=md, timeout=5)
            before = shard_state(cluster)
            revoke(cluster.certs, [unverified_claims(token)["jti"]])
            assert wait_until(lambda: _heartbeat_error(stub, md) is not None, 3.0)
            err = _heartbeat_error(stub, md)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "has been revoked" in err.details()
            from hybridfleet.ps.wire.bulk import BulkError
            from hybridfleet.ps.worker.bulk_channel import BulkChannel

            bulk = BulkChannel("127.0.0.1", cluster.servers[0].bulk.port,
                               cluster.client("c").security.ssl_context, None, token)
            with pytest.raises(BulkError) as berr:
                bulk.pull(ps_pb2.PullRequest(worker_id="c-0"), timeout_s=5)
            assert "has been revoked" in berr.value.details()
            channel.close()
            assert_unchanged(before, shard_state(cluster))
            _finish(job, watch)
    finally:
        cluster.stop()


def _heartbeat_error(stub, md):
    try:
        stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id="c-0"), metadata=md, timeout=5)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            return err
    return None


def test_mutual_tls_certificate_of_another_site_is_refused(tmp_path):
    from hybridfleet.ps.wire.bulk import BulkError
    from hybridfleet.ps.worker.bulk_channel import BulkChannel, client_ssl_context
    from hybridfleet.ps.worker.client import ClientSecurity, PSClient
    from hybridfleet.security import load_pki

    cluster = start_cluster(tmp_path, security={"mutual_tls": True})
    pki = load_pki(cluster.certs)

    def client(site: str, cert_site: str, worker_id: str):
        pair = pki.clients[cert_site]
        sec = ClientSecurity.from_files(str(pki.ca_cert), str(pair.cert), str(pair.key),
                                        token=cluster.token(site, worker=worker_id))
        return PSClient(cluster.addresses, sec, worker_id, site, 0, retry_timeout_s=2)

    cluster.client = lambda site="a", **kw: client(site, site, f"{site}-0")  # each site with its own certificate
    job = LegitJob(cluster)
    try:
        with RssWatch() as watch:
            job.train(5)
            before = shard_state(cluster)
            # site a's token with site b's certificate (a stolen token used from another site)
            thief = client("a", "b", "a-0")
            with pytest.raises(AuthError) as err:
                thief.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
            assert "client certificate is for site 'b', the token for site 'a'" in str(err.value)
            thief.close(leave=False)
            pair = pki.clients["b"]
            bulk = BulkChannel("127.0.0.1", cluster.servers[0].bulk.port,
                               client_ssl_context(str(pki.ca_cert), str(pair.cert), str(pair.key)), None,
                               cluster.token("a", worker="a-0"))
            with pytest.raises(BulkError) as berr:
                bulk.pull(ps_pb2.PullRequest(worker_id="a-0"), timeout_s=5)
            assert "client certificate is for site 'b', the token for site 'a'" in berr.value.details()
            assert_unchanged(before, shard_state(cluster))
            _finish(job, watch)
    finally:
        cluster.stop()


# --------------------------------------------------------- the job defines the model (item 2)
def test_join_cannot_reshape_the_model_and_the_plan_comes_from_the_job(tmp_path):
    cluster = start_cluster(tmp_path, max_tensors=100, max_model_bytes=1 << 20)
    try:
        spec = cluster.spec
        stub, md, channel = grpc_stub(cluster, cluster.token("a", worker="a-0"))
        huge = [ParamSpec("w", (1 << 20, 1 << 20))]
        many = [ParamSpec(f"p{i}", (1,)) for i in range(5000)]
        cases = [
            (_join_request("a-0", "a", PARAMS, block=8, spec=spec), "FAILED_PRECONDITION",
             f"join asks for blocks of 8 bytes; this job's ps.block_size_bytes is {spec.ps.block_size_bytes}"),
            (_join_request("a-0", "a", huge, spec=spec), "RESOURCE_EXHAUSTED",
             "join declares a model of 4398046511104 bytes; this job allows at most 1048576 (ps.max_model_bytes)"),
            (_join_request("a-0", "a", many, spec=spec), "RESOURCE_EXHAUSTED",
             "join declares 5000 tensors; this job allows at most 100 (ps.max_tensors)"),
            (_join_request("a-0", "a", PARAMS, shards=4, spec=spec), "INVALID_ARGUMENT",
             "the job has 1 shard(s) but the worker was given 4 shard address(es); expected 1"),
            (_deep_join(spec), "INVALID_ARGUMENT", "tensor 'w' has 100000 dimensions; at most 32 are allowed"),
        ]
        with RssWatch() as watch:
            tracemalloc.start()
            for request, code, message in cases:
                err = _refused(lambda: stub.Join(request, metadata=md, timeout=10))
                assert err.code().name == code and message in err.details(), err.details()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 64 << 20, f"refused joins allocated {peak} bytes"
            state = cluster.servers[0].state
            assert state.plan is None and state.members == {}
            job = LegitJob(cluster)
            before = shard_state(cluster)
            for request, code, message in cases:  # once the plan is fixed, still refused, nothing moves
                assert message in _refused(lambda: stub.Join(request, metadata=md, timeout=10)).details()
            assert_unchanged(before, shard_state(cluster))
            channel.close()
            _finish(job, watch)
    finally:
        cluster.stop()


def _deep_join(spec) -> ps_pb2.JoinRequest:
    request = _join_request("a-0", "a", PARAMS, spec=spec)
    request.params.append(ps_pb2.TensorSpec(name="w", shape=[2**62] * 100_000, dtype="float32"))
    return request


def test_topk_frame_claiming_2e8_elements_is_refused_before_any_allocation(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport, compression={"codec": "topk", "ratio": 1.0})
    job = LegitJob(cluster)
    try:
        with RssWatch() as watch:
            job.train(10)
            before = shard_state(cluster)
            client = job.clients["a"]
            fields = [struct.pack("<IB", 0, 0), b"", b""]
            forged = {
                "float64": pack_frame("topk", np.dtype("float64"), (200_000_000,), fields),
                "float32": pack_frame("topk", np.dtype("float32"), (200_000_000,), fields),
            }
            tracemalloc.start()
            for dtype, frame in forged.items():
                assert len(frame) < 64
                payloads = {"fc.weight": bytes(frame), "fc.bias": job.codec.encode(np.zeros(4, np.float32))}
                err = _refused(lambda: client.push(payloads, codec="topk", base_versions=[before[0]["version"]]))
                client.clock -= 1  # the refused push does not count
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"key 'fc.weight': frame holds {dtype} of shape (200000000,), expected 12 elements" in err.details()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 64 << 20, f"refusing the frames allocated {peak} bytes"
            assert_unchanged(before, shard_state(cluster))
            _finish(job, watch)
    finally:
        cluster.stop()


def test_push_fields_contributors_step_and_sizes_are_validated(tmp_path, transport):
    cluster = start_cluster(tmp_path, transport=transport)
    job = LegitJob(cluster)
    try:
        with RssWatch() as watch:
            job.train(10)
            before = shard_state(cluster)
            client = job.clients["a"]
            version = before[0]["version"]
            good = job._encoded(client, {"fc.weight": np.ones((4, 3), np.float32), "fc.bias": np.ones(4, np.float32)})

            err = _refused(lambda: client.push(good, codec="none", base_versions=[version], contributors=2**32 - 1))
            client.clock -= 1
            assert "push counts 4294967295 contributors; site 'a' has 1 worker(s)" in err.details()

            saved = client.clock
            client.clock = 2**64 - 2  # the next push claims step 2**64 - 1
            err = _refused(lambda: client.push(good, codec="none", base_versions=[version]))
            client.clock = saved
            assert err.code() == grpc.StatusCode.OUT_OF_RANGE
            assert f"push step {2**64 - 1} is beyond the consistency window" in err.details()

            # a push declaring more bytes than its key can hold, refused before the bytes are read
            big = dict(good, **{"fc.bias": good["fc.bias"] + b"\0" * 4096})
            err = _refused(lambda: client.push(big, codec="none", base_versions=[version]))
            client.clock -= 1
            assert "key 'fc.bias': push declares" in err.details() and "at most 576 bytes" in err.details()
            assert_unchanged(before, shard_state(cluster))
            _finish(job, watch)
    finally:
        cluster.stop()


# ----------------------------------------------------------------- bounded resources (item 3)
def test_pulls_cannot_pin_the_shard_and_their_wait_is_capped(tmp_path, monkeypatch):
    import hybridfleet.ps.server.downlink as downlink_mod

    monkeypatch.setattr(downlink_mod, "PULL_WAIT_CEILING_S", 2.0)
    cluster = start_cluster(tmp_path, transport="grpc", sites=ATTACKER)
    job = LegitJob(cluster)
    try:
        with RssWatch() as watch:
            job.train(5)
            stub, md, channel = grpc_stub(cluster, cluster.token("c", worker="c-0"))
            stub.Join(_join_request("c-0", "c", spec=cluster.spec), metadata=md, timeout=5)
            stub.Leave(ps_pb2.LeaveRequest(worker_id="c-0"), metadata=md, timeout=5)  # out of the quorum
            results: list = []

            def greedy_pull():
                started = time.monotonic()
                try:
                    list(stub.Pull(ps_pb2.PullRequest(worker_id="c-0", wait_for_version=10**9, timeout_s=1e9),
                                   metadata=md, timeout=60))
                    results.append(("ok", "", 0.0))
                except grpc.RpcError as err:
                    results.append((err.code().name, err.details(), time.monotonic() - started))

            gate = cluster.servers[0].servicer.gate
            most = [0]
            sampling = threading.Event()

            def sample():  # the most calls c-0 ever had running on the shard
                while not sampling.wait(0.005):
                    with gate._lock:
                        most[0] = max(most[0], gate._active.get("c-0", 0))

            threads = [threading.Thread(target=greedy_pull) for _ in range(32)]
            sampler = threading.Thread(target=sample)
            sampler.start()
            for t in threads:
                t.start()
            job.train(15)  # the legit job trains while the 32 pulls are outstanding
            for t in threads:
                t.join(60)
            sampling.set()
            sampler.join()
            assert len(results) == 32
            # refused by the per-worker gate, by HTTP/2's stream cap (REFUSED_STREAM), or waited out the cap
            assert all(r[0] in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED") or "RST_STREAM" in r[1] for r in results)
            assert most[0] == 4  # never more than its share of the shard's threads
            refused = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
            assert all("worker c-0 already has 4 calls running on this shard" in r[1] for r in refused)
            waited = [r[2] for r in results if r[0] == "DEADLINE_EXCEEDED"]
            assert max(waited) < 10  # each capped at 2 s on the shard, not the 1e9 s asked for
            channel.close()
            _finish(job, watch)
    finally:
        cluster.stop()


def test_bulk_plane_caps_connections_and_cuts_slow_handshakes_and_frames(tmp_path, monkeypatch):
    import hybridfleet.ps.server.bulk_server as bulk_mod

    monkeypatch.setattr(bulk_mod, "HANDSHAKE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(bulk_mod, "FRAME_DEADLINE_S", 1.0)
    cluster = start_cluster(tmp_path, sites=ATTACKER)
    job = LegitJob(cluster)
    server = cluster.servers[0].bulk
    port = server.port
    try:
        with RssWatch() as watch:
            job.train(5)
            threads_before = threading.active_count()
            # 1. a flood of connections that never say HELLO: at most MAX_PENDING_HANDSHAKES get a thread
            flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
            time.sleep(0.3)
            assert threading.active_count() - threads_before <= bulk_mod.MAX_PENDING_HANDSHAKES + 2
            job.train(3)  # connected workers go on meanwhile
            # every one is cut by the handshake deadline (or refused at once): each reads EOF
            for s in flood:
                s.settimeout(5)
                try:
                    assert s.recv(1) == b""
                except (ConnectionResetError, TimeoutError) as err:  # noqa: PERF203
                    assert not isinstance(err, TimeoutError), "a silent connection outlived the handshake deadline"
                s.close()
            # 2. slowloris in the TLS handshake: one byte of a ClientHello every 0.3 s
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port)) as s:
                assert _trickle(s, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64)), \
                    "a trickling handshake outlived its deadline"
            # cut within the deadline, by the watchdog or by CPython's own whole-handshake timeout
            assert time.monotonic() - started < 6
            # 3. slowloris inside a frame: HELLO accepted, a valid push frame start, then one header
            #    byte every 0.3 s (each recv is quick: only the whole-frame deadline can stop it)
            from hybridfleet.ps.worker.bulk_channel import BulkChannel

            token = cluster.token("c", worker="c-0")
            chan = BulkChannel("127.0.0.1", port, cluster.client("c").security.ssl_context, None, token)
            sock = chan._connect()
            expired = server.deadlines.expired
            started = time.monotonic()
            sock.sendall(b"\x02" + struct.pack("<I", 100))
            assert _trickle(sock, bytes(100)), "a trickling frame outlived its deadline"
            assert time.monotonic() - started < 6 and server.deadlines.expired > expired
            sock.close()
            # 4. per identity: a third bulk connection of c-0 is refused
            open_ = [BulkChannel("127.0.0.1", port, chan.ssl_context, None, token)._connect() for _ in range(2)]
            from hybridfleet.ps.wire.bulk import BulkError

            with pytest.raises(BulkError) as err:
                BulkChannel("127.0.0.1", port, chan.ssl_context, None, token)._connect()
            assert "worker c-0 already has 2 bulk connections to this shard" in err.value.details()
            for s in open_:
                s.close()
            assert server.deadlines.expired >= 1
            assert wait_until(lambda: threading.active_count() <= threads_before + 2, 10)
            _finish(job, watch)
    finally:
        cluster.stop()


def _trickle(sock, data: bytes, every_s: float = 0.3) -> bool:
    """Send ``data`` one byte every ``every_s``; True once the shard has cut the connection."""
    try:
        for i in range(len(data)):
            sock.sendall(data[i:i + 1])
            time.sleep(every_s)
    except OSError:
        return True
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_one_push_in_flight_per_worker_and_a_shard_memory_budget():
    from hybridfleet.ps.server.limits import ByteBudget
    from hybridfleet.ps.wire.reject import Reject

    budget = ByteBudget(1000, wait_s=0.2)
    with budget.hold("a-0", 600):
        with pytest.raises(Reject) as err:
            with budget.hold("a-0", 10):
                pass
        assert "worker a-0 already has a push in flight on this shard" in err.value.message
        with pytest.raises(Reject) as err:
            with budget.hold("b-0", 500):
                pass
        assert "would exceed the shard's memory budget (600 of 1000 bytes in flight for 0.2 s)" in err.value.message
        with budget.hold("b-0", 400):
            assert budget.in_flight() == 1000
    assert budget.in_flight() == 0
    with pytest.raises(Reject, match="exceeds the shard's memory budget of 1000 bytes"):
        with budget.hold("c-0", 1001):
            pass
    # a push that fits once another finishes (or its worker's previous one ends) waits instead of failing
    done = []

    def second_push():
        with budget.hold("b-0", 500):
            done.append(budget.in_flight())

    with budget.hold("a-0", 900):
        t = threading.Thread(target=second_push)
        budget.wait_s = 5.0
        t.start()
        time.sleep(0.1)
        assert done == []
    t.join(5)
    assert done == [500]
