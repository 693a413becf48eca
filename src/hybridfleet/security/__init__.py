"""Transport security for the parameter server: a dev PKI, signed tokens, the gRPC auth interceptor.

Secure by default: TLS from `certs`, an Ed25519-signed token per caller from
`tokens`, checked on every RPC by `grpc_auth.AuthInterceptor`. Plaintext and
no-auth are the caller's explicit choice, expressed by passing ``None``
credentials to `grpc_auth.bind_server` / `grpc_auth.open_channel`.
"""

from hybridfleet.security.certs import (
    CertKeyPair,
    Pki,
    channel_credentials,
    load_pki,
    make_dev_pki,
    server_credentials,
)
from hybridfleet.security.grpc_auth import (
    AuthInterceptor,
    bearer_call_credentials,
    bind_server,
    current_claims,
    open_channel,
    token_metadata,
)
from hybridfleet.security.tokens import (
    Claims,
    TokenIssuer,
    TokenRejectedError,
    TokenVerifier,
    generate_signing_key,
)

__all__ = [
    "AuthInterceptor",
    "CertKeyPair",
    "Claims",
    "Pki",
    "TokenIssuer",
    "TokenRejectedError",
    "TokenVerifier",
    "bearer_call_credentials",
    "bind_server",
    "channel_credentials",
    "current_claims",
    "generate_signing_key",
    "load_pki",
    "make_dev_pki",
    "open_channel",
    "server_credentials",
    "token_metadata",
]
