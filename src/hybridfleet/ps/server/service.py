"""The gRPC shard server: moves bytes between the wire and `ShardState`.

Every RPC is authenticated by the interceptor from `hybridfleet.security` unless
the server was started with ``insecure=True`` (an explicit flag); every request
naming a worker is then bound to the token's worker and site (`identity`), and
held to that worker's share of the shard (`limits`).
"""

from __future__ import annotations

import json
import ssl
import threading
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from hybridfleet.errors import PortInUseError
from hybridfleet.obs.log import get_logger
from hybridfleet.codec.frame import MAX_NDIM
from hybridfleet.ps.wire import fastwire
from hybridfleet.ps.wire._proto import ps_pb2, ps_pb2_grpc
from hybridfleet.ps.server import downlink
from hybridfleet.ps.server.identity import bind_worker, grpc_peer_site
from hybridfleet.ps.server.limits import GRPC_THREADS_WITH_BULK, ByteBudget, CallGate, server_threads
from hybridfleet.ps.server.shard import ShardState
from hybridfleet.obs.metrics import count_rejected_push
from hybridfleet.ps.wire.reject import Reject, check_push_header
from hybridfleet.ps.wire.sharding import ParamSpec
from hybridfleet.ps.wire.protocol import GRPC_OPTIONS, METHOD_ROLES, SERVICE, WIRE_VERSION
from hybridfleet.security.grpc_auth import current_claims

log = get_logger("ps.server")

# A TLS handshake must finish within 10 s (gRPC's default is 120 s); one connection carries
# at most 16 concurrent streams (a worker needs 3: push, pull, heartbeat).
SERVER_OPTIONS = [("grpc.server_handshake_timeout_ms", 10_000), ("grpc.max_concurrent_streams", 16)]


def _claims_site(default: str, claims=None) -> str:
    """The site of the caller's verified token (``claims``, else the RPC's), or ``default`` when auth is off."""
    claims = claims if claims is not None else current_claims()
    return claims.site if claims is not None else default


class ShardServicer(ps_pb2_grpc.ParameterServerServicer):
    """Implements the ParameterServer service over one `ShardState`."""

    def __init__(self, state: ShardState, max_push_bytes: int):
        self.state = state
        self.max_push_bytes = max_push_bytes
        self.gate = CallGate()
        # what the compressed downlink's delta log holds counts against the budget
        self.budget = ByteBudget(state.spec.memory_budget_bytes, reserved=lambda: state.delta_log_bytes)
        self._cache: dict[tuple, tuple[object, list[bytes]]] = {}
        self._cache_version = -1
        self._cache_lock = threading.Lock()
        self.bulk_port = 0  # set when the shard serves the bulk data plane
        # with a bulk plane and a fixed number of gRPC threads, pulls waiting on gRPC are bounded
        # (None: no bound, every worker has its threads)
        self.grpc_pull_limit: int | None = None
        self._grpc_pulls = 0
        self._grpc_pull_lock = threading.Lock()

    @staticmethod
    def _abort(context: grpc.ServicerContext, rej: Reject):
        context.abort(getattr(grpc.StatusCode, rej.code), rej.message)

    def Join(self, request, context):
        if request.wire_version != WIRE_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"wire version {request.wire_version} != server's {WIRE_VERSION}; upgrade the older side")
        site = _claims_site(request.site)
        if site != request.site:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"token is for site {site!r}, join claims site {request.site!r}")
        try:
            identity = bind_worker(request.worker_id, current_claims(), grpc_peer_site(context))
            if len(request.params) > self.state.spec.max_tensors:
                raise Reject("RESOURCE_EXHAUSTED", f"join declares {len(request.params)} tensors; this job allows "
                                                   f"at most {self.state.spec.max_tensors} (ps.max_tensors)")
            deep = next((p for p in request.params if len(p.shape) > MAX_NDIM), None)
            if deep is not None:
                raise Reject("INVALID_ARGUMENT", f"tensor {deep.name!r} has {len(deep.shape)} dimensions; at most "
                                                 f"{MAX_NDIM} are allowed")
            with self.gate.enter(identity, "join"):
                params = [ParamSpec(p.name, tuple(p.shape), p.dtype or "float32") for p in request.params]
                res = self.state.join(request.worker_id, request.site, params, request.num_shards,
                                      request.block_size_bytes, request.codec)
        except Reject as rej:
            self._abort(context, rej)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return ps_pb2.JoinResponse(
            wire_version=WIRE_VERSION, shard=self.state.shard, plan_json=res["plan"].to_json(),
            version=res["version"], initialized=res["initialized"], sync=self.state.sync,
            staleness_bound=self.state.spec.staleness_bound, worker_clock=res["worker_clock"],
            live_workers=res["live"], heartbeat_interval_s=self.state.spec.heartbeat_interval_s,
            bulk_port=self.bulk_port)

    def pull_items(self, request: ps_pb2.PullRequest, claims=None, peer_site: str | None = None) -> tuple[int, list]:
        """``(version, [(key, pieces, total_bytes, delta_version)])`` of one pull by the caller of
        ``claims`` (None: auth off); raises Reject."""
        identity = bind_worker(request.worker_id, claims, peer_site)
        with self.gate.enter(identity, "pull"):
            return self.state.pull(request.worker_id, request.since_version, request.wait_for_version,
                                   request.worker_clock, request.timeout_s or 60.0, request.init_digest)

    def open_pull(self, request: ps_pb2.PullRequest, claims=None, peer_site: str | None = None
                  ) -> tuple[Callable[[], None], float]:
        """Start one pull that may park (the bulk plane's): the caller is bound to the request's
        worker and takes one of its calls (`CallGate`) until the returned function is called;
        also returns how long the pull may wait (seconds). Raises Reject."""
        identity = bind_worker(request.worker_id, claims, peer_site)
        gate = self.gate.enter(identity, "pull")
        gate.__enter__()
        wait_s = min(max(0.0, request.timeout_s or 60.0), downlink.PULL_WAIT_CEILING_S)
        return (lambda: gate.__exit__(None, None, None)), wait_s

    def try_pull(self, request: ps_pb2.PullRequest, waiter: Any, expired: bool):
        """The answer of a pull started with `open_pull` if it is ready, else None with ``waiter``
        registered (see `ShardState.pull_now`). Raises Reject."""
        return self.state.pull_now(request.worker_id, request.since_version, request.wait_for_version,
                                   request.worker_clock, request.init_digest, waiter, expired)

    def unpark(self, waiter: Any) -> None:
        self.state.unpark(waiter)

    def poll_parked(self) -> None:
        self.state.poll_parked()

    def Pull(self, request, context):
        with self._grpc_pull_slot(context):
            yield from self._pull_grpc(request, context)

    @contextmanager
    def _grpc_pull_slot(self, context):
        """One of the bounded pulls that may wait on gRPC (no bound without ``grpc_pull_limit``)."""
        if self.grpc_pull_limit is None:
            yield
            return
        with self._grpc_pull_lock:
            full = self._grpc_pulls >= self.grpc_pull_limit
            if not full:
                self._grpc_pulls += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.grpc_pull_limit} pulls are waiting on this shard's gRPC port already; "
                          f"pulls go by its bulk data plane (port {self.bulk_port})")
        try:
            yield
        finally:
            with self._grpc_pull_lock:
                self._grpc_pulls -= 1

    def _pull_grpc(self, request, context):
        try:
            version, items = self.pull_items(request, current_claims(), grpc_peer_site(context))
        except Reject as rej:
            self._abort(context, rej)
        if not items:
            yield fastwire.encode_pull_chunk(version)
            return
        for key, pieces, total, delta_version in items:
            msgs = self._encoded(version, key, pieces, total, delta_version)
            if isinstance(pieces, downlink.LivePieces) and not pieces.intact():  # read from values that changed since
                context.abort(grpc.StatusCode.UNAVAILABLE, "the parameters changed while this pull was read "
                                                           "from them (a round closed without its worker); pull again")
            yield from msgs

    def _encoded(self, version: int, key: str, pieces: list[bytes], total: int, delta_version: int) -> list[bytes]:
        """PullChunk messages for one key, encoded once per version and shared by every puller of it.

        The messages are copies. Pieces that are views of the parameters (`downlink.LivePieces`)
        are not kept with them: holding them would tell the shard a send still reads its
        parameters and make every round step a copy. Their cache entry is named by the array
        they view and its count of writes, and made only from values no write changed meanwhile."""
        live = isinstance(pieces, downlink.LivePieces)
        # what the entry keeps (the viewed array, or the pieces) cannot have its id() reused while cached
        kept, stamp = pieces.origin() if live else (pieces, None)
        cache_key = (key, delta_version, id(kept), stamp)
        with self._cache_lock:
            if self._cache_version != version:
                self._cache.clear()
                self._cache_version = version
            cached = self._cache.get(cache_key)
            if cached is not None:
                return cached[1]
            msgs, offset = [], 0
            for piece in pieces:
                msgs.append(fastwire.encode_pull_chunk(version, key, offset, total, piece, delta_version))
                offset += len(piece)
            if not live or pieces.intact():
                self._cache[cache_key] = (kept, msgs)
            return msgs

    @contextmanager
    def admit_push(self, header: ps_pb2.PushHeader, claims=None, peer_site: str | None = None):
        """Before any payload byte is read: the header's worker is the caller's, its sizes fit the
        cap and the plan, and the caller holds no other push; the payload's bytes are then
        reserved from the shard's memory budget until the block ends. Raises Reject."""
        identity = bind_worker(header.worker_id, claims, peer_site)
        declared = check_push_header(header, self.max_push_bytes)
        try:
            kind = ps_pb2.PushHeader.Kind.Name(header.kind)
        except ValueError:
            raise Reject("INVALID_ARGUMENT", f"unknown push kind {header.kind}") from None
        self.state.check_push_keys(kind, [(k.key, k.nbytes) for k in header.keys])
        with self.gate.enter(identity, "push"), self.budget.hold(identity, declared):
            yield

    def Push(self, request_iterator, context):
        try:
            messages = iter(request_iterator)
            first = next(messages, None)
            if first is None:
                raise Reject("INVALID_ARGUMENT", "empty push: no header")
            if isinstance(first, fastwire.Chunk) or first.WhichOneof("body") != "header":
                raise Reject("INVALID_ARGUMENT", "push chunk before its header")
            header = first.header
            with self.admit_push(header, current_claims(), grpc_peer_site(context)):
                return self.push_payloads(header, self._read_chunks(header, messages))
        except Reject as rej:
            log.warning("push_rejected", shard=self.state.shard, code=rej.code, reason=rej.message)
            count_rejected_push(rej.code)
            self._abort(context, rej)

    def _read_chunks(self, header: ps_pb2.PushHeader, messages) -> dict:
        """Every declared key's bytes from the rest of a Push stream; raises Reject."""
        parts: dict[str, list[bytes]] = {}
        expected: dict[str, int] = {}
        filled: dict[str, int] = {}
        received = 0
        for k in header.keys:
            expected[k.key], filled[k.key], parts[k.key] = k.nbytes, 0, []
        for msg in messages:
            which = "chunk" if isinstance(msg, fastwire.Chunk) else msg.WhichOneof("body")
            if which == "header":
                raise Reject("INVALID_ARGUMENT", "push has two headers")
            elif which == "chunk":
                c = msg if isinstance(msg, fastwire.Chunk) else msg.chunk
                if c.key not in expected:
                    raise Reject("INVALID_ARGUMENT", f"chunk for key {c.key!r} not declared in the header")
                end = c.offset + len(c.data)
                if c.offset != filled[c.key] or end > expected[c.key]:
                    raise Reject("INVALID_ARGUMENT",
                                 f"key {c.key!r}: chunk at byte {c.offset} (+{len(c.data)}) does not continue "
                                 f"the {filled[c.key]} of {expected[c.key]} bytes received")
                parts[c.key].append(c.data)
                filled[c.key] = end
                received += len(c.data)
                if received > self.max_push_bytes:
                    raise Reject("RESOURCE_EXHAUSTED", f"push exceeds the cap of {self.max_push_bytes} bytes")
        short = [k for k, n in expected.items() if filled[k] != n]
        if short:
            raise Reject("INVALID_ARGUMENT", f"push ended early: key {short[0]!r} got {filled[short[0]]} "
                                             f"of {expected[short[0]]} bytes")
        return {k: v[0] if len(v) == 1 else b"".join(v) for k, v in parts.items()}

    def push_payloads(self, header: ps_pb2.PushHeader, payloads: dict, claims=None) -> ps_pb2.PushResponse:
        """Apply one complete push (every declared key's bytes, a dict this call takes over: it is
        emptied once the push is in its round); raises Reject and then changes nothing."""
        member = self.state.members.get(header.worker_id)
        site = _claims_site(member.site if member is not None else "", claims)
        kind = ps_pb2.PushHeader.Kind.Name(header.kind)
        version, applied = self.state.push(header.worker_id, site, kind, header.step, header.base_version,
                                           header.codec, payloads, header.contributors or 1,
                                           header.optimizer_json, header.skip_nonfinite, take_payloads=True)
        return ps_pb2.PushResponse(version=version, applied=applied)

    def heartbeat(self, request: ps_pb2.HeartbeatRequest, claims=None, peer_site: str | None = None
                  ) -> ps_pb2.HeartbeatResponse:
        """One heartbeat, by gRPC or the bulk plane; raises Reject."""
        bind_worker(request.worker_id, claims, peer_site)
        self.state.heartbeat(request.worker_id)
        return ps_pb2.HeartbeatResponse(version=self.state.version, live_workers=sorted(self.state.live_members()))

    def leave(self, request: ps_pb2.LeaveRequest, claims=None, peer_site: str | None = None) -> ps_pb2.LeaveResponse:
        """A worker leaves the quorum, by gRPC or the bulk plane; raises Reject."""
        bind_worker(request.worker_id, claims, peer_site)
        self.state.leave(request.worker_id)
        return ps_pb2.LeaveResponse()

    def Heartbeat(self, request, context):
        try:
            return self.heartbeat(request, current_claims(), grpc_peer_site(context))
        except Reject as rej:
            self._abort(context, rej)

    def Leave(self, request, context):
        try:
            return self.leave(request, current_claims(), grpc_peer_site(context))
        except Reject as rej:
            self._abort(context, rej)

    def Status(self, request, context):
        return ps_pb2.StatusResponse(json=json.dumps({**self.state.status(), "bulk_port": self.bulk_port}))


@dataclass
class ServerSecurity:
    """How a shard is secured. ``insecure=True`` (plaintext, no auth) must be asked for explicitly."""

    server_credentials: grpc.ServerCredentials | None = None
    interceptors: tuple = ()
    insecure: bool = False
    # the bulk data plane's TLS and token check (see hybridfleet.ps.wire.bulk); without an
    # ssl_context a TLS shard serves Push/Pull on gRPC only
    ssl_context: ssl.SSLContext | None = None
    verifier: Any = None  # hybridfleet.security.TokenVerifier, None when auth is off


class ShardServer:
    """A running shard: gRPC server + reaper thread for heartbeat timeouts."""

    def __init__(self, state: ShardState, host: str, port: int, security: ServerSecurity,
                 max_push_bytes: int, max_workers: int | None = None, bulk_port: int | None = 0,
                 num_workers: int = 8):
        """``bulk_port``: where the bulk data plane listens (0: any free port; None: gRPC only);
        ``max_workers``: gRPC threads, also the cap on concurrent RPCs (default: every one of the
        job's ``num_workers`` gets its full share, see `limits.server_threads`)."""
        if security.server_credentials is None and not security.insecure:
            raise ValueError("a shard needs TLS credentials; plaintext needs insecure=True explicitly")
        self.state = state
        threads = max_workers or server_threads(num_workers)
        bulk_served = bulk_port is not None and (security.insecure or security.ssl_context is not None)
        # With the bulk plane, Push and Pull go there and gRPC carries short control calls: a fixed
        # number of threads serves them, whatever the number of workers, with the calls beyond it
        # queued (up to each worker's share) and pulls that wait on gRPC bounded to half the threads.
        # Secure aggregation's calls wait for the other workers, so they keep a thread per worker.
        grpc_threads = threads
        if bulk_served and state.secagg is None and max_workers is None:
            grpc_threads = min(threads, GRPC_THREADS_WITH_BULK)
        # RPCs beyond maximum_concurrent_rpcs are refused (RESOURCE_EXHAUSTED), not queued behind a stalled one
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=grpc_threads),
                                  interceptors=list(security.interceptors), options=GRPC_OPTIONS + SERVER_OPTIONS,
                                  maximum_concurrent_rpcs=threads)
        self.grpc_threads = grpc_threads
        self.servicer = ShardServicer(state, max_push_bytes)
        if grpc_threads < threads:
            self.servicer.grpc_pull_limit = grpc_threads // 2
        self.server.add_generic_rpc_handlers((service_handler(self.servicer),))
        if state.secagg is not None:
            from hybridfleet.ps.secagg.service import SecAggServicer, secagg_handler

            self.server.add_generic_rpc_handlers((secagg_handler(SecAggServicer(state, self.servicer.gate)),))
        self.bulk = None
        if bulk_served:
            from hybridfleet.ps.server.bulk_server import BulkServer

            verify = security.verifier.verify if security.verifier is not None else None
            self.bulk = BulkServer(host, bulk_port, security.ssl_context, verify, max_push_bytes,
                                   self.servicer.push_payloads, self.servicer.pull_items,
                                   admit=self.servicer.admit_push, max_connections=2 * threads,
                                   pulls=self.servicer, heartbeat=self.servicer.heartbeat,
                                   leave=self.servicer.leave)
            self.servicer.bulk_port = self.bulk.port
        address = f"{host}:{port}"
        try:
            if security.server_credentials is not None:
                self.port = self.server.add_secure_port(address, security.server_credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            if self.bulk is not None:
                self.bulk.stop()
            raise PortInUseError(f"cannot serve gRPC on {address}: the address is in use or not on this machine")
        self.host = host
        self.snapshotter = None  # set by hybridfleet.ps.server.serve.start_shard when the job snapshots
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="ps-reaper", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "ShardServer":
        self.server.start()
        if self.bulk is not None:
            self.bulk.start()
        self._reaper.start()
        log.info("shard_serving", shard=self.state.shard, address=self.address)
        return self

    def _reap_loop(self) -> None:
        interval = min(1.0, self.state.spec.heartbeat_interval_s)
        while not self._stop.wait(interval):
            # a worker busy on the bulk plane (a push arriving, a pull waiting on an open
            # connection) sends no heartbeat there meanwhile: it counts as alive
            busy = self.bulk.busy_workers() if self.bulk is not None else ()
            self.state.reap(busy)  # also closes a BSP round that was only waiting for late joiners

    def stop(self, grace_s: float = 1.0, final_snapshot: bool = False) -> None:
        """Stop serving. ``final_snapshot``: stop answering first, then write a snapshot of the
        version the shard ended at (a hand-over to another shard count restores it)."""
        self._stop.set()
        if final_snapshot:
            if self.bulk is not None:
                self.bulk.stop()
            self.server.stop(grace_s).wait()
            if self.snapshotter is not None:
                self.snapshotter.stop(final=True)
            return
        if self.snapshotter is not None:
            self.snapshotter.stop()
        if self.bulk is not None:
            self.bulk.stop()
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


def service_handler(servicer: ShardServicer) -> grpc.GenericRpcHandler:
    """The service's handlers: protobuf for control messages, `fastwire` for the bulk Push/Pull streams."""
    pb = ps_pb2
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Join": unary(servicer.Join, pb.JoinRequest.FromString, pb.JoinResponse.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, pb.PullRequest.FromString, fastwire.identity),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, fastwire.decode_push_message,
                                                     pb.PushResponse.SerializeToString),
        "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest.FromString, pb.HeartbeatResponse.SerializeToString),
        "Leave": unary(servicer.Leave, pb.LeaveRequest.FromString, pb.LeaveResponse.SerializeToString),
        "Status": unary(servicer.Status, pb.StatusRequest.FromString, pb.StatusResponse.SerializeToString),
    })


def method_roles() -> dict[str, set[str]]:
    """Which token roles may call each RPC."""
    return dict(METHOD_ROLES)
