"""The parameter server at many workers: round time, shard CPU and memory, bytes per worker, churn.

    python bench/scale.py                          # N = 10 100 1000, S = 1 2 4 8, top-k (and dense for N <= 100), bsp + asp
    python bench/scale.py --quick                  # N = 10 50, S = 2, top-k, bsp, a short churn run
    python bench/scale.py --n 10 100 --shards 4 --codecs topk --sync bsp --rounds 3 --no-churn

N simulated workers run as real `PSClient`s, many per process (bench/_scale_worker.py, at most
``--clients-per-process`` each), every one with its own worker id, its own token signed for it
and its own TLS connections, against S real shard processes (``hfleet ps serve`` with TLS and
tokens, as deployed). The model has ``--numel`` float32 parameters (1M) cut across the shards;
the job's codec is top-k 1% with error feedback (or dense ``none``), server-side SGD.

Per configuration (N, S, codec, sync), after the joins, ``--settle`` seconds (the gRPC channels
the joins used close once idle, as in a running job whose control calls go by the bulk plane)
and one warm-up round, ``--rounds`` timed rounds:

- ``round_p50_s`` / ``round_p99_s``: a round's wall time (every worker pushes and has pulled the
  result; ASP: every worker pushed once and pulled), over the timed rounds;
- ``shard_cpu_s_per_round``: user + system CPU-seconds of all shard processes (/proc) per round;
- ``shard_rss_kib``: the shard processes' resident memory summed, after the rounds;
- ``shard_threads``: the most threads one shard process had after a timed round (/proc);
- ``bytes_per_worker``: bytes a worker sent + received per round (its client's counters).

For each (S, codec, sync) measured at two or more N, the least-squares slope over N of the
round time (``per_worker_round_us``), of the shard RSS (``per_worker_rss_kib``) and of the shard
CPU per round (``per_worker_cpu_us``).

Lost and double-applied pushes: each worker also pushes +1 into its own slot of a ledger
tensor on every shard (lossless: top-k keeps k >= N of the ledger's 100 x N elements). BSP:
one worker that never churns records, from every version it pulls, which ledger slots the
shard's round moved and by how much (a double-applied push moves its slot twice as far);
this is compared with the replayed log of pushes the shards acknowledged (per shard, a push
of base version v belongs to round v). ASP: the final ledger value of a slot counts that
worker's applied pushes (exact: lr 1/8 and +1 steps), compared with its acknowledged pushes.
A push whose answer never came (its process was SIGKILLed, or the call failed) is settled by
the shard's own counter (its ``Status`` clock for that worker). Every live worker must end
with the same parameters (sha256 of its values).

The churn run (BSP, top-k, ``--churn-n`` workers, 2 shards, ``--churn-s`` seconds) changes 10% of
the membership per minute: workers leave (``Leave``) and rejoin on new connections, and a
whole client process is SIGKILLed mid-round and started again (its workers rejoin).

Keys of the JSON last line: per_worker_round_us, per_worker_rss_kib (all shards together),
per_worker_rss_kib_per_shard (the same over S: what one shard holds per worker), per_worker_cpu_us (of the
reference group: S = 4, top-k, bsp, else the first group with two N), round_p99_s_n1000 (null
when N = 1000 was not run), lost_pushes, double_applied (all runs together), workers_agree,
churn (its events and checks), configs (every configuration's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _scale_worker import LEDGER, model_params  # noqa: E402
from _proc import cpu_s, status_field  # noqa: E402
from _shards import REPO, serve_shards, stop_shards  # noqa: E402

LR = 0.125  # a power of two: ledger counts stay exact
SITE_WORKERS = 100  # workers per site in the simulated job


def job_data(n: int, shards: int, codec: str, sync: str, numel: int, churn: bool, framework: str = "torch") -> dict:
    """The simulated job: sites of up to 100 workers, the model cut so every shard holds a ledger;
    ``framework`` picks the shards' optimizer numerics (torch's or Paddle's SGD)."""
    sites = {}
    for i in range(0, n, SITE_WORKERS):
        sites[f"site{i // SITE_WORKERS:02d}"] = {"workers": min(SITE_WORKERS, n - i)}
    params, ledger = model_params(numel, shards, n)
    w_bytes = params[0].nbytes
    block = max(1024, -(-w_bytes // shards), ledger * 4)
    ps = {"shards": shards, "sync": sync, "optimizer": {"name": "sgd", "lr": LR}, "block_size_bytes": block,
          "compression": {"codec": codec},
          "heartbeat_interval_s": 0.5 if churn else 5.0, "heartbeat_timeout_s": 3.0 if churn else 120.0}
    return {"name": "bench-scale", "framework": framework, "entrypoint": "t.py", "sites": sites, "ps": ps}


class Fleet:
    """The shard processes and the client processes of one configuration."""

    def __init__(self, workdir: Path, n: int, shards: int, codec: str, sync: str, numel: int,
                 per_process: int, churn: bool = False, framework: str = "torch"):
        from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki, make_dev_pki
        from hybridfleet.security.credentials import initialising_worker, issue_admin_token, worker_id
        from hybridfleet.spec import parse_spec

        data = job_data(n, shards, codec, sync, numel, churn, framework)
        # the plan must give every shard a ledger, or its pushes could not be counted
        from hybridfleet.ps.wire.sharding import ShardingPlan

        params, _ = model_params(numel, shards, n)
        plan = ShardingPlan.build(params, shards, data["ps"]["block_size_bytes"])
        lacking = [j for j in range(shards)
                   if not any(b.param.startswith(LEDGER) for b in plan.blocks_for_shard(j))]
        if lacking:
            raise ValueError(f"N={n}, S={shards}: shard(s) {lacking} hold no ledger tensor; raise --numel")
        self.spec = spec = parse_spec(data)
        tag = f"{n}-{shards}-{codec}-{sync}{'-churn' if churn else ''}"
        certs = workdir / f"certs-{tag}"
        make_dev_pki(certs, clients=["worker"])
        generate_signing_key(certs)
        issuer = TokenIssuer.from_dir(certs)
        job = workdir / f"job-{tag}.yaml"
        job.write_text(yaml.safe_dump(data))
        self.workers = [(worker_id(site, r), site, r) for site, s in spec.sites.items() for r in range(s.workers)]
        self.ids = [w for w, _, _ in self.workers]
        tokens = {w: issuer.issue(spec.name, site, "worker", 7200, worker=w) for w, site, _ in self.workers}
        self.shards, self.servers = serve_shards(job, shards, workdir, expected_workers=n, certs=certs, timeout_s=120)
        from hybridfleet.ps.worker.status import ShardStatusProbe

        self.admin = issue_admin_token(spec, issuer)
        self.probes = [ShardStatusProbe(a, certs, self.admin) for a in self.servers]
        self.base_cfg = {"job": str(job), "certs": str(certs), "servers": self.servers,
                         "numel": numel, "num_workers": n, "all_ids": self.ids, "tokens": tokens,
                         "admin_token": self.admin, "initialiser": initialising_worker(spec),
                         "observer": self.ids[0]}
        self.base_cfg["ca"] = str(load_pki(certs).ca_cert)
        self.groups: list[list] = []
        churners = max(1, n // 50) if churn else 0
        rest = self.workers[:n - churners]
        for i in range(0, len(rest), per_process):
            self.groups.append(rest[i:i + per_process])
        if churners:
            self.groups.append(self.workers[n - churners:])  # the process that is SIGKILLed
        self.procs: list[subprocess.Popen | None] = [None] * len(self.groups)
        self.accepted: dict[str, list] = {w: [] for w in self.ids}
        self.unsettled: list[tuple[str, int, list[int]]] = []  # (worker, last logged step, shard versions)

    def start(self, g: int) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO / 'bench'}", "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen([sys.executable, str(REPO / "bench" / "_scale_worker.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
        p.stdin.write(json.dumps({**self.base_cfg, "workers": self.groups[g]}) + "\n")
        p.stdin.flush()
        self.procs[g] = p

    def send(self, g: int, cmd: dict) -> None:
        self.procs[g].stdin.write(json.dumps(cmd) + "\n")
        self.procs[g].stdin.flush()

    def answer(self, g: int, timeout_s: float = 600) -> dict:
        line = self.procs[g].stdout.readline()
        if not line:
            raise RuntimeError(f"client process {g} ended (exit {self.procs[g].wait(timeout_s)})")
        return json.loads(line)

    def all(self, cmd: dict, groups=None) -> list[dict]:
        groups = [g for g in (groups if groups is not None else range(len(self.groups))) if self.procs[g]]
        for g in groups:
            self.send(g, cmd)
        out = [self.answer(g) for g in groups]
        for a in out:
            for w, entries in a.get("accepted", {}).items():
                self.accepted[w].extend(entries)
        return out

    def evidence(self, finals: list[dict]) -> dict:
        """What `check` needs: the acknowledged pushes and the final answers."""
        return {"sync": self.spec.ps.sync, "shards": self.spec.ps.shards, "ids": self.ids,
                "accepted": self.accepted, "finals": finals}

    def shard_cpu_s(self) -> float:
        return sum(cpu_s(p.pid) for p in self.shards)

    def shard_rss_kib(self) -> int:
        return sum(status_field("VmRSS", p.pid) or 0 for p in self.shards)

    def shard_threads(self) -> int:
        return max(status_field("Threads", p.pid) or 0 for p in self.shards)

    def versions(self) -> list[int]:
        return [int(p.status(timeout_s=30)["version"]) for p in self.probes]

    def kill(self, g: int, before: list[int]) -> None:
        """SIGKILL client process ``g`` now, in the round that started at shard versions ``before``;
        its workers' pushes of that round are settled later (`settle`)."""
        self.procs[g].send_signal(signal.SIGKILL)
        self.procs[g].wait()
        self.procs[g] = None
        for w, _, _ in self.groups[g]:
            steps = [e[1] for e in self.accepted[w]]
            self.unsettled.append((w, max(steps, default=0), before))

    def settle(self) -> None:
        """The pushes whose answer died with their process: accepted iff the shard's clock moved past the log."""
        statuses = [p.status(timeout_s=30) for p in self.probes]
        for w, last_step, versions in self.unsettled:
            for j, st in enumerate(statuses):
                clock = st["members"].get(w, {}).get("clock", 0)
                if clock > last_step:
                    self.accepted[w].append([j, clock, versions[j], -1])
        self.unsettled = []

    def close(self) -> None:
        for g, p in enumerate(self.procs):
            if p is not None:
                try:
                    self.send(g, {"op": "exit"})
                    p.wait(30)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
        for probe in self.probes:
            probe.close()
        stop_shards(self.shards)


def check(evidence: dict) -> dict:
    """Lost and double-applied pushes: the replayed log of acknowledged pushes (``evidence["accepted"]``:
    worker -> [shard, step, base version, version after]) against what the ledger shows
    (``evidence["finals"]``: the client processes' final answers); do all live workers agree?"""
    finals, accepted, ids = evidence["finals"], evidence["accepted"], evidence["ids"]
    digests = {w: d for a in finals for w, d in a.get("digests", {}).items()}
    slot_of = {w: i for i, w in enumerate(ids)}
    num_shards = evidence["shards"]
    lost = double = 0
    if evidence["sync"] == "bsp":
        seen = next(a["seen"] for a in finals if a.get("seen"))
        observed: dict[int, dict[int, dict[int, float]]] = {}  # shard -> version -> slot -> change
        for key, by_version in seen.items():
            shard = int(key[len(LEDGER):])
            for v, moved in by_version.items():
                observed.setdefault(shard, {})[int(v)] = {int(s): c for s, c in moved.items()}
        expected: dict[int, dict[int, dict[int, int]]] = {}  # shard -> version after -> slot -> pushes
        for w, entries in accepted.items():
            for shard, _step, base, _after in entries:
                slots = expected.setdefault(shard, {}).setdefault(base + 1, {})
                slots[slot_of[w]] = slots.get(slot_of[w], 0) + 1
        for shard in range(num_shards):
            exp, obs = expected.get(shard, {}), observed.get(shard, {})
            for v in set(exp) | set(obs):
                counts = _counts(obs.get(v, {}))
                want = exp.get(v, {})
                for s in set(counts) | set(want):
                    lost += max(0, want.get(s, 0) - counts.get(s, 0))
                    double += max(0, counts.get(s, 0) - want.get(s, 0))
    else:
        ledger = next(a["ledger"] for a in finals if a.get("ledger"))
        values = next(iter(ledger.values()))
        for key, slots in values.items():
            shard = int(key.split("#")[0][len(LEDGER):])
            for w in ids:
                got = round(-slots[slot_of[w]] / LR)
                want = sum(1 for e in accepted[w] if e[0] == shard)
                lost += max(0, want - got)
                double += max(0, got - want)
    return {"lost_pushes": lost, "double_applied": double, "live_workers": len(digests),
            "pulls_started_over": sum(a.get("restarts", 0) for a in finals),
            "workers_agree": len(set(digests.values())) == 1}


def _counts(moved: dict[int, float]) -> dict[int, int]:
    """Pushes per slot in one BSP round from the ledger's change: slot s moved by -lr * c_s / sum(c)."""
    ratios = {s: -c / LR for s, c in moved.items()}
    ratios = {s: r for s, r in ratios.items() if r > 1e-4}  # float residue of earlier rounds is far smaller
    if not ratios:
        return {}
    total = round(1 / min(ratios.values()))  # the smallest move is one push: 1 / sum(c)
    return {s: round(r * total) for s, r in ratios.items()}


def measure(workdir: Path, n: int, shards: int, codec: str, sync: str, rounds: int, numel: int,
            per_process: int, keep_evidence: bool = False, framework: str = "torch", settle_s: float = 0.0) -> dict:
    """One configuration's figures (module docstring) and its lost/double/agree check (with
    ``keep_evidence``, also what the check read, under ``"evidence"``). ``settle_s``: seconds
    between the last join and the warm-up round (a running job's steady state: the gRPC channels
    the joins used close once idle, `IDLE_CHANNEL_MS`)."""
    fleet = Fleet(workdir, n, shards, codec, sync, numel, per_process, framework=framework)
    try:
        started = time.perf_counter()
        for g in range(len(fleet.groups)):
            fleet.start(g)
        fleet.all({"op": "start"}, groups=[0])  # group 0 holds the initialiser
        fleet.all({"op": "start"}, groups=range(1, len(fleet.groups)))
        setup_s = time.perf_counter() - started
        time.sleep(settle_s)
        fleet.all({"op": "round"})  # warm-up
        cpu0, times, moved, threads = fleet.shard_cpu_s(), [], 0, 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            answers = fleet.all({"op": "round"})
            times.append(time.perf_counter() - t0)
            moved += sum(a["bytes"] for a in answers)
            threads = max(threads, fleet.shard_threads())
        cpu = (fleet.shard_cpu_s() - cpu0) / rounds
        rss = fleet.shard_rss_kib()
        evidence = fleet.evidence(fleet.all({"op": "final"}))
        result = check(evidence)
        if keep_evidence:
            result["evidence"] = evidence
        return {"n": n, "shards": shards, "codec": codec, "sync": sync, "rounds": rounds,
                "round_p50_s": round(float(np.percentile(times, 50)), 4),
                "round_p99_s": round(float(np.percentile(times, 99)), 4),
                "shard_cpu_s_per_round": round(cpu, 4), "shard_rss_kib": rss, "shard_threads": threads,
                "bytes_per_worker": int(moved / rounds / n), "setup_s": round(setup_s, 2),
                "client_processes": len(fleet.groups), **result}
    finally:
        fleet.close()


def churn_run(workdir: Path, n: int, duration_s: float, numel: int, per_process: int,
              rate_per_min: float = 0.1, framework: str = "torch", keep_evidence: bool = False) -> dict:
    """BSP, top-k, 2 shards: ``rate_per_min`` of the membership changes per minute (leave, rejoin,
    SIGKILL of a client process mid-round, its restart), in that order, evenly spaced."""
    fleet = Fleet(workdir, n, 2, "topk", "bsp", numel, per_process, churn=True, framework=framework)
    rng = random.Random(5)
    events: list[dict] = []
    try:
        for g in range(len(fleet.groups)):
            fleet.start(g)
        fleet.all({"op": "start"}, groups=[0])
        fleet.all({"op": "start"}, groups=range(1, len(fleet.groups)))
        killed = len(fleet.groups) - 1
        per_event = len(fleet.groups[killed])
        every_s = 60.0 * per_event / (rate_per_min * n)  # worker changes per event / changes per minute
        cycle = ["leave", "rejoin", "kill", "restart"]
        left: list[tuple[int, str]] = []
        started = time.monotonic()
        next_event, rounds = started + every_s, 0
        while time.monotonic() - started < duration_s:
            kind = cycle[len(events) % len(cycle)] if time.monotonic() >= next_event else None
            if kind == "kill":
                groups = [g for g in range(len(fleet.groups)) if fleet.procs[g]]
                before = fleet.versions()
                for g in groups:
                    fleet.send(g, {"op": "round"})
                time.sleep(rng.uniform(0.0, 0.2))  # mid-round: some pushes in flight
                fleet.kill(killed, before)
                for g in groups:
                    if g != killed:
                        a = fleet.answer(g)
                        for w, entries in a.get("accepted", {}).items():
                            fleet.accepted[w].extend(entries)
                fleet.settle()
            else:
                if kind == "leave":
                    g = 0  # the observer (its first worker) stays
                    candidates = [w for w, _, _ in fleet.groups[g][1:]]
                    picked = rng.sample(candidates, min(per_event, len(candidates)))
                    fleet.all({"op": "leave", "ids": picked}, groups=[g])
                    left = [(g, w) for w in picked]
                elif kind == "rejoin":
                    for g in {g for g, _ in left}:
                        fleet.all({"op": "rejoin", "ids": [w for gg, w in left if gg == g]}, groups=[g])
                    left = []
                elif kind == "restart":
                    fleet.start(killed)
                    fleet.all({"op": "start"}, groups=[killed])
                fleet.all({"op": "round"})
            rounds += 1
            if kind:
                events.append({"kind": kind, "at_s": round(time.monotonic() - started, 2), "workers": per_event})
                next_event += every_s
        elapsed = time.monotonic() - started
        evidence = fleet.evidence(fleet.all({"op": "final"}))
        result = check(evidence)
        if keep_evidence:
            result["evidence"] = evidence
        changes = sum(e["workers"] for e in events)
        return {"n": n, "shards": 2, "rounds": rounds, "seconds": round(elapsed, 1), "events": events,
                "membership_change_per_min": round(changes / n / (elapsed / 60), 3), **result}
    finally:
        fleet.close()


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 10 50, S = 2, top-k, bsp, 2 rounds, 20 s of churn at N = 50")
    ap.add_argument("--n", type=int, nargs="*", default=None, help="worker counts (default 10 100 1000)")
    ap.add_argument("--shards", type=int, nargs="*", default=None, help="shard counts (default 1 2 4 8)")
    ap.add_argument("--codecs", nargs="*", default=None, choices=["topk", "none"],
                    help="top-k 1%% + EF, dense none (default both; dense only for N <= 100)")
    ap.add_argument("--sync", nargs="*", default=None, choices=["bsp", "asp"], help="default both")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration (default 5)")
    ap.add_argument("--numel", type=int, default=1_000_000, help="model parameters (float32)")
    ap.add_argument("--clients-per-process", type=int, default=125)
    ap.add_argument("--asp-topk-max-n", type=int, default=100,
                    help="largest N for top-k under ASP (default 100: every push re-encodes the downlink delta "
                         "and a pull sends up to 64 of them, so a round costs O(N^2) here)")
    ap.add_argument("--no-churn", action="store_true", help="skip the churn run")
    ap.add_argument("--settle", type=float, default=None,
                    help="seconds between the last join and the warm-up round, so that the joins' gRPC channels "
                         "have closed as a running job's have (default: the channels' idle timeout + 1 s)")
    ap.add_argument("--churn-n", type=int, default=None, help="workers in the churn run (default 100)")
    ap.add_argument("--churn-s", type=float, default=None, help="length of the churn run (default 60 s)")
    ap.add_argument("--churn-rate", type=float, default=0.1,
                    help="fraction of the membership that changes per minute (default 0.1; --quick: 0.6, "
                         "so a 20 s run sees each kind of event)")
    args = ap.parse_args()
    ns = args.n or ([10, 50] if args.quick else [10, 100, 1000])
    shard_counts = args.shards or ([2] if args.quick else [1, 2, 4, 8])
    codecs = args.codecs or (["topk"] if args.quick else ["topk", "none"])
    syncs = args.sync or (["bsp"] if args.quick else ["bsp", "asp"])
    rounds = args.rounds or (2 if args.quick else 5)
    from hybridfleet.ps.wire.bulk import IDLE_CHANNEL_MS

    settle_s = IDLE_CHANNEL_MS / 1000 + 1.0 if args.settle is None else args.settle
    from hybridfleet.obs.log import configure

    configure(level="error")
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-scale-"))
    configs = []
    for codec in codecs:
        for sync in syncs:
            for s in shard_counts:
                for n in ns:
                    if codec == "none" and n > 100:
                        continue  # dense at N > 100 is not swept (4 MB per worker per direction)
                    if codec == "topk" and sync == "asp" and n > args.asp_topk_max_n:
                        print(f"  N={n} S={s} topk asp: skipped (above --asp-topk-max-n {args.asp_topk_max_n})",
                              file=sys.stderr)
                        continue
                    r = measure(workdir, n, s, codec, sync, rounds, args.numel, args.clients_per_process,
                                settle_s=settle_s)
                    configs.append(r)
                    print(f"  N={n} S={s} {codec} {sync}: p50 {r['round_p50_s']}s p99 {r['round_p99_s']}s "
                          f"cpu/round {r['shard_cpu_s_per_round']}s rss {r['shard_rss_kib']} KiB threads {r.get('shard_threads')} "
                          f"bytes/worker {r['bytes_per_worker']} lost {r['lost_pushes']} "
                          f"double {r['double_applied']} agree {r['workers_agree']}", file=sys.stderr, flush=True)
    groups: dict[tuple, list[dict]] = {}
    for r in configs:
        groups.setdefault((r["shards"], r["codec"], r["sync"]), []).append(r)
    slopes = {}
    for (s, codec, sync), rs in groups.items():
        if len({r["n"] for r in rs}) >= 2:
            xs = [r["n"] for r in rs]
            slopes[f"S{s}-{codec}-{sync}"] = {
                "per_worker_round_us": round(slope(xs, [r["round_p50_s"] * 1e6 for r in rs]), 1),
                "per_worker_rss_kib": round(slope(xs, [r["shard_rss_kib"] for r in rs]), 2),
                "per_worker_rss_kib_per_shard": round(slope(xs, [r["shard_rss_kib"] for r in rs]) / s, 2),
                "per_worker_cpu_us": round(slope(xs, [r["shard_cpu_s_per_round"] * 1e6 for r in rs]), 1),
                "per_worker_bytes": round(slope(xs, [r["bytes_per_worker"] for r in rs]), 1)}
    ref = slopes.get("S4-topk-bsp") or next(iter(slopes.values()), {})
    churn = None
    if not args.no_churn:
        rate = 0.6 if args.quick and args.churn_rate == 0.1 else args.churn_rate
        churn = churn_run(workdir, args.churn_n or (50 if args.quick else 100), args.churn_s or (20 if args.quick else 60),
                          args.numel, args.clients_per_process, rate)
        print(f"  churn: {churn['events']} lost {churn['lost_pushes']} double {churn['double_applied']} "
              f"agree {churn['workers_agree']}", file=sys.stderr)
    print(f"\n{'N':>5}{'S':>3}{'codec':>6}{'sync':>5}{'p50 s':>9}{'p99 s':>9}{'cpu s/rnd':>11}{'rss MiB':>9}"
          f"{'KB/worker':>11}{'lost':>6}{'dbl':>5}{'agree':>7}")
    for r in configs:
        print(f"{r['n']:>5}{r['shards']:>3}{r['codec']:>6}{r['sync']:>5}{r['round_p50_s']:>9.3f}{r['round_p99_s']:>9.3f}"
              f"{r['shard_cpu_s_per_round']:>11.3f}{r['shard_rss_kib'] / 1024:>9.1f}{r['bytes_per_worker'] / 1e3:>11.1f}"
              f"{r['lost_pushes']:>6}{r['double_applied']:>5}{str(r['workers_agree']):>7}")
    for name, sl in slopes.items():
        print(f"slope {name}: {sl}")
    runs = configs + ([churn] if churn else [])
    n1000 = [r for r in configs if r["n"] == 1000 and r["codec"] == "topk" and r["sync"] == "bsp"]
    n1000 = [r for r in n1000 if r["shards"] == 4] or n1000
    print(json.dumps({
        "bench": "scale", "parameters": args.numel,
        "per_worker_round_us": ref.get("per_worker_round_us"), "per_worker_rss_kib": ref.get("per_worker_rss_kib"),
        "per_worker_rss_kib_per_shard": ref.get("per_worker_rss_kib_per_shard"),
        "per_worker_cpu_us": ref.get("per_worker_cpu_us"),
        "round_p99_s_n1000": n1000[0]["round_p99_s"] if n1000 else None,
        "lost_pushes": sum(r["lost_pushes"] for r in runs), "double_applied": sum(r["double_applied"] for r in runs),
        "workers_agree": all(r["workers_agree"] for r in runs), "slopes": slopes, "churn": churn,
        "configs": configs}))


if __name__ == "__main__":
    main()
