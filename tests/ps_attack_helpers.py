"""Helpers for attack tests: a legitimate two-site job that trains through a real shard while
an attacker probes it, a snapshot of the shard's state to prove refusals changed nothing,
and a sampler of this process's resident memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np

from hybridfleet.codec import codec_for, get_codec
from hybridfleet.ps.wire._proto import ps_pb2_grpc
from hybridfleet.ps.wire.protocol import GRPC_OPTIONS
from hybridfleet.security import load_pki
from tests.ps_helpers import PARAMS, Cluster, raw

NONE = get_codec("none")
GIB = 1 << 30


def make_data(seed: int, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Four well-separated classes in 3-D: softmax regression (fc.weight 4x3, fc.bias 4) fits them."""
    rng = np.random.default_rng(seed)
    centers = 2.5 * np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [-1, -1, -1]], np.float32)
    y = rng.integers(0, 4, n)
    return (centers[y] + rng.normal(0, 0.5, (n, 3))).astype(np.float32), y


def gradients(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    logits = x @ w.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    return {"fc.weight": (p.T @ x).astype(np.float32), "fc.bias": p.sum(0).astype(np.float32)}


def accuracy(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ w.T + b).argmax(1) == y).mean())


class LegitJob:
    """Workers a-0 and b-0, each with its own data, training in BSP through ``cluster``."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.data = {"a": make_data(1), "b": make_data(2)}
        self.test = make_data(3, 400)
        self.clients = {s: cluster.client(s) for s in ("a", "b")}
        spec = cluster.spec.ps
        for c in self.clients.values():
            c.join(PARAMS, spec.block_size_bytes, spec.compression.codec, "torch")
        init = {"fc.weight": np.zeros((4, 3), np.float32), "fc.bias": np.zeros(4, np.float32)}
        a = self.clients["a"]
        blocks = {}
        for name, arr in init.items():
            blocks.update(a.plan.split(name, arr.reshape(-1)))
        a.push(raw(blocks), codec="none", kind="INIT")
        for c in self.clients.values():
            c.pull(full=True)
        self.w, self.b = init["fc.weight"], init["fc.bias"]
        self.steps_done = 0
        self.codec = codec_for(spec.compression)

    def _encoded(self, client, g: dict[str, np.ndarray]) -> dict[str, bytes]:
        out = {}
        for name, arr in g.items():
            for key, part in client.plan.split(name, arr.reshape(-1)).items():
                out[key] = self.codec.encode(part)
        return out

    def train(self, steps: int) -> None:
        """``steps`` BSP rounds: both workers push, then pull the applied round."""
        for _ in range(steps):
            version = self.cluster.servers[0].state.version
            for site, client in self.clients.items():
                x, y = self.data[site]
                client.push(self._encoded(client, gradients(self.w, self.b, x, y)), codec=self.codec.name,
                            base_versions=[version])
            values = {"fc.weight": self.w.reshape(-1).copy(), "fc.bias": self.b.copy()}
            for site, client in self.clients.items():
                entries = client.pull(wait_for_versions=[version + 1], timeout_s=30)
                if site != "a":
                    continue
                for e in entries:  # values, or (compressed downlink) encoded deltas in order
                    if e.delta_version:
                        values[e.key] = values[e.key] + get_codec(self.codec.name).decode(e.payload())
                    else:
                        values[e.key] = np.frombuffer(e.payload(), "<f4").copy()
            self.w, self.b = values["fc.weight"].reshape(4, 3), values["fc.bias"]
            self.steps_done += 1

    def accuracy(self) -> float:
        return accuracy(self.w, self.b, *self.test)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def shard_state(cluster: Cluster) -> dict:
    """What a refusal must not change: parameters, version, membership, open rounds, applied pushes."""
    out = {}
    for s in cluster.servers:
        st = s.state
        with st.cond:
            out[st.shard] = {
                "params": {k: v.copy() for k, v in st.params.items()},
                "version": st.version,
                "members": {w: (m.site, m.clock, m.alive) for w, m in st.members.items()},
                "rounds": {v: sorted(r.contributors) for v, r in st.rounds.items()},
                "applied": st.applied_pushes,
                "initialized": sorted(st.initialized),
            }
    return out


def assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for shard, b in before.items():
        a = after[shard]
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
        assert a["params"].keys() == b["params"].keys()
        for k in b["params"]:
            np.testing.assert_array_equal(a["params"][k], b["params"][k])


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of process ``pid`` now (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


def peak_rss_bytes(pid: int | str) -> int:
    """The highest resident set size process ``pid`` ever had (VmHWM, bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc status")


class RssWatch:
    """Samples this process's RSS every 10 ms while the block runs; ``peak`` is the highest seen."""

    def __init__(self):
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "RssWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def grpc_stub(cluster: Cluster, token: str | None) -> tuple[ps_pb2_grpc.ParameterServerStub, tuple, grpc.Channel]:
    """A raw TLS stub to shard 0 sending ``token``: for requests a well-behaved client never makes."""
    creds = grpc.ssl_channel_credentials(root_certificates=load_pki(cluster.certs).ca_cert.read_bytes())
    channel = grpc.secure_channel(cluster.addresses[0], creds, options=GRPC_OPTIONS)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return ps_pb2_grpc.ParameterServerStub(channel), metadata, channel


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
