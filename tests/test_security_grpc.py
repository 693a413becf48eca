"""The auth interceptor on a real gRPC server over TLS, for all four call kinds.

The service is a raw-bytes generic handler (no generated code): each method
counts its invocations and answers with the claims it sees via
`current_claims()`, so a test can assert both what the client got back and
that a rejected call never reached the handler.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from hybridfleet.security import certs
from hybridfleet.security.grpc_auth import (
    AuthInterceptor,
    bind_server,
    current_claims,
    open_channel,
    token_metadata,
)
from hybridfleet.security.tokens import TokenIssuer, TokenVerifier, generate_signing_key

JOB = "digits-hybrid"
SERVICE = "test.Echo"
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
METHODS = {
    "unary_unary": f"/{SERVICE}/Unary",
    "unary_stream": f"/{SERVICE}/ServerStream",
    "stream_unary": f"/{SERVICE}/ClientStream",
    "stream_stream": f"/{SERVICE}/BidiStream",
}
ADMIN_ONLY = f"/{SERVICE}/AdminOnly"
UNLISTED = f"/{SERVICE}/Unlisted"  # served, but absent from the role table
METHOD_ROLES = {**{m: {"worker"} for m in METHODS.values()}, ADMIN_ONLY: {"admin"}}
TIMEOUT_S = 10


@dataclass
class Recorder:
    """What the handlers saw: how many calls reached them."""

    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hit(self) -> None:
        with self.lock:
            self.calls += 1


def _describe() -> bytes:
    claims = current_claims()
    return b"no-claims" if claims is None else f"{claims.job}/{claims.site}/{claims.role}".encode()


def _service(recorder: Recorder) -> grpc.GenericRpcHandler:
    def unary(request, context):
        recorder.hit()
        return _describe()

    def server_stream(request, context):
        recorder.hit()
        for _ in range(3):
            yield _describe()  # claims must stay visible between yields

    def client_stream(requests, context):
        recorder.hit()
        count = sum(1 for _ in requests)
        return _describe() + f"/{count}".encode()

    def bidi(requests, context):
        recorder.hit()
        for _ in requests:
            yield _describe()

    raw = {"request_deserializer": None, "response_serializer": None}
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, **raw),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, **raw),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, **raw),
            "BidiStream": grpc.stream_stream_rpc_method_handler(bidi, **raw),
            "AdminOnly": grpc.unary_unary_rpc_method_handler(unary, **raw),
            "Unlisted": grpc.unary_unary_rpc_method_handler(unary, **raw),
        },
    )


@contextlib.contextmanager
def _server(credentials: grpc.ServerCredentials | None, verifier: TokenVerifier | None):
    """A running server on 127.0.0.1 (free port) with the interceptor when a verifier is given."""
    recorder = Recorder()
    interceptors = [AuthInterceptor(verifier, METHOD_ROLES)] if verifier else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    server.add_generic_rpc_handlers((_service(recorder),))
    port = bind_server(server, "127.0.0.1:0", credentials)
    server.start()
    try:
        yield port, recorder
    finally:
        server.stop(grace=None)


def _call(channel: grpc.Channel, kind: str, method: str | None = None, metadata=None) -> list[bytes]:
    """Make one call of ``kind`` and return every response message."""
    method = method or METHODS[kind]
    options = {"timeout": TIMEOUT_S, "metadata": metadata}
    if kind == "unary_unary":
        return [channel.unary_unary(method)(b"ping", **options)]
    if kind == "unary_stream":
        return list(channel.unary_stream(method)(b"ping", **options))
    if kind == "stream_unary":
        return [channel.stream_unary(method)(iter([b"a", b"b"]), **options)]
    return list(channel.stream_stream(method)(iter([b"a", b"b"]), **options))


def _rpc_error(channel: grpc.Channel, kind: str, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _call(channel, kind, **kwargs)
    return caught.value


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    certs.make_dev_pki(directory, hosts=("127.0.0.1", "localhost"), clients=("worker",))
    generate_signing_key(directory)
    return directory


@pytest.fixture(scope="module")
def pki(pki_dir) -> certs.Pki:
    return certs.load_pki(pki_dir)


@pytest.fixture(scope="module")
def issuer(pki_dir) -> TokenIssuer:
    return TokenIssuer.from_dir(pki_dir)


@pytest.fixture(scope="module")
def tls_server(pki, pki_dir):
    with _server(certs.server_credentials(pki, mutual_tls=False), TokenVerifier.from_dir(pki_dir, JOB)) as served:
        yield served


@pytest.fixture
def served(tls_server):
    """The shared TLS server with its call counter reset for this test."""
    port, recorder = tls_server
    recorder.calls = 0
    return port, recorder


def _tls_channel(pki, port: int, token: str | None, client_name: str | None = None, options=()):
    return open_channel(f"127.0.0.1:{port}", certs.channel_credentials(pki, client_name), token, options=options)


@pytest.mark.parametrize("kind", KINDS)
def test_valid_token_is_accepted_and_claims_reach_the_handler(served, pki, issuer, kind):
    # Prepare
    port, recorder = served
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=600)

    # Execute
    with _tls_channel(pki, port, token) as channel:
        responses = _call(channel, kind)

    # Assert
    assert responses and all(r.startswith(f"{JOB}/hospital/worker".encode()) for r in responses)
    assert recorder.calls == 1


def _forged(pki, issuer, tmp_path) -> str:
    other_priv, _ = generate_signing_key(tmp_path)
    return TokenIssuer(other_priv.read_bytes()).issue(JOB, "hospital", "worker", ttl_s=600)


def _expired(pki, issuer, tmp_path) -> str:
    an_hour_ago = TokenIssuer(
        (pki.directory / "token-signing.key").read_bytes(), clock=lambda: time.time() - 3600
    )
    return an_hour_ago.issue(JOB, "hospital", "worker", ttl_s=60)


REJECTIONS = {
    "forged": (_forged, grpc.StatusCode.UNAUTHENTICATED, "signature is invalid"),
    "expired": (_expired, grpc.StatusCode.UNAUTHENTICATED, "token expired"),
    "wrong_job": (
        lambda pki, issuer, tmp: issuer.issue("another-job", "hospital", "worker", ttl_s=600),
        grpc.StatusCode.UNAUTHENTICATED,
        f"token is for job 'another-job', this server serves job '{JOB}'",
    ),
    "wrong_role": (
        lambda pki, issuer, tmp: issuer.issue(JOB, "cloud", "shard", ttl_s=600),
        grpc.StatusCode.PERMISSION_DENIED,
        "role 'shard' is not allowed for this call (allowed: 'worker')",
    ),
    "missing": (lambda pki, issuer, tmp: None, grpc.StatusCode.UNAUTHENTICATED, "missing token"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejected_token_aborts_before_the_handler_runs(served, pki, issuer, tmp_path, case, kind):
    # Prepare
    port, recorder = served
    make_token, code, message = REJECTIONS[case]
    token = make_token(pki, issuer, tmp_path)

    # Execute
    with _tls_channel(pki, port, token) as channel:
        err = _rpc_error(channel, kind)

    # Assert
    assert err.code() == code
    assert message in err.details()
    assert recorder.calls == 0


def test_authorization_metadata_without_bearer_scheme_is_malformed(served, pki):
    # Prepare
    port, recorder = served

    # Execute
    with _tls_channel(pki, port, token=None) as channel:
        err = _rpc_error(channel, "unary_unary", metadata=(("authorization", "Basic dXNlcjpwdw=="),))

    # Assert
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "expected 'Bearer <token>'" in err.details()
    assert recorder.calls == 0


@pytest.mark.parametrize(
    ("role", "method", "message"),
    [
        ("worker", ADMIN_ONLY, "role 'worker' is not allowed for this call (allowed: 'admin')"),
        ("admin", UNLISTED, f"method {UNLISTED} is not open to any role"),  # fail closed, even for admin
    ],
)
def test_method_not_granted_to_the_token_role_is_permission_denied(served, pki, issuer, role, method, message):
    # Prepare
    port, recorder = served
    token = issuer.issue(JOB, "hospital", role, ttl_s=600)

    # Execute
    with _tls_channel(pki, port, token) as channel:
        err = _rpc_error(channel, "unary_unary", method=method)

    # Assert
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert message in err.details()
    assert recorder.calls == 0


def test_method_the_server_does_not_serve_is_unimplemented(served, pki, issuer):
    # Prepare
    port, _ = served
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=600)

    # Execute
    with _tls_channel(pki, port, token) as channel:
        err = _rpc_error(channel, "unary_unary", method=f"/{SERVICE}/Nope")

    # Assert
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED


def test_client_that_does_not_trust_the_ca_fails_the_handshake(served, tmp_path, issuer):
    # Prepare
    port, recorder = served
    stranger = certs.make_dev_pki(tmp_path / "other")
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=600)

    # Execute
    with _tls_channel(stranger, port, token) as channel:
        err = _rpc_error(channel, "unary_unary")

    # Assert
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert recorder.calls == 0


def test_mutual_tls_refuses_a_client_without_a_certificate_and_admits_one_with(pki, pki_dir, issuer):
    # Prepare
    token = issuer.issue(JOB, "hospital", "worker", ttl_s=600)
    credentials = certs.server_credentials(pki, mutual_tls=True)

    with _server(credentials, TokenVerifier.from_dir(pki_dir, JOB)) as (port, recorder):
        # Execute
        with _tls_channel(pki, port, token) as anonymous:
            err = _rpc_error(anonymous, "unary_unary")
        calls_after_refusal = recorder.calls
        with _tls_channel(pki, port, token, client_name="worker") as known:
            responses = _call(known, "unary_unary")

    # Assert
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert calls_after_refusal == 0
    assert responses == [f"{JOB}/hospital/worker".encode()]


def test_host_name_missing_from_the_sans_needs_the_target_name_override(tmp_path, issuer):
    # Prepare: the certificate names only ps.internal, the client dials 127.0.0.1
    pki = certs.make_dev_pki(tmp_path / "pki", hosts=("ps.internal",))
    generate_signing_key(pki.directory)
    token = TokenIssuer.from_dir(pki.directory).issue(JOB, "cloud", "worker", ttl_s=600)
    override = (("grpc.ssl_target_name_override", "ps.internal"),)

    with _server(certs.server_credentials(pki, False), TokenVerifier.from_dir(pki.directory, JOB)) as (port, _):
        # Execute
        with _tls_channel(pki, port, token) as plain:
            err = _rpc_error(plain, "unary_unary")
        with _tls_channel(pki, port, token, options=override) as overridden:
            responses = _call(overridden, "unary_unary")

    # Assert
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert responses == [f"{JOB}/cloud/worker".encode()]


@pytest.mark.parametrize("kind", KINDS)
def test_plaintext_mode_still_checks_the_token(pki_dir, issuer, kind):
    # Prepare
    token = issuer.issue(JOB, "bank", "worker", ttl_s=600)

    with _server(None, TokenVerifier.from_dir(pki_dir, JOB)) as (port, recorder):
        # Execute
        with open_channel(f"127.0.0.1:{port}", None, token) as with_token:
            responses = _call(with_token, kind)
        with open_channel(f"127.0.0.1:{port}", None, None) as without_token:
            err = _rpc_error(without_token, kind)

    # Assert
    assert responses and all(r.startswith(f"{JOB}/bank/worker".encode()) for r in responses)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert recorder.calls == 1


def test_token_metadata_authenticates_a_call_on_a_plain_channel(pki_dir, issuer):
    # Prepare
    token = issuer.issue(JOB, "bank", "worker", ttl_s=600)

    with _server(None, TokenVerifier.from_dir(pki_dir, JOB)) as (port, _):
        # Execute
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            responses = _call(channel, "unary_unary", metadata=token_metadata(token))

    # Assert
    assert responses == [f"{JOB}/bank/worker".encode()]


def test_without_the_interceptor_handlers_see_no_claims():
    with _server(None, None) as (port, _):
        with open_channel(f"127.0.0.1:{port}", None) as channel:
            responses = _call(channel, "unary_unary")

    assert responses == [b"no-claims"]


@pytest.mark.parametrize(
    ("method_roles", "message"),
    [
        ({"Push": {"worker"}}, r"'Push' is not a full method name like '/pkg\.Service/Method'"),
        ({"/a.B/Push": set()}, r"method_roles\['/a\.B/Push'\]: no role may call it"),
        ({"/a.B/Push": "worker"}, r"give a set of roles, not the string 'worker'"),
    ],
)
def test_interceptor_rejects_a_bad_role_table(pki_dir, method_roles, message):
    with pytest.raises(ValueError, match=message):
        AuthInterceptor(TokenVerifier.from_dir(pki_dir, JOB), method_roles)
