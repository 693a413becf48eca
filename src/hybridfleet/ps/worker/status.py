"""A small Status client for progress bars and operators (`hfleet ps status`)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from hybridfleet.ps.wire._proto import ps_pb2, ps_pb2_grpc
from hybridfleet.ps.wire.protocol import GRPC_OPTIONS


class ShardStatusProbe:
    """Asks one shard for its status; failures read as "unknown" (version 0), never raise."""

    def __init__(self, address: str, certs_dir: Path | None, token, insecure: bool = False):
        """TLS trusting ``certs_dir``'s CA; ``token``: a string, None, or a function returning the current
        one. Plaintext only with ``insecure`` (an `AuthError` otherwise,
        so a bearer token never travels unencrypted by accident)."""
        if certs_dir is None and not insecure:
            from hybridfleet.errors import AuthError

            raise AuthError(f"no CA to reach {address} over TLS: pass --certs DIR (from `hfleet certs init`); "
                            "plaintext, which sends the token unencrypted, needs --insecure")
        if insecure:
            self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        else:
            from hybridfleet.security import load_pki

            creds = grpc.ssl_channel_credentials(root_certificates=load_pki(certs_dir).ca_cert.read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=GRPC_OPTIONS)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self._token = token

    @property
    def metadata(self) -> tuple:
        token = self._token() if callable(self._token) else self._token  # a function: renewed tokens
        return (("authorization", f"Bearer {token}"),) if token else ()

    def status(self, timeout_s: float = 2.0) -> dict:
        return json.loads(self.stub.Status(ps_pb2.StatusRequest(), metadata=self.metadata, timeout=timeout_s).json)

    def version(self) -> int:
        try:
            return int(self.status()["version"])
        except (grpc.RpcError, KeyError, ValueError):
            return 0

    def close(self) -> None:
        self.channel.close()
