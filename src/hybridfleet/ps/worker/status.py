"""A small Status client for progress bars and operators (`hfleet ps status`)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from hybridfleet.ps.wire._proto import ps_pb2, ps_pb2_grpc
from hybridfleet.ps.wire.protocol import GRPC_OPTIONS


class ShardStatusProbe:
    """Asks one shard for its status; failures read as "unknown" (version 0), never raise."""

    def __init__(self, address: str, certs_dir: Path | None, token: str | None, insecure: bool = False):
        if insecure or certs_dir is None:
            self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        else:
            from hybridfleet.security import load_pki

            creds = grpc.ssl_channel_credentials(root_certificates=load_pki(certs_dir).ca_cert.read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=GRPC_OPTIONS)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def status(self, timeout_s: float = 2.0) -> dict:
        return json.loads(self.stub.Status(ps_pb2.StatusRequest(), metadata=self.metadata, timeout=timeout_s).json)

    def version(self) -> int:
        try:
            return int(self.status()["version"])
        except (grpc.RpcError, KeyError, ValueError):
            return 0

    def close(self) -> None:
        self.channel.close()
