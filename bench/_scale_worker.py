"""One process of bench/scale.py: many simulated workers, each a real `PSClient` with its own
worker id, token and TLS connections, driven round by round by JSON lines on stdin.

Commands (one JSON object a line; each answered by one JSON line on stdout):

- ``{"op": "round"}``: every live client pushes its step (BSP: all push, then all pull the
  round's result; ASP: each pushes and pulls on its own), answer: per-client accepted
  pushes, bytes and seconds;
- ``{"op": "leave", "ids": [...]}`` / ``{"op": "rejoin", "ids": [...]}``: clients leave the
  quorum (``Leave``) or come back (a new connection, Join, full pull);
- ``{"op": "final"}``: catch up with the shards, answer each client's parameter digest and
  (observer) the ledger it saw;
- ``{"op": "exit"}``.

Compute is simulated: a client's gradient for (worker, step) is one of a small pool of
frames encoded once per process through the job's codec with error feedback (top-k + EF)
or densely, picked by (worker, step), so what a client pushes is known from its id and step
alone. Each client also pushes +1 into its own slot of a small "ledger" tensor on every
shard (lossless under top-k: the ledger has 100 x N elements, so its k >= N slots), which
is how bench/scale.py counts lost and double-applied pushes.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from hybridfleet.codec import codec_for
from hybridfleet.codec.feedback import ErrorFeedback
from hybridfleet.obs.log import configure
from hybridfleet.ps.worker.client import ClientSecurity, PSClient, ShardRestarted
from hybridfleet.ps.worker.status import ShardStatusProbe
from hybridfleet.ps.wire.sharding import ParamSpec
from hybridfleet.ps.wire.sharding import ShardingPlan
from hybridfleet.spec import load_spec

POOL = 4  # distinct gradient frames per key per process
LEDGER = "ledger"
MAX_ROUND_WAITS = 4  # BSP pulls that time out waiting for a straggler before the worker gives up


def ledger_name(shard: int) -> str:
    return f"{LEDGER}{shard}"


def model_params(numel: int, num_shards: int, num_workers: int) -> tuple[list[ParamSpec], int]:
    """The simulated model: one tensor ``w`` and one ledger tensor per shard, ``numel`` elements in all;
    returns the specs and the ledger length."""
    ledger = max(1000, 100 * num_workers)
    return ([ParamSpec("w", (numel - num_shards * ledger,))]
            + [ParamSpec(ledger_name(j), (ledger,)) for j in range(num_shards)], ledger)


class Sim:
    """One simulated worker: a `PSClient`, its values and its log of accepted pushes."""

    def __init__(self, cfg: dict, wid: str, site: str, index: int):
        self.cfg, self.wid, self.site, self.index = cfg, wid, site, index
        self.accepted: list[list[int]] = []  # [shard, step, base_version, version after]
        self.reported = 0  # how many of ``accepted`` were already reported
        self.restarts = 0  # pulls started over after a shard was re-joined
        self.values: dict[str, np.ndarray] = {}
        self.client: PSClient | None = None

    def connect(self, params: list[ParamSpec], spec) -> None:
        sec = ClientSecurity.from_files(self.cfg["ca"], token=self.cfg["tokens"][self.wid])
        self.client = PSClient(self.cfg["servers"], sec, self.wid, self.site, self.index)
        self.client.join(params, spec.ps.block_size_bytes, spec.ps.compression.codec, spec.framework)

    def pull(self, wait: list[int] | None = None, full: bool = False, observe=None) -> None:
        """Pull and apply; a shard that stopped answering for a while and was re-joined (`ShardRestarted`,
        e.g. a connection timed out on this loaded machine) is pulled again, in full."""
        restarts = waits = 0
        while True:
            try:
                pulled = self.client.pull(wait_for_versions=wait, full=full)
                break
            except ShardRestarted:
                self.restarts += 1
                restarts += 1
                if restarts == 3:
                    raise
            except grpc.RpcError as err:
                # a BSP pull waits at most the shard's ceiling (120 s) for the round's last push; with
                # a thousand clients on a few cores a straggler can take longer: wait again, a bounded
                # number of times
                waits += 1
                if wait is None or err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or waits > MAX_ROUND_WAITS:
                    raise
                print(f"scale worker {self.wid}: the round is still open ({err.details()}); waiting again",
                      file=sys.stderr, flush=True)
        for entry in pulled:
            if entry.delta_version == 0:
                new = np.frombuffer(entry.payload(), dtype=np.float32).copy()
                if observe is not None and entry.key in self.values:
                    observe(entry.key, self.client.versions, new - self.values[entry.key])
                self.values[entry.key] = new
            else:
                sparse = DOWN.decode_sparse(entry.payload())
                np.add.at(self.values[entry.key], sparse.indices, sparse.values)
                if observe is not None:
                    observe(entry.key, entry.delta_version, sparse)

    def digest(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self.values):
            h.update(self.values[key].tobytes())
        return h.hexdigest()

    def bytes_moved(self) -> int:
        b = self.client.bytes
        return sum(b.sent.values()) + sum(b.received.values())


DOWN = None  # the downlink codec (set in main)


def build_payloads(spec, plan, params, ledger_len: int, num_shards: int):
    """Per key, POOL encoded gradient frames (through error feedback for sparse codecs)."""
    codec = codec_for(spec.ps.compression)
    ef = ErrorFeedback(codec) if codec.sparse else None
    rng = np.random.default_rng(1234)
    pool: dict[str, list[bytes]] = {}
    for b in plan.blocks:
        if b.param.startswith(LEDGER):
            continue
        frames = []
        for _ in range(POOL):
            # multiples of 1/16 in [-1, 1]: sums over a round are exact in float32, in any order
            grad = rng.integers(-16, 17, b.stop - b.start).astype(np.float32) / np.float32(16)
            frames.append(ef.encode(b.key, grad) if ef is not None else codec.encode(grad))
        pool[b.key] = frames
    return codec, pool


def main() -> None:
    global DOWN
    cfg = json.loads(sys.stdin.readline())
    configure(level="error")
    spec = load_spec(cfg["job"])
    params, ledger_len = model_params(cfg["numel"], spec.ps.shards, cfg["num_workers"])
    plan = ShardingPlan.build(params, spec.ps.shards, spec.ps.block_size_bytes)
    codec, pool = build_payloads(spec, plan, params, ledger_len, spec.ps.shards)
    DOWN = codec
    ledger_keys = {b.key: b.shard for b in plan.blocks if b.param.startswith(LEDGER)}
    sims = {wid: Sim(cfg, wid, site, idx) for wid, site, idx in cfg["workers"]}
    slot = {wid: i for i, wid in enumerate(cfg["all_ids"])}
    ledger_frames: dict[str, dict[str, bytes]] = {}
    for wid in sims:
        frames = {}
        for key in ledger_keys:
            one = np.zeros(ledger_len, np.float32)
            one[slot[wid]] = 1.0
            frames[key] = codec.encode(one)
        ledger_frames[wid] = frames
    probe_lock = threading.Lock()
    probes = [ShardStatusProbe(a, Path(cfg["certs"]), cfg["admin_token"]) for a in cfg["servers"]]
    observer = cfg.get("observer")
    seen: dict[str, dict[int, dict[int, float]]] = {}  # ledger key -> version -> slot -> change

    def observe(key, version, change):
        if key not in ledger_keys:
            return
        if isinstance(version, list):  # dense values: the change since the last pull
            version = version[ledger_keys[key]]
            idx = np.flatnonzero(change)
            vals = change[idx]
        else:
            idx, vals = change.indices, change.values
        seen.setdefault(key, {})[int(version)] = {int(i): float(v) for i, v in zip(idx, vals) if v != 0}

    pool_exec = ThreadPoolExecutor(max_workers=min(64, max(1, len(sims))))
    # joins and first full pulls (the whole model each) a few at a time: all at once, a thousand of
    # them starve the shards past the clients' deadlines on a small host
    connect_exec = ThreadPoolExecutor(max_workers=cfg.get("connect_concurrency", 4))
    live: set[str] = set()

    def run_all(fn, ids, executor=pool_exec):
        errors = [f.exception() for f in [executor.submit(fn, sims[w]) for w in ids]]
        bad = [e for e in errors if e is not None]
        if bad:
            raise bad[0]

    def connect(sim: Sim):
        sim.connect(params, spec)
        if sim.wid == cfg["initialiser"]:
            rng = np.random.default_rng(7)
            init = {b.key: (np.zeros(b.stop - b.start, np.float32) if b.param.startswith(LEDGER)
                            else rng.standard_normal(b.stop - b.start).astype(np.float32)).tobytes()
                    for b in sim.client.plan.blocks}
            sim.client.push(init, codec="none", kind="INIT")
        sim.pull(full=True)

    def resolve(sim: Sim, step: int, base: list[int]) -> None:
        """After a failed push: which shards accepted it (each shard's clock for this worker)."""
        with probe_lock:
            for j, probe in enumerate(probes):
                clock = probe.status(timeout_s=10)["members"].get(sim.wid, {}).get("clock", 0)
                if clock == step:
                    sim.accepted.append([j, step, base[j], -1])

    def push(sim: Sim) -> None:
        """Push this worker's step to every shard; a push refused or broken on some shard (its answer
        lost) is settled from the shards' clocks and, under BSP, sent again to the shards that lack it
        (those that have it refuse the repeat: one push per worker per round)."""
        c = sim.client
        base = list(c.versions)
        rounds_in = set(range(len(base))) if spec.ps.sync == "bsp" else set()
        for attempt in range(4):
            step = c.clock + 1
            payloads = {k: frames[(slot[sim.wid] * 7 + step) % POOL] for k, frames in pool.items()}
            payloads.update(ledger_frames[sim.wid])
            try:
                replies = c.push(payloads, codec=spec.ps.compression.codec, base_versions=base)
            except Exception as err:  # noqa: BLE001 - its outcome is read back from the shards
                print(f"scale worker {sim.wid}: push step {step} failed ({type(err).__name__}: {err}); "
                      "settling from the shards' clocks", file=sys.stderr, flush=True)
                resolve(sim, step, base)
            else:
                for j, r in enumerate(replies):
                    if r is not None:
                        sim.accepted.append([j, step, base[j], int(r.version)])
            have = {e[0] for e in sim.accepted if e[2] == base[e[0]]}
            if not rounds_in - have:
                return
        raise RuntimeError(f"worker {sim.wid}: shards {sorted(rounds_in - have)} never accepted round {base}")

    def pull_round(sim: Sim):
        wait = [v + 1 for v in sim.client.versions] if spec.ps.sync == "bsp" else None
        sim.pull(wait=wait, observe=observe if sim.wid == observer else None)

    def asp_step(sim: Sim):
        push(sim)
        sim.pull(observe=observe if sim.wid == observer else None)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        started = time.perf_counter()
        before = {w: sims[w].bytes_moved() if sims[w].client else 0 for w in sims}
        out: dict = {"op": op}
        if op in ("start", "rejoin"):
            ids = cmd.get("ids") or list(sims)
            for w in ids:  # a rejoining worker comes back on a new connection
                if sims[w].client is not None:
                    sims[w].client.close(leave=False)
            run_all(connect, [w for w in ids if w == cfg["initialiser"]], connect_exec)
            run_all(connect, [w for w in ids if w != cfg["initialiser"]], connect_exec)
            live |= set(ids)
        elif op == "round":
            ids = sorted(live)
            if spec.ps.sync == "bsp":
                run_all(push, ids)
                run_all(pull_round, ids)
            else:
                run_all(asp_step, ids)
            out["bytes"] = sum(sims[w].bytes_moved() - before[w] for w in ids)
            out["accepted"] = {w: sims[w].accepted[sims[w].reported:] for w in ids}
            for w in ids:
                sims[w].reported = len(sims[w].accepted)
            out["clients"] = len(ids)
        elif op == "leave":
            for w in cmd["ids"]:
                sims[w].client.close(leave=True)
                sims[w].client = None
                live.discard(w)
        elif op == "final":
            run_all(lambda s: s.pull(), sorted(live))
            out["digests"] = {w: sims[w].digest() for w in sorted(live)}
            out["restarts"] = sum(s.restarts for s in sims.values())
            out["ledger"] = {w: {k: sims[w].values[k][:len(cfg["all_ids"])].tolist() for k in ledger_keys}
                             for w in sorted(live)[:1]}
            out["seen"] = {k: {str(v): s for v, s in d.items()} for k, d in seen.items()}
        elif op == "exit":
            break
        out["s"] = time.perf_counter() - started
        print(json.dumps(out), flush=True)
    for sim in sims.values():
        if sim.client is not None:
            sim.client.close(leave=False)
    for p in probes:
        p.close()


if __name__ == "__main__":
    main()
