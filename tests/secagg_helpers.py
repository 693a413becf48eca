"""Secure-aggregation test pushers: in-process `SecureRounds` over real `PSClient`s against real shards."""

from __future__ import annotations

import numpy as np

from hybridfleet.ps.secagg.rounds import SecureRounds
from hybridfleet.ps.secagg.settings import SecAggSettings
from hybridfleet.ps.wire.sharding import ParamSpec
from tests.script_optim_helpers import run_workers

PARAMS = [ParamSpec("w", (64, 64)), ParamSpec("b", (64,))]


class Pusher:
    """One site's worker pushing masked updates through the real client."""

    def __init__(self, cluster, site: str):
        self.client = cluster.client(site, retry_timeout_s=5.0)
        self.client.join(PARAMS, cluster.spec.ps.block_size_bytes, cluster.spec.ps.compression.codec, "torch")
        self.settings = SecAggSettings.resolve(cluster.spec.ps, cluster.spec.sites)
        self.secure = SecureRounds(self.client, self.settings, cluster.spec.ps)
        self.sent: list[np.ndarray] = []

    def blocks(self, update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, value in update.items():
            out.update(self.client.plan.split(name, value.reshape(-1).astype(np.float32)))
        return out

    def push(self, update: dict[str, np.ndarray], unmask: bool = True) -> None:
        base = list(self.client.versions)
        self.secure.push(self.blocks(update), base, contributors=1)
        if unmask:
            self.secure.unmask(base)
            self.client.pull(wait_for_versions=[v + 1 for v in base])


def init(cluster, pushers: list[Pusher]) -> None:
    first = pushers[0].client
    zeros = {k: np.zeros(b.stop - b.start, np.float32).tobytes() for b in first.plan.blocks for k in [b.key]}
    first.push(zeros, codec="none", kind="INIT")
    for p in pushers:
        p.client.pull(full=True)


def run_round(pushers: list[Pusher], updates: list[dict]) -> None:
    """Every pusher pushes its update in its own thread (a round); re-raises a pusher's error."""
    run_workers(lambda rank: pushers[rank].push(updates[rank]), len(pushers))


def updates(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.uniform(-0.5, 0.5, (64, 64)).astype(np.float32),
             "b": rng.uniform(-0.5, 0.5, 64).astype(np.float32)} for _ in range(n)]
