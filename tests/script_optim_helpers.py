"""Models, optimizers and a driver for the script-optimizer equivalence tests.

Each case is trained twice, the same way: once as a plain script (``optimizer.step()``)
and once through real TLS shards (``hf.connect(model, optimizer)`` ... ``ps.step()``).
Workers run as threads of the test process, each with its own gRPC client.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridfleet.ps.server.serve import server_security, start_shard
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.session import WorkerConfig
from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
from hybridfleet.spec import parse_spec

VOCAB, SEQ, DIM, CLASSES = 11, 6, 8, 3
WARMUP, TOTAL = 5, 50


def warmup_cosine(step: int) -> float:
    """The learning-rate factor of step ``step`` (0-based): linear warmup, then cosine to 0."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP)))


def job(framework: str, workers: int = 1, shards: int = 1, **ps):
    """A job without ps.optimizer: the shards apply the script's optimizer."""
    return parse_spec({"name": "optim", "framework": framework, "entrypoint": "train.py",
                       "sites": {"a": {"workers": workers}},
                       "ps": {"shards": shards, "sync": "bsp", "block_size_bytes": 1024,
                              "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0, **ps}})


@dataclass
class Shards:
    spec: object
    servers: list
    certs: Path
    issuer: TokenIssuer

    def config(self, rank: int) -> WorkerConfig:
        token = self.issuer.issue(self.spec.name, "a", "worker", 600, worker=f"a-{rank}")
        sec = ClientSecurity.from_files(str(load_pki(self.certs).ca_cert), token=token)
        return WorkerConfig(job=self.spec, site="a", rank=rank, site_rank=rank,
                            servers=[s.address for s in self.servers], security=sec)

    def status(self) -> list[dict]:
        return [s.state.status() for s in self.servers]

    def params(self) -> dict[str, np.ndarray]:
        out = {}
        for s in self.servers:
            out.update(s.state.snapshot_arrays())
        return out

    def stop(self) -> None:
        for s in self.servers:
            s.stop(0)


def start_shards(tmp_path: Path, spec) -> Shards:
    certs = tmp_path / "certs"
    if not certs.exists():
        make_dev_pki(certs)
        generate_signing_key(certs)
    security = server_security(spec, certs)
    workers = sum(s.workers for s in spec.sites.values())
    servers = [start_shard(spec, i, "127.0.0.1", 0, security, workers) for i in range(spec.ps.shards)]
    return Shards(spec, servers, certs, TokenIssuer.from_dir(certs))


def run_workers(fn, n: int, timeout_s: float = 300) -> list:
    """Run ``fn(rank)`` in ``n`` threads; returns the results, re-raising a worker's error. A worker
    still running after ``timeout_s`` (waiting for a round that never closes) fails the test."""
    results, errors = [None] * n, []

    def one(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a worker still runs after {timeout_s} s"
    return results


def batches(seed: int, steps: int, n: int = 4):
    """Deterministic inputs for the trio of models: images, tokens, labels."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (rng.standard_normal((n, 1, 6, 6)).astype(np.float32),
               rng.integers(0, VOCAB, (n, SEQ)).astype(np.int64),
               rng.integers(0, CLASSES, n).astype(np.int64))


def assert_close(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Each tensor within ``rtol`` relative (of its largest magnitude) of the reference."""
    assert set(got) == set(want)
    for k in want:
        scale = max(float(np.abs(want[k]).max()), 1e-6)
        err = float(np.abs(got[k] - want[k]).max()) / scale
        assert err <= rtol, f"{k}: relative difference {err:.2e} > {rtol:g}"
