"""Where a shard's memory per worker goes: tracemalloc and /proc of real shards as workers join.

    python bench/shard_memory.py                       # 2 shards, workers join 20 at a time up to 80
    python bench/shard_memory.py --frames 10           # and tracemalloc's Python bytes, by traceback
    python bench/shard_memory.py --connections 60      # bytes per idle connection: bulk plane, gRPC

The fleet is bench/scale.py's (real TLS + token shards, real `PSClient`s with their own tokens
and connections, top-k 1% + EF, BSP), except that each shard runs bench/_traced_shard.py, which
serves exactly as `hfleet ps serve` does and answers memory questions on stdin. Workers join
``--step`` at a time (one client process each); after each group joined, ``--rounds`` rounds
ran and ``--settle`` seconds passed (a running job's steady state: a worker's gRPC channel,
idle once its heartbeats go by the bulk plane, closes after `IDLE_CHANNEL_MS`), every shard reports its RSS, smaps_rollup, glibc heap (in use / free) and, with ``--frames``
> 0, its traced Python bytes (tracing slows the shards several times, and its snapshots inflate
their free heap: read the heap figures of a run without it). Printed per worker (slope over the
stages, per shard): each of those, and the tracemalloc tracebacks whose bytes grew most between
the first and last stage.
The JSON last line carries the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale  # noqa: E402
from hybridfleet.ps.wire.bulk import IDLE_CHANNEL_MS  # noqa: E402
from _shards import REPO  # noqa: E402

FRAMES = {"value": 0}
FIRST_ROUND = {"workers": 0}  # the first stage's workers: its BSP round must not wait for the later stages


def traced_shards(job: Path, count: int, workdir: Path, *, expected_workers: int, certs: Path | None = None,
                  timeout_s: float = 60.0):
    """bench/_shards.serve_shards's contract, with bench/_traced_shard.py processes."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("HFLEET_METRICS_PORT", None)
    files = [workdir / f"{job.stem}-traced-{i}.port" for i in range(count)]
    procs = [subprocess.Popen([sys.executable, str(REPO / "bench" / "_traced_shard.py"), str(job), str(i),
                               str(files[i]), str(certs), str(FIRST_ROUND["workers"] or expected_workers),
                               str(FRAMES["value"])],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(count)]
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() and f.read_text().endswith("\n") for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise RuntimeError(f"traced shards of {job} did not start")
        time.sleep(0.05)
    return procs, [f.read_text().strip() for f in files]


def ask(proc: subprocess.Popen, dump: str = "") -> dict:
    proc.stdin.write(dump + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def slope(xs, ys) -> float:
    return scale.slope(list(xs), list(ys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=20, help="workers that join per stage (one client process)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=2, help="BSP rounds after each stage's joins")
    ap.add_argument("--codec", default="topk")
    ap.add_argument("--settle", type=float, default=IDLE_CHANNEL_MS / 1000 + 2.0,
                    help="seconds to wait after each stage's rounds before the shards report (0: at once)")
    ap.add_argument("--frames", type=int, default=0, help="tracemalloc frames per trace (0: off)")
    ap.add_argument("--top", type=int, default=12, help="tracebacks shown")
    ap.add_argument("--connections", type=int, default=0,
                    help="instead: open this many idle TLS connections of each kind to one shard and report each "
                         "kind's bytes per connection")
    args = ap.parse_args()
    FRAMES["value"] = args.frames
    FIRST_ROUND["workers"] = args.step
    scale.serve_shards = traced_shards
    if args.connections:
        return per_connection(args.connections, args.numel)
    n = args.step * args.stages
    with tempfile.TemporaryDirectory(prefix="hf-shard-mem-") as tmp:
        workdir = Path(tmp)
        fleet = scale.Fleet(workdir, n, args.shards, args.codec, "bsp", args.numel, args.step)
        try:
            stages = []
            for g in range(args.stages):
                t0 = time.perf_counter()
                fleet.start(g)
                fleet.all({"op": "start"}, groups=[g])
                t1 = time.perf_counter()
                for _ in range(args.rounds):
                    fleet.all({"op": "round"})
                print(f"stage {g}: joins {t1 - t0:.1f} s, rounds {time.perf_counter() - t1:.1f} s", file=sys.stderr)
                time.sleep(args.settle)
                dumps = [str(workdir / f"snap-{g}-{j}.bin") if args.frames else "" for j in range(args.shards)]
                stages.append({"n": args.step * (g + 1),
                               "shards": [ask(p, d) for p, d in zip(fleet.shards, dumps)], "dumps": dumps})
            top = []
            if args.frames:
                diffs = {}
                for j in range(args.shards):
                    first = tracemalloc.Snapshot.load(stages[0]["dumps"][j])
                    last = tracemalloc.Snapshot.load(stages[-1]["dumps"][j])
                    for stat in last.compare_to(first, "traceback"):
                        key = tuple(f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback)
                        diffs[key] = diffs.get(key, 0) + stat.size_diff
                added = n - args.step
                for key, size in sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
                    top.append({"bytes_per_worker_per_shard": round(size / added / args.shards),
                                "traceback": list(key)})
        finally:
            fleet.close()
    xs = [s["n"] for s in stages]

    def per_worker(get) -> float:
        """KiB per worker, per shard (the mean over shards of each shard's slope)."""
        return round(sum(slope(xs, [get(s["shards"][j]) for s in stages]) for j in range(args.shards))
                     / args.shards, 2)

    figures = {"rss_kib": per_worker(lambda r: r["proc"]["VmRSS"]),
               "anonymous_kib": per_worker(lambda r: r["proc"]["Anonymous"]),
               "heap_in_use_kib": per_worker(lambda r: r["malloc"]["in_use"] / 1024),
               "heap_free_kib": per_worker(lambda r: r["malloc"]["free"] / 1024),
               "threads": per_worker(lambda r: r["proc"]["Threads"])}
    if args.frames:
        figures["python_traced_kib"] = per_worker(lambda r: r["traced"] / 1024)
    print(f"per worker per shard over N = {xs} ({args.shards} shards, {args.codec}, {args.numel} params):")
    for k, v in figures.items():
        print(f"  {k:20s} {v:10.2f}")
    for row in top:
        print(f"  {row['bytes_per_worker_per_shard']:>9,} B  " + " <- ".join(reversed(row["traceback"][-4:])))
    print(json.dumps({"bench": "shard_memory", "n": xs, "shards": args.shards, "numel": args.numel,
                      "codec": args.codec, "per_worker_per_shard": figures, "top_tracebacks": top,
                      "stages": [{"n": s["n"], "shards": s["shards"]} for s in stages]}))


def per_connection(k: int, numel: int) -> None:
    """One shard, no worker joined: its memory before and after ``k`` bulk-plane TLS connections
    (each past its HELLO with its own worker token), then ``k`` gRPC TLS connections (each its own
    channel credentials, so its own connection, one Status call each)."""
    from hybridfleet.ps.worker.bulk_channel import BulkChannel
    from hybridfleet.ps.worker.client import ClientSecurity
    from hybridfleet.ps.worker.status import ShardStatusProbe

    FRAMES["value"] = 0
    with tempfile.TemporaryDirectory(prefix="hf-shard-conn-") as tmp:
        fleet = scale.Fleet(Path(tmp), k, 1, "topk", "bsp", numel, k)
        shard, cfg = fleet.shards[0], fleet.base_cfg
        host, port = cfg["servers"][0].rsplit(":", 1)
        try:
            rows = [("none", ask(shard))]
            bulk_port = rows[0][1]["bulk_port"]
            bulks = []
            for wid in fleet.ids:
                sec = ClientSecurity.from_files(cfg["ca"], token=cfg["tokens"][wid])
                chan = BulkChannel(host, int(bulk_port), sec.ssl_context, None, cfg["tokens"][wid])
                bulks.append(chan._connect())
            rows.append(("bulk", ask(shard)))
            probes = [ShardStatusProbe(cfg["servers"][0], Path(cfg["certs"]), cfg["admin_token"]) for _ in range(k)]
            for p in probes:
                p.status(timeout_s=30)
            rows.append(("grpc", ask(shard)))
            for p in probes:
                p.close()
            for s in bulks:
                s.close()
        finally:
            fleet.close()
    out = {}
    for (_, a), (name, b) in zip(rows, rows[1:]):
        out[name] = {"rss_kib": round((b["proc"]["VmRSS"] - a["proc"]["VmRSS"]) / k, 1),
                     "heap_in_use_kib": round((b["malloc"]["in_use"] - a["malloc"]["in_use"]) / 1024 / k, 1),
                     "heap_free_kib": round((b["malloc"]["free"] - a["malloc"]["free"]) / 1024 / k, 1)}
        print(f"  {name}: {out[name]} per connection ({k} connections)")
    print(json.dumps({"bench": "shard_memory_connections", "connections": k, "per_connection": out}))


if __name__ == "__main__":
    main()
