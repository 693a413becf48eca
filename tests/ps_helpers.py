"""Helpers for parameter-server tests: a real TLS + token shard on 127.0.0.1 and clients for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridfleet.ps.worker.client import ClientSecurity, PSClient
from hybridfleet.ps.server.serve import server_security, start_shard
from hybridfleet.ps.wire.sharding import ParamSpec
from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
from hybridfleet.security.tokens import SIGNING_KEY
from hybridfleet.spec import parse_spec

PARAMS = [ParamSpec("fc.weight", (4, 3)), ParamSpec("fc.bias", (4,))]


def job_spec(sites: dict | None = None, **ps):
    ps_conf = {"shards": 1, "sync": "bsp", "optimizer": {"name": "sgd", "lr": 0.5},
               "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0, **ps}
    return parse_spec({"name": "unit", "framework": "torch", "entrypoint": "train.py",
                       "sites": sites or {"a": {"workers": 1}, "b": {"workers": 1}}, "ps": ps_conf})


@dataclass
class Cluster:
    spec: object
    certs: Path
    issuer: TokenIssuer
    servers: list
    insecure: bool = False
    transport: str = "auto"

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def token(self, site: str = "a", role: str = "worker", ttl_s: float = 600, job: str | None = None,
              issued_ago_s: float = 0.0) -> str:
        issuer = self.issuer
        if issued_ago_s:
            import time

            issuer = TokenIssuer((self.certs / SIGNING_KEY).read_bytes(), clock=lambda: time.time() - issued_ago_s)
        return issuer.issue(job or self.spec.name, site, role, ttl_s)

    def client(self, site: str = "a", rank: int = 0, token: str | None = None, worker_id: str | None = None,
               retry_timeout_s: float = 2.0, transport: str | None = None) -> PSClient:
        """A TLS client; ``transport`` defaults to the cluster's (bulk data plane or gRPC for Push/Pull)."""
        sec = ClientSecurity.from_files(str(load_pki(self.certs).ca_cert),
                                        token=token if token is not None else self.token(site))
        return PSClient(self.addresses, sec, worker_id or f"{site}-{rank}", site, rank, retry_timeout_s=retry_timeout_s,
                        transport=transport or self.transport)

    def params(self) -> dict[str, np.ndarray]:
        out = {}
        for s in self.servers:
            out.update(s.state.snapshot_arrays())
        return out

    def stop(self) -> None:
        for s in self.servers:
            s.stop(0)


def start_cluster(tmp_path: Path, expected_workers: int = 0, transport: str = "auto", sites: dict | None = None,
                  **ps) -> Cluster:
    """Shards on 127.0.0.1 with TLS and tokens; clients use ``transport`` ("auto": the bulk data plane)."""
    spec = job_spec(sites, **ps)
    certs = tmp_path / "certs"
    make_dev_pki(certs)
    generate_signing_key(certs)
    security = server_security(spec, certs)
    servers = [start_shard(spec, i, "127.0.0.1", 0, security, expected_workers) for i in range(spec.ps.shards)]
    return Cluster(spec, certs, TokenIssuer.from_dir(certs), servers, transport=transport)


def raw(arrays: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v, dtype="<f4").reshape(-1).tobytes() for k, v in arrays.items()}


def initial_values() -> dict[str, np.ndarray]:
    return {"fc.weight": np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "fc.bias": np.ones(4, np.float32)}


def join_and_init(cluster: Cluster, client: PSClient, init: bool = True) -> None:
    client.join(PARAMS, cluster.spec.ps.block_size_bytes, cluster.spec.ps.compression.codec, "torch")
    assert client.transport == ["bulk" if cluster.transport == "auto" else "grpc"] * len(cluster.servers)
    if init:
        blocks = {}
        for name, arr in initial_values().items():
            blocks.update(client.plan.split(name, arr.reshape(-1)))
        client.push(raw(blocks), codec="none", kind="INIT")
    client.pull(full=True)
