"""Every parser that reads bytes from the network, wrapped for fuzzing.

Each `Target` takes one input (bytes) and says whether the parser accepted it or
refused it with the project's own error; anything else (another exception, an
invariant broken, a result larger than the plan allows) raises `FuzzFailure`.
`tests/test_fuzz_parsers.py` drives them with Hypothesis, `bench/fuzz.py` with
>= 100,000 mutated inputs each. ``seeds`` are valid inputs to mutate from.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hybridfleet.errors import HfleetError

ACCEPTED, REFUSED = "accepted", "refused"
# A fuzzed frame's tensor holds at most this many elements (the "plan" of the codec targets).
PLAN_NUMEL = 64


from hybridfleet.ps.server.limits import PULL_WAIT_CEILING_S as _PULL_WAIT_CEILING_S  # noqa: E402


class FuzzFailure(AssertionError):
    """The parser crashed, hung or broke an invariant on this input."""


@dataclass
class Target:
    name: str
    run: Callable[[bytes], str]
    seeds: list[bytes] = field(default_factory=list)
    close: Callable[[], None] = lambda: None


def _guard(fn: Callable[[bytes], object], data: bytes, allowed: tuple[type[BaseException], ...] = (HfleetError,)) -> str:
    try:
        verdict = fn(data)
    except allowed:
        return REFUSED
    except FuzzFailure:
        raise
    except Exception as err:  # noqa: BLE001 - the point: anything else is a failure
        raise FuzzFailure(f"{type(err).__name__}: {err}") from err
    return verdict if verdict in (ACCEPTED, REFUSED) else ACCEPTED


# ---------------------------------------------------------------- fastwire
def fastwire_push_target() -> Target:
    from hybridfleet.ps.wire import fastwire
    from hybridfleet.ps.wire._proto import ps_pb2

    header = ps_pb2.PushMessage(header=ps_pb2.PushHeader(worker_id="a-0", step=3, keys=[
        ps_pb2.KeyBytes(key="fc.weight", nbytes=48)])).SerializeToString()
    seeds = [fastwire.encode_push_chunk("fc.weight", 0, 48, bytes(48)), header]
    return Target("fastwire_push", lambda d: _guard(fastwire.decode_push_message, d), seeds)


def fastwire_pull_target() -> Target:
    from hybridfleet.ps.wire import fastwire

    seeds = [fastwire.encode_pull_chunk(7, "fc.bias", 0, 16, bytes(16), 3), fastwire.encode_pull_chunk(2)]
    return Target("fastwire_pull", lambda d: _guard(fastwire.decode_pull_chunk, d), seeds)


# ---------------------------------------------------------------- codec frames
def codec_frames_target() -> Target:
    """The codec named by the first byte decodes the rest as a block of `PLAN_NUMEL` elements."""
    from hybridfleet.codec import get_codec
    from hybridfleet.codec.frame import CODEC_IDS

    names = sorted(CODEC_IDS, key=CODEC_IDS.get)
    codecs = [get_codec(n, **({"ratio": 0.25} if n in ("topk", "randomk") else {})) for n in names]
    x = np.linspace(-1, 1, PLAN_NUMEL, dtype=np.float32)

    def run(data: bytes) -> str:
        if not data:
            return REFUSED
        codec = codecs[data[0] % len(codecs)]
        payload = data[1:]

        def decode(p: bytes) -> None:
            dense = codec.decode(p, expected_numel=PLAN_NUMEL)
            if dense.size != PLAN_NUMEL:
                raise FuzzFailure(f"{codec.name}: decoded {dense.size} elements, the plan says {PLAN_NUMEL}")
            sparse = codec.decode_sparse(p, expected_numel=PLAN_NUMEL)
            if sparse.indices.size > PLAN_NUMEL or (sparse.indices.size and int(sparse.indices.max()) >= PLAN_NUMEL):
                raise FuzzFailure(f"{codec.name}: sparse indices beyond the plan's {PLAN_NUMEL} elements")

        return _guard(decode, payload)

    seeds = [bytes([i]) + bytes(c.encode(x)) for i, c in enumerate(codecs)]
    return Target("codec_frames", run, seeds)


# ---------------------------------------------------------------- tokens
def token_target() -> Target:
    """Bearer metadata and JWT parsing: only `TokenRejectedError` (an AuthError) may come out."""
    import tempfile

    from hybridfleet.security.grpc_auth import _bearer_token
    from hybridfleet.security.tokens import TokenIssuer, TokenVerifier, generate_signing_key

    tmp = tempfile.TemporaryDirectory()
    generate_signing_key(tmp.name)
    verifier = TokenVerifier.from_dir(tmp.name, job="fuzz")
    good = TokenIssuer.from_dir(tmp.name).issue("fuzz", "a", "worker", 600, worker="a-0")

    def parse(data: bytes) -> None:
        text = data.decode("latin-1")
        token = _bearer_token([("authorization", text)])
        verifier.verify(token, {"worker"})

    return Target("tokens", lambda d: _guard(parse, d), [f"Bearer {good}".encode()], tmp.cleanup)


# ---------------------------------------------------------------- bulk plane
class _BulkHarness:
    """A real shard's bulk server (plaintext, auth off, one worker joined and initialised) fed one
    connection's bytes at a time through a loopback TCP connection; the harness reads every
    response and checks each is a well-formed frame and none is INTERNAL."""

    def __init__(self) -> None:
        import hybridfleet.ps.server.downlink as downlink_mod
        from hybridfleet.ps.server.bulk_server import BulkServer
        from hybridfleet.ps.server.service import ShardServicer
        from hybridfleet.ps.server.shard import ShardState
        from hybridfleet.ps.wire.sharding import ParamSpec
        from hybridfleet.spec.models import PSSpec

        self._ceiling = (downlink_mod, _PULL_WAIT_CEILING_S)
        downlink_mod.PULL_WAIT_CEILING_S = 0.0  # a fuzzed pull never waits for a round (restored by close)
        spec = PSSpec(heartbeat_timeout_s=1e9, heartbeat_interval_s=1.0)
        self.state = ShardState(0, spec, sites={"a": 2})
        params = [ParamSpec("w", (4, 3)), ParamSpec("b", (4,))]
        self.state.join("a-0", "a", params, 1, spec.block_size_bytes, "none")
        self.state.push("a-0", "a", "INIT", 0, 0, "none",
                        {"w": np.zeros(12, "<f4").tobytes(), "b": np.zeros(4, "<f4").tobytes()})
        servicer = ShardServicer(self.state, max_push_bytes=1 << 16)
        self.server = BulkServer("127.0.0.1", 0, None, None, 1 << 16, servicer.push_payloads,
                                 servicer.pull_items, admit=servicer.admit_push)
        self.listener = self.server._listener  # accepted by hand: _serve runs in this thread

    def run(self, data: bytes) -> str:
        from hybridfleet.ps.server import bulk_server

        client = socket.create_connection(("127.0.0.1", self.server.port))
        conn, peer = self.listener.accept()
        try:
            client.sendall(data)
            client.shutdown(socket.SHUT_WR)
            self.server._slots.take(conn.fileno(), peer[0])  # what the accept loop does before serving
            self.server._serve(conn, peer)
            client.settimeout(5)
            chunks = []
            while True:
                try:
                    b = client.recv(1 << 16)
                except ConnectionResetError:  # the shard closed with our bytes unread: a refusal
                    break
                if not b:
                    break
                chunks.append(b)
        finally:
            client.close()
        return _check_responses(b"".join(chunks), bulk_server)

    def close(self) -> None:
        self.server.stop()
        module, ceiling = self._ceiling
        module.PULL_WAIT_CEILING_S = ceiling


def _check_responses(stream: bytes, bulk_server) -> str:
    """Walk the response frames; INTERNAL (a shard bug) or a torn frame is a failure."""
    pos, statuses = 0, []
    while pos < len(stream):
        n = stream[pos]
        status = stream[pos + 1:pos + 1 + n].decode("ascii", "replace")
        if pos + 1 + n + 4 > len(stream):
            raise FuzzFailure(f"torn response frame at byte {pos}")
        (size,) = struct.unpack_from("<I", stream, pos + 1 + n)
        pos += 1 + n + 4 + size
        statuses.append(status)
        if status == "INTERNAL":
            raise FuzzFailure(f"shard answered INTERNAL: {stream[pos - size:pos][:200]!r}")
        if status == "OK" and len(statuses) > 1:
            # a pull's OK is followed by raw item bytes: stop walking, they are not frames
            break
    return ACCEPTED if statuses and statuses[-1] == "OK" else REFUSED


def _hello(token: str = "") -> bytes:
    from hybridfleet.ps.wire.bulk import MAGIC, OP_HELLO
    from hybridfleet.ps.wire.protocol import WIRE_VERSION

    body = json.dumps({"magic": MAGIC, "wire_version": WIRE_VERSION, "token": token}).encode()
    return bytes([OP_HELLO]) + struct.pack("<I", len(body)) + body


def bulk_seeds() -> list[bytes]:
    from hybridfleet.codec import get_codec
    from hybridfleet.ps.wire._proto import ps_pb2
    from hybridfleet.ps.wire.bulk import OP_PULL, OP_PUSH

    none = get_codec("none")
    w, b = bytes(none.encode(np.ones(12, np.float32))), bytes(none.encode(np.ones(4, np.float32)))
    header = ps_pb2.PushHeader(worker_id="a-0", step=1, codec="none", keys=[
        ps_pb2.KeyBytes(key="w", nbytes=len(w)), ps_pb2.KeyBytes(key="b", nbytes=len(b))]).SerializeToString()
    pull = ps_pb2.PullRequest(worker_id="a-0", since_version=0).SerializeToString()
    return [
        _hello(),
        _hello() + bytes([OP_PUSH]) + struct.pack("<I", len(header)) + header + w + b,
        _hello() + bytes([OP_PULL]) + struct.pack("<I", len(pull)) + pull,
    ]


def bulk_target() -> Target:
    harness = _BulkHarness()
    return Target("bulk_hello_and_frames", lambda d: _guard(harness.run, d), bulk_seeds(), harness.close)


FACTORIES: dict[str, Callable[[], Target]] = {
    "fastwire_push": fastwire_push_target, "fastwire_pull": fastwire_pull_target,
    "codec_frames": codec_frames_target, "tokens": token_target, "bulk_hello_and_frames": bulk_target,
}


def all_targets() -> list[Target]:
    return [make() for make in FACTORIES.values()]
