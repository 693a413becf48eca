"""The worker-side client of a sharded parameter server.

One `PSClient` talks to every shard: it joins them, pushes each shard's blocks
in parallel, pulls changed blocks, sends heartbeats from a background thread and
counts the bytes it moves (for per-site accounting). Transient failures of a shard
(``UNAVAILABLE``, e.g. while it restarts from a snapshot) are retried with backoff.
Push and Pull go over the shard's bulk data plane (`hybridfleet.ps.wire.bulk`) when the
shard offers one and the client has TLS settings for it (or is explicitly plaintext);
otherwise over gRPC.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from hybridfleet.codec.frame import frame_pieces
from hybridfleet.errors import AuthError, ProtocolError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.worker.resolve import Resolver
from hybridfleet.ps.worker.rpc_errors import explain, is_name_mismatch, is_untrusted_certificate
from hybridfleet.ps.wire import fastwire
from hybridfleet.ps.wire._proto import ps_pb2, ps_pb2_grpc
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan
from hybridfleet.ps.wire.bulk import IDLE_CHANNEL_MS, BulkError
from hybridfleet.ps.wire.protocol import CHUNK_BYTES, GRPC_OPTIONS, SERVICE, WIRE_VERSION

log = get_logger("ps.client")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
# The longest wait for a heartbeat's answer on the bulk plane (a late answer holds the connection,
# a timed-out one costs a reconnect)
BULK_HEARTBEAT_TIMEOUT_S = 10.0


class ShardRestarted(Exception):
    """A shard went away and answered again (e.g. restored from a snapshot, maybe at a new address).

    ``shard`` is its index and ``version`` the version it answered the re-join with: equal to the
    base version of the push in flight, that push is not in the restored shard and can be pushed
    again; above it, the push was applied before the snapshot was taken."""

    def __init__(self, message: str, shard: int = -1, version: int = -1, initialized: bool = True):
        super().__init__(message)
        self.shard, self.version = shard, version
        self.initialized = initialized  # False: it came back without any snapshot (no parameters)
        self.also: list[ShardRestarted] = []  # other shards that came back during the same call

    def every(self) -> list[ShardRestarted]:
        """This shard and every other one that came back during the same call."""
        return [self, *self.also]


class PlanChanged(Exception):
    """The job's shard count changed while it trains (``hfleet ps scale``): the shards this client
    talks to are gone and ``shards`` new ones, at plan ``generation``, hold their blocks re-cut at
    one round boundary. The caller joins them with a new client and carries on its step."""

    def __init__(self, generation: int, shards: int):
        super().__init__(f"the job's shard count changed to {shards} (plan generation {generation})")
        self.generation, self.shards = generation, shards


@dataclass
class ClientSecurity:
    """Channel credentials and bearer token; ``insecure=True`` must be asked for explicitly."""

    channel_credentials: grpc.ChannelCredentials | None = None
    token: str | None = None
    insecure: bool = False
    target_name_override: str | None = None
    ssl_context: ssl.SSLContext | None = None  # the same trust for the bulk data plane; None: gRPC only
    # a file holding the token, re-read when it changes (renewal for long jobs); overrides ``token``
    token_file: str | None = None
    _file_token: tuple = field(default=(None, None), repr=False)

    def current_token(self) -> str | None:
        """The token to send now: ``token_file``'s content when set (re-read when it changed), else ``token``."""
        if self.token_file is None:
            return self.token
        from pathlib import Path

        path = Path(self.token_file)
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._file_token[0]:
                self._file_token = (stamp, path.read_text().strip() or None)
        except OSError:
            pass  # keep the last token read; the shard will say if it expired
        return self._file_token[1] if self._file_token[0] is not None else self.token

    @classmethod
    def from_files(cls, ca: str, cert: str | None = None, key: str | None = None, token: str | None = None,
                   target_name_override: str | None = None, token_file: str | None = None) -> "ClientSecurity":
        """TLS trusting ``ca`` (showing ``cert``/``key`` for mutual TLS) for gRPC and the bulk plane."""
        from pathlib import Path

        from hybridfleet.ps.worker.bulk_channel import client_ssl_context

        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(ca).read_bytes(),
            private_key=Path(key).read_bytes() if key else None,
            certificate_chain=Path(cert).read_bytes() if cert else None)
        return cls(channel_credentials=creds, token=token, target_name_override=target_name_override,
                   token_file=token_file,
                   ssl_context=client_ssl_context(str(ca), str(cert) if cert else None, str(key) if key else None))


@dataclass
class ByteCounter:
    """Bytes moved by kind of message; with ``capture`` every sent byte is also kept (see `egress`)."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    capture: object = None  # hybridfleet.ps.worker.egress.EgressCapture, in the egress test mode

    def add(self, direction: str, category: str, n: int, data=None) -> None:
        """Count ``n`` bytes; sent bytes come with their ``data`` (bytes-like or a protobuf message)."""
        with self.lock:  # counted and captured together: the capture holds exactly the counted bytes
            d = self.sent if direction == "sent" else self.received
            d[category] = d.get(category, 0) + n
            if self.capture is not None and direction == "sent":
                self.capture.write(data.SerializeToString() if hasattr(data, "SerializeToString") else data)

    def stop_capture(self) -> tuple[object, int]:
        """``(capture, bytes sent so far)``, ending the capture (closed; later bytes are only counted)."""
        with self.lock:
            capture, self.capture = self.capture, None
            if capture is not None:
                capture.close()
            return capture, sum(self.sent.values())

    def add_sent(self, category: str, data) -> None:
        """Count (and, capturing, keep) one sent message or byte string."""
        self.add("sent", category, data.ByteSize() if hasattr(data, "ByteSize") else len(data), data)


@dataclass
class Pulled:
    """One pulled tensor: a key's values (``delta_version == 0``) or the encoded change that
    brought it to ``delta_version``; ``pieces`` are ``(byte offset, bytes)`` in order."""

    key: str
    delta_version: int
    pieces: list[tuple[int, bytes]]
    placed: bool = False  # the bytes were received straight into the caller's buffer (``into=``)

    @property
    def nbytes(self) -> int:
        return sum(len(p) for _, p in self.pieces)

    def payload(self) -> bytes:
        return self.pieces[0][1] if len(self.pieces) == 1 else b"".join(p for _, p in self.pieces)


class _Stub(ps_pb2_grpc.ParameterServerStub):
    """The generated stub, with `fastwire` (de)serializers for the bulk Push/Pull streams."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self.Push = channel.stream_unary(f"/{SERVICE}/Push", request_serializer=fastwire.encode_push_message,
                                         response_deserializer=ps_pb2.PushResponse.FromString)
        self.Pull = channel.unary_stream(f"/{SERVICE}/Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
                                         response_deserializer=fastwire.decode_pull_chunk)


class PSClient:
    """A worker's connection to all shards of one job."""

    def __init__(self, servers: list[str], security: ClientSecurity, worker_id: str, site: str, rank: int,
                 retry_timeout_s: float = 60.0, transport: str = "auto", resolve: Resolver | None = None,
                 watch_plan: Callable[[], tuple[int, int | None]] | None = None):
        """``transport``: "auto" uses a shard's bulk data plane when offered, "grpc" never does.
        ``resolve(shard)``: the shard's current address (e.g. `port_file_resolver`); a shard that stops
        answering is looked up again there and followed to a new address (a replacement shard).
        ``watch_plan()``: ``(generation, shard count)`` of the job's plan (`resolve.current_plan`);
        once it differs from its value now, a failing call raises `PlanChanged` instead of retrying."""
        if not servers:
            raise ValueError("servers: at least one shard address host:port is needed")
        if security.channel_credentials is None and not security.insecure:
            raise ValueError("the client needs TLS channel credentials; plaintext needs insecure=True explicitly")
        self.worker_id, self.site, self.rank = worker_id, site, rank
        self.servers = list(servers)
        self.retry_timeout_s = retry_timeout_s
        self.resolve = resolve
        self.bytes = ByteCounter()
        self._options = list(GRPC_OPTIONS)
        if security.target_name_override:
            self._options.append(("grpc.ssl_target_name_override", security.target_name_override))
        self.security = security
        self._bulk_allowed = transport == "auto" and (security.insecure or security.ssl_context is not None)
        self._bulk: list = [None] * len(servers)  # hybridfleet.ps.wire.bulk.BulkChannel per shard, when used
        self._control_on_grpc = [False] * len(servers)  # a shard whose bulk plane refused a control call
        # per shard: whether its channel closes its connection once idle (see _fit_channel)
        self._idle_closing = [False] * len(servers)
        self._channel_lock = threading.Lock()
        self._channels = [self._channel(s) for s in self.servers]
        self._stubs = [_Stub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(servers)), thread_name_prefix="ps-client")
        self.plan: ShardingPlan | None = None
        self.versions = [-1] * len(servers)
        self.clock = 0
        self.sync = "bsp"
        self.initialized = False
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._join_args: tuple | None = None
        self._needs_rejoin = False  # set when a shard says we are not (or no longer) a member
        self.watch_plan = watch_plan
        self.plan_generation = watch_plan()[0] if watch_plan is not None else 0

    # --------------------------------------------------------------- plumbing
    def _channel(self, address: str, idle_closing: bool = False) -> grpc.Channel:
        """A channel to ``address``; ``idle_closing``: it closes its connection after `IDLE_CHANNEL_MS`
        without a call (a later call opens a new one)."""
        options = self._options + ([("grpc.client_idle_timeout_ms", IDLE_CHANNEL_MS)] if idle_closing else [])
        if self.security.channel_credentials is not None:
            return grpc.secure_channel(address, self.security.channel_credentials, options=options)
        return grpc.insecure_channel(address, options=options)

    def _fit_channel(self, shard: int) -> None:
        """Give shard ``shard`` a channel that closes its connection once idle exactly while that
        shard's Push, Pull, Heartbeat and Leave go by the bulk plane (only Join and Status are left on
        gRPC then: the shard holds one connection per worker, not two). A channel that carries the
        heartbeats keeps its connection: closing it after each idle stretch longer than
        `IDLE_CHANNEL_MS` would cost a reconnect (a TLS handshake) per heartbeat."""
        with self._channel_lock:  # the heartbeat thread may call this too
            wanted = self._bulk_control(shard) is not None
            if wanted == self._idle_closing[shard]:
                return
            old = self._channels[shard]
            self._channels[shard] = self._channel(self.servers[shard], idle_closing=wanted)
            self._stubs[shard] = _Stub(self._channels[shard])
            self._idle_closing[shard] = wanted
        old.close()

    def _follow(self, shard: int) -> bool:
        """Look shard ``shard`` up again (``resolve``); at a new address, talk to it there from now on.
        Returns whether the address changed."""
        address = self.resolve(shard) if self.resolve is not None else None
        if not address or address == self.servers[shard]:
            return False
        old = self._channels[shard]
        self.servers[shard] = address
        self._channels[shard] = self._channel(address, idle_closing=self._idle_closing[shard])
        self._stubs[shard] = _Stub(self._channels[shard])
        old.close()
        log.warning("shard_moved", shard=shard, address=address)
        return True

    def _call(self, shard: int, fn, *, what: str):
        """Run ``fn(stub)`` with retries on UNAVAILABLE for up to ``retry_timeout_s`` after the first
        failure (a call may legitimately wait long before it); map auth failures to AuthError."""
        deadline: float | None = None
        first_failure_s = None
        delay = 0.1
        rejoin = False
        while True:
            try:
                if rejoin:
                    # the shard was unreachable and may have restarted from a snapshot: it must answer
                    # a Join before anything else, then the caller starts the step over from its state
                    version, initialized = self._join_one(shard)
                    raise ShardRestarted(f"shard {self.servers[shard]} came back during {what}", shard, version,
                                         initialized)
                return fn(self._stubs[shard])
            except grpc.RpcError as err:
                self._check_plan()
                code = err.code()
                if is_name_mismatch(err) or is_untrusted_certificate(err):  # retrying cannot change a certificate
                    raise explain(err, self.servers[shard], what) from None
                if rejoin and code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    code = grpc.StatusCode.UNAVAILABLE  # the Join timed out: still unreachable
                if code in RETRYABLE and deadline is None:
                    deadline = time.monotonic() + self.retry_timeout_s
                    first_failure_s = time.time()
                if code in RETRYABLE and self._follow(shard):
                    deadline = time.monotonic() + self.retry_timeout_s  # a new shard: give it the full time
                if code in RETRYABLE and time.monotonic() < deadline:
                    log.warning("shard_unavailable", shard=shard, what=what, retry_in_s=delay, reason=err.details())
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    rejoin = what != "join" and self._join_args is not None
                    continue
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise AuthError(f"shard {self.servers[shard]} refused {what}: {err.details()}") from None
                if code in RETRYABLE:  # retried until the deadline: say which shard, since when, what to check
                    raise explain(err, self.servers[shard], what, since_s=first_failure_s) from None
                raise

    def _check_plan(self) -> None:
        """Raise `PlanChanged` when the job's shard count changed since this client was made."""
        if self.watch_plan is None:
            return
        generation, shards = self.watch_plan()
        if generation != self.plan_generation and shards:
            raise PlanChanged(generation, shards)

    def _each_shard(self, fn):
        """``fn(i)`` for every shard at once. Where several fail, an error that retrying cannot mend
        is raised first, then `ShardRestarted` carrying every shard that came back (`also`): each
        of them may have lost this call's push, so none may go unseen; then the first other
        gRPC error."""
        futs = [self._pool.submit(fn, i) for i in range(len(self.servers))]
        pending = set(futs)
        while pending:  # an error retrying cannot mend is raised at once, without waiting for the rest
            done, pending = futures.wait(pending, return_when=futures.FIRST_EXCEPTION)
            for f in done:
                err = f.exception()
                if err is not None and not isinstance(err, (ShardRestarted, grpc.RpcError)):
                    raise err
        errors = [err for err in (f.exception() for f in futs) if err is not None]
        if not errors:
            return [f.result() for f in futs]
        restarted = [e for e in errors if isinstance(e, ShardRestarted)]
        if restarted:
            restarted[0].also = restarted[1:]
            raise restarted[0]
        raise errors[0]

    # ------------------------------------------------------------------ join
    def join(self, params: list[ParamSpec], block_size_bytes: int, codec: str, framework: str) -> dict:
        """Join every shard; all must agree on the sharding plan. Starts the heartbeat thread."""
        self._join_args = (params, block_size_bytes, codec, framework)
        req = self._join_request()
        self.bytes.add_sent("control", req)
        replies = self._each_shard(lambda i: self._call(i, lambda s: s.Join(req, metadata=self._metadata), what="join"))
        plans = {r.plan_json for r in replies}
        if len(plans) != 1:
            raise ProtocolError("shards disagree on the sharding plan; were they started for the same job?")
        for i, r in enumerate(replies):
            if r.shard != i:
                raise ProtocolError(f"server {self.servers[i]} is shard {r.shard}, expected shard {i}: check the order of --servers")
        self.plan = ShardingPlan.from_json(replies[0].plan_json)
        for i, r in enumerate(replies):
            self._set_bulk(i, r.bulk_port)
        self.clock = max(r.worker_clock for r in replies)
        self.sync = replies[0].sync
        self.initialized = all(r.initialized for r in replies)
        self.versions = [-1] * len(self.servers)
        self._needs_rejoin = False
        if self._hb_thread is None:
            interval = replies[0].heartbeat_interval_s or 1.0
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, args=(interval,), daemon=True,
                                               name="ps-heartbeat")
            self._hb_thread.start()
        return {"versions": [r.version for r in replies], "initialized": self.initialized, "clock": self.clock}

    def _join_request(self) -> ps_pb2.JoinRequest:
        params, block_size_bytes, codec, framework = self._join_args
        return ps_pb2.JoinRequest(
            wire_version=WIRE_VERSION, worker_id=self.worker_id, site=self.site, rank=self.rank,
            params=[ps_pb2.TensorSpec(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in params],
            num_shards=len(self.servers), block_size_bytes=block_size_bytes, codec=codec, framework=framework)

    def _join_one(self, shard: int) -> tuple[int, bool]:
        """Re-register with one shard (after it restarted); its values will be pulled in full.
        Returns the shard's version and whether it holds parameters."""
        reply = self._stubs[shard].Join(self._join_request(), metadata=self._metadata, timeout=10)
        self._set_bulk(shard, reply.bulk_port)
        self.clock = max(self.clock, reply.worker_clock)
        self.versions[shard] = -1
        log.info("rejoined_shard", shard=shard, version=reply.version, initialized=reply.initialized)
        return reply.version, reply.initialized

    def _set_bulk(self, shard: int, port: int) -> None:
        """Use shard ``shard``'s bulk data plane at ``port`` (0: the shard has none)."""
        old = self._bulk[shard]
        if old is not None and (old.port == port and port):
            return
        if old is not None:
            old.close()
        self._bulk[shard] = None
        if port and self._bulk_allowed:
            from hybridfleet.ps.worker.bulk_channel import BulkChannel

            host = self.servers[shard].rsplit(":", 1)[0].strip("[]")
            self._bulk[shard] = BulkChannel(host, port, self.security.ssl_context,
                                            self.security.target_name_override, self.security.current_token,
                                            count=self.bytes.add)
        self._fit_channel(shard)

    @property
    def _metadata(self) -> tuple:
        """The call metadata carrying the current token (renewed tokens take effect on the next call)."""
        token = self.security.current_token()
        return (("authorization", f"Bearer {token}"),) if token else ()

    @property
    def transport(self) -> list[str]:
        """How each shard is reached for Push/Pull: "bulk" or "grpc"."""
        return ["bulk" if b is not None else "grpc" for b in self._bulk]

    def _rejoin_if_needed(self) -> None:
        if self._needs_rejoin and self._join_args is not None:
            log.info("rejoining", worker=self.worker_id)
            self.join(*self._join_args)

    def _bulk_control(self, shard: int):
        """Shard ``shard``'s bulk channel when Heartbeat and Leave go there (else None: gRPC)."""
        bulk = self._bulk[shard]
        return None if bulk is None or self._control_on_grpc[shard] else bulk

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._hb_stop.wait(interval_s):
            for i, stub in enumerate(self._stubs):
                if self._hb_stop.is_set():  # closing: its channels may already be closed
                    return
                try:
                    beat = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, step=self.clock)
                    bulk = self._bulk_control(i)
                    if bulk is not None:
                        # busy with a push or a waiting pull: the shard counts that as a heartbeat
                        if bulk.heartbeat(beat, max(interval_s * 2, BULK_HEARTBEAT_TIMEOUT_S)) is not None:
                            self.bytes.add_sent("control", beat)
                        continue
                    self.bytes.add_sent("control", beat)
                    stub.Heartbeat(beat, metadata=self._metadata, timeout=interval_s * 2)
                except grpc.RpcError as err:
                    if isinstance(err, BulkError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        self._control_on_grpc[i] = True  # a shard whose bulk plane predates control calls
                        self._fit_channel(i)
                        log.info("heartbeat_on_grpc", shard=i, reason=err.details())
                        continue
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        self._needs_rejoin = True
                    log.debug("heartbeat_failed", shard=i, code=str(err.code()))
                except ValueError:  # "Cannot invoke RPC on closed channel": close() ran meanwhile
                    if self._hb_stop.is_set():
                        return
                    if stub is not self._stubs[i]:  # the shard moved (see _follow): beat the new one next time
                        continue
                    raise

    # ------------------------------------------------------------------ push
    def _push_messages(self, header: ps_pb2.PushHeader, payloads: dict[str, bytes], category: str) -> Iterator:
        msg = ps_pb2.PushMessage(header=header)
        self.bytes.add_sent("control", msg)
        yield msg
        for key, payload in payloads.items():
            total, offset = len(payload), 0
            for part in frame_pieces(payload):  # a frame's header, then its values from their own memory
                view = memoryview(part).cast("B")
                for start in range(0, len(view), CHUNK_BYTES):
                    piece = view[start:start + CHUNK_BYTES]
                    msg = fastwire.encode_push_chunk(key, offset, total, piece)
                    offset += len(piece)
                    self.bytes.add("sent", category, len(piece))
                    self.bytes.add("sent", "framing", len(msg) - len(piece), msg)  # the whole message, once
                    yield msg

    def _bulk_push(self, shard: int, header: ps_pb2.PushHeader, part: dict[str, bytes], category: str):
        self.bytes.add_sent("control", header)
        pieces = [piece for k in header.keys for piece in frame_pieces(part[k.key])]
        reply = self._bulk[shard].push(header, pieces)
        for piece in pieces:
            self.bytes.add_sent(category, piece)
        return reply

    def push(self, payloads: dict[str, bytes], codec: str, base_versions: list[int] | None = None,
             kind: str = "GRADIENT", contributors: int = 1, optimizer_json: str = "",
             skip_nonfinite: bool = False, only_shard: int | None = None,
             again: bool = False) -> list[ps_pb2.PushResponse]:
        """Push encoded blocks (key -> payload) to their shards in parallel; one step of this worker's clock.

        A gradient push reaches every shard that holds keys, also one whose keys all lack a gradient
        this step (it pushes no key: the round still counts this worker). ``optimizer_json``: the
        script's optimizer for this step (see `hybridfleet.ps.worker.optim_spec`). ``skip_nonfinite``:
        this step's gradient was not finite; ``payloads`` is empty and every shard holding keys
        closes the round without applying it. ``only_shard``: push again, to that shard alone and with
        the same step, a push the shard lost (it was replaced from a snapshot before the push's round
        closed); the clock does not move. ``again``: the same, to every shard (new shards of a
        changed shard count, which lack the push)."""
        assert self.plan is not None, "join first"
        if kind == "GRADIENT" and only_shard is None and not again:
            self.clock += 1
        step = self.clock
        by_shard: dict[int, dict[str, bytes]] = {}
        for b in self.plan.blocks:
            if b.key in payloads:
                by_shard.setdefault(b.shard, {})[b.key] = payloads[b.key]
        category = "init" if kind == "INIT" else "gradients"

        def one(i: int):
            part = by_shard.get(i)
            if only_shard is not None and i != only_shard:
                return None
            if not part and (kind == "INIT" or not self.plan.blocks_for_shard(i)):
                return None
            part = part or {}
            header = ps_pb2.PushHeader(
                worker_id=self.worker_id, step=step, kind=ps_pb2.PushHeader.Kind.Value(kind), codec=codec,
                base_version=(base_versions[i] if base_versions else max(self.versions[i], 0)),
                keys=[ps_pb2.KeyBytes(key=k, nbytes=len(v)) for k, v in part.items()], contributors=contributors,
                optimizer_json=optimizer_json, skip_nonfinite=skip_nonfinite)
            if self._bulk[i] is not None:
                return self._call(i, lambda s: self._bulk_push(i, header, part, category), what="push")
            return self._call(i, lambda s: s.Push(self._push_messages(header, part, category), metadata=self._metadata),
                              what="push")

        return self._each_shard(one)

    # ------------------------------------------------------------------ pull
    def pull(self, wait_for_versions: list[int] | None = None, timeout_s: float = 120.0,
             full: bool = False, init_digests: list[str] | None = None,
             into: Callable[[str, int, int], memoryview | None] | None = None) -> list[Pulled]:
        """Pull what changed since this client's versions (everything when ``full``).

        Returns `Pulled` entries in the order to apply them: a key's values, or (compressed
        downlink) an encoded delta to add; pieces come as ``(byte offset, bytes)`` so callers
        copy each piece once, straight to where it belongs."""
        self._rejoin_if_needed()

        def one(i: int) -> list[Pulled]:
            req = ps_pb2.PullRequest(worker_id=self.worker_id, since_version=-1 if full else self.versions[i],
                                     wait_for_version=wait_for_versions[i] if wait_for_versions else -1,
                                     worker_clock=self.clock, timeout_s=timeout_s,
                                     init_digest=init_digests[i] if init_digests and full else "")
            self.bytes.add_sent("control", req)

            def run(stub):
                entries: dict[tuple[str, int], Pulled] = {}
                version, nbytes = None, 0
                for msg in stub.Pull(req, metadata=self._metadata, timeout=timeout_s + 30):
                    version = msg.version
                    if msg.chunk is not None:
                        c = msg.chunk
                        entry = entries.get((c.key, msg.delta_version))
                        if entry is None:
                            entry = entries[(c.key, msg.delta_version)] = Pulled(c.key, msg.delta_version, [])
                        if c.offset != entry.nbytes:
                            raise ProtocolError(f"pull of {c.key!r}: chunk at byte {c.offset} is out of order")
                        entry.pieces.append((c.offset, c.data))
                        nbytes += len(c.data)
                self.bytes.add("received", "params", nbytes)
                return version, list(entries.values())

            def run_bulk(stub):
                version, items = self._bulk[i].pull(req, timeout_s + 30, into)
                self.bytes.add("received", "params", sum(len(data) for _, _, data, _ in items))
                return version, [Pulled(key, dv, [(0, data)], placed) for key, dv, data, placed in items]

            version, out = self._call(i, run_bulk if self._bulk[i] is not None else run, what="pull")
            self.versions[i] = version
            return out

        merged: list[Pulled] = []
        for part in self._each_shard(one):
            merged.extend(part)
        self.initialized = True
        return merged

    def status(self) -> list[dict]:
        import json

        return [json.loads(self._call(i, lambda s: s.Status(ps_pb2.StatusRequest(), metadata=self._metadata),
                                      what="status").json) for i in range(len(self.servers))]

    def close(self, leave: bool = True) -> None:
        """Stop heartbeats, leave the quorum (so BSP rounds do not wait for us) and close channels."""
        self._hb_stop.set()
        if leave:
            for i, stub in enumerate(self._stubs):
                try:
                    leave = ps_pb2.LeaveRequest(worker_id=self.worker_id)
                    self.bytes.add_sent("control", leave)
                    bulk = self._bulk_control(i)
                    if bulk is not None:
                        try:
                            if bulk.leave(leave, 5):
                                continue
                        except grpc.RpcError:
                            pass  # say it on gRPC instead
                    stub.Leave(leave, metadata=self._metadata, timeout=5)
                except grpc.RpcError:
                    pass
        for c in self._channels:
            c.close()
        for b in self._bulk:
            if b is not None:
                b.close()
        self._pool.shutdown(wait=False)
