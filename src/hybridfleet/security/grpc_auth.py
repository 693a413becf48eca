"""Token checks on every gRPC call, and the client side that sends the token.

Server side: `AuthInterceptor` checks ``authorization: Bearer <token>`` on every
RPC of every kind (unary/stream in, unary/stream out) before the handler runs,
and aborts with ``UNAUTHENTICATED`` (missing, malformed, forged, expired, wrong
job) or ``PERMISSION_DENIED`` (role not allowed for the method, or a method
absent from the role table). Inside the handler, `current_claims()` returns
the verified `Claims`.

Client side: `bearer_call_credentials` for TLS channels (gRPC sends call
credentials only over secure channels); `token_metadata` for the explicit
plaintext mode. `open_channel` / `bind_server` pick between the two so callers
can pass ``None`` credentials for plaintext without branching.
"""

from __future__ import annotations

import collections
import contextvars
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grpc

from hybridfleet.obs.log import get_logger
from hybridfleet.security.tokens import Claims, TokenRejectedError, TokenVerifier

AUTH_METADATA_KEY = "authorization"
BEARER_PREFIX = "bearer "

log = get_logger("security.grpc_auth")
_claims: contextvars.ContextVar[Claims | None] = contextvars.ContextVar("hybridfleet_claims", default=None)


def current_claims() -> Claims | None:
    """The verified claims of the RPC being handled; None outside a handler behind `AuthInterceptor`
    (for instance when a server runs in the explicit no-auth mode)."""
    return _claims.get()


def _bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    values = [value for key, value in (metadata or ()) if key.lower() == AUTH_METADATA_KEY]
    if not values:
        return None
    if len(values) > 1:
        raise TokenRejectedError("malformed", "malformed authorization metadata: sent more than once")
    value = values[0].decode() if isinstance(values[0], bytes) else str(values[0])
    if not value.lower().startswith(BEARER_PREFIX) or not value[len(BEARER_PREFIX) :].strip():
        raise TokenRejectedError("malformed", "malformed authorization metadata: expected 'Bearer <token>'")
    return value[len(BEARER_PREFIX) :].strip()


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token of every RPC against ``method_roles`` before its handler runs.

    ``method_roles`` maps full method names (``"/pkg.Service/Method"``) to the
    roles allowed to call them; a method absent from the map is refused
    (fail closed), so a new RPC is unreachable until someone grants it roles.
    """

    def __init__(self, verifier: TokenVerifier, method_roles: Mapping[str, Iterable[str]]):
        table: dict[str, frozenset[str]] = {}
        for method, roles in method_roles.items():
            if not (isinstance(method, str) and method.startswith("/") and method.count("/") == 2):
                raise ValueError(f"method_roles: {method!r} is not a full method name like '/pkg.Service/Method'")
            if isinstance(roles, str):
                raise ValueError(f"method_roles[{method!r}]: give a set of roles, not the string {roles!r}")
            table[method] = frozenset(roles)
            if not table[method]:
                raise ValueError(f"method_roles[{method!r}]: no role may call it; remove the method or allow a role")
        self._verifier = verifier
        self._method_roles = table

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown to the server: gRPC answers UNIMPLEMENTED, no handler runs
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata

        def authorize(context: grpc.ServicerContext) -> Claims:
            """Verified claims, or abort the RPC (which raises) with the precise reason."""
            roles = self._method_roles.get(method)
            if roles is None:
                return self._abort(context, method, grpc.StatusCode.PERMISSION_DENIED,
                                   "method_unlisted", f"method {method} is not open to any role on this server")
            try:
                return self._verifier.verify(_bearer_token(metadata), roles)
            except TokenRejectedError as err:
                code = grpc.StatusCode.PERMISSION_DENIED if err.reason == "role" else grpc.StatusCode.UNAUTHENTICATED
                return self._abort(context, method, code, err.reason, str(err))

        return _wrap(handler, authorize)

    @staticmethod
    def _abort(context: grpc.ServicerContext, method: str, code: grpc.StatusCode, reason: str, message: str) -> Any:
        log.warning("rpc_rejected", method=method, code=code.name, reason=reason, peer=context.peer(), message=message)
        context.abort(code, message)


def _wrap(handler: grpc.RpcMethodHandler, authorize: Callable[[grpc.ServicerContext], Claims]) -> grpc.RpcMethodHandler:
    """The same handler whose behaviour first authorizes, then runs in a context holding the claims."""

    def run_unary_response(behavior: Callable) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            scope = _scope(authorize(context))
            return scope.run(behavior, request, context)

        return wrapped

    def run_stream_response(behavior: Callable) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            scope = _scope(authorize(context))  # before the handler is even called
            return _iterate_in(scope, scope.run(behavior, request, context))

        return wrapped

    kinds = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler, run_unary_response),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler, run_stream_response),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler, run_unary_response),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler, run_stream_response),
    }
    attr, make, wrap_behavior = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        wrap_behavior(getattr(handler, attr)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _scope(claims: Claims) -> contextvars.Context:
    # A fresh copy per RPC: the claims never leak into the server's pool thread or another call.
    scope = contextvars.copy_context()
    scope.run(_claims.set, claims)
    return scope


def _iterate_in(scope: contextvars.Context, responses: Iterator[Any]) -> Iterator[Any]:
    # Each step of a streaming handler runs inside the scope, so current_claims() works between yields.
    iterator = scope.run(iter, responses)
    while True:
        try:
            item = scope.run(next, iterator)
        except StopIteration:
            return
        yield item


def bearer_call_credentials(token: str) -> grpc.CallCredentials:
    """Call credentials sending ``authorization: Bearer <token>`` on every call of a TLS channel;
    combine with `grpc.composite_channel_credentials`. gRPC never sends them over plaintext."""
    return grpc.access_token_call_credentials(token)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata carrying ``token``, for ``metadata=`` on calls over a plaintext channel."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenMetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token metadata to every call of a plaintext channel."""

    def __init__(self, token: str):
        self._metadata = token_metadata(token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            tuple(details.metadata or ()) + self._metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to ``target`` that sends ``token`` (if any) on every call.

    ``credentials=None`` is the explicit plaintext mode: the token then travels
    as metadata through a client interceptor (unencrypted; only for trusted
    networks). With TLS credentials it travels as call credentials.
    """
    if credentials is None:
        channel = grpc.insecure_channel(target, options=list(options))
        return grpc.intercept_channel(channel, _TokenMetadataInterceptor(token)) if token else channel
    if token:
        credentials = grpc.composite_channel_credentials(credentials, bearer_call_credentials(token))
    return grpc.secure_channel(target, credentials, options=list(options))


def bind_server(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on ``address`` with TLS, or in plaintext when ``credentials`` is None; returns the bound port."""
    if credentials is None:
        log.warning("plaintext_listener", address=address)
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)
