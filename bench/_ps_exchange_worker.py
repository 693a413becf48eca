"""One worker of bench/ps_exchange.py: timed dense push + pull rounds through the shard(s)."""

import json
import os
import resource
import sys
import time

import numpy as np
import torch  # noqa: F401  the job's framework: a real worker has it loaded, so "framework" counts it

from hybridfleet.ps.worker.session import PSSession, WorkerConfig, client_security_from_env
from hybridfleet.spec import load_spec
from _proc import cpu_s, status_field  # bench/ is sys.path[0] when a bench runs


def resident_bytes() -> int:
    """This process's resident set now (VmRSS), in bytes."""
    kib = status_field("VmRSS")
    if kib is None:
        raise RuntimeError("no VmRSS in /proc/self/status")
    return kib * 1024


def own_cpu_s() -> float:
    """User + system CPU-seconds of this process (all its threads) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def shard_cpu_s() -> float | None:
    """User + system CPU-seconds so far of the shard processes named by HFLEET_BENCH_SHARD_PIDS
    (read from /proc/PID/stat); None when the variable is not set."""
    pids = os.environ.get("HFLEET_BENCH_SHARD_PIDS")
    if not pids:
        return None
    return sum(cpu_s(int(pid)) for pid in pids.split(","))


def main() -> None:
    job, rank, rounds, numel, tensors = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    framework_rss = resident_bytes()  # torch, numpy and hybridfleet imported, no tensor yet
    spec = load_spec(job)
    site = list(spec.sites)[rank]
    config = WorkerConfig(job=spec, site=site, rank=rank, site_rank=0, servers=os.environ["HFLEET_SERVERS"].split(","),
                          security=client_security_from_env(dict(os.environ)))
    shapes = {f"layer{i}.weight": (numel // tensors,) for i in range(tensors)}
    rng = np.random.default_rng(rank)
    params = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    session = PSSession(shapes, config, "torch")
    params = session.start(params)  # train on the session's parameters, as a script does: its own values go
    # a script's gradients exist from its first backward on, after the session started
    grads = {k: rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3) for k, s in shapes.items()}
    times = []
    for i in range(rounds + 1):  # the first round warms up connections and buffers
        if i == 1:  # the timed rounds' CPU: this process's and (rank 0) the shards'
            cpu0, shard0 = own_cpu_s(), shard_cpu_s() if rank == 0 else None
        t0 = time.perf_counter()
        session.step(grads)
        times.append(time.perf_counter() - t0)
    cpu1, shard1 = own_cpu_s(), shard_cpu_s() if rank == 0 else None
    moved = session.bytes_moved()
    session.close()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"rank": rank, "round_s": times[1:], "sent": moved["sent"], "received": moved["received"],
                      "peak_rss_bytes": peak_rss, "framework_rss_bytes": framework_rss,
                      "rounds_cpu_s": cpu1 - cpu0 if rounds else 0.0,
                      "shard_rounds_cpu_s": None if not rounds or shard0 is None else shard1 - shard0}))


if __name__ == "__main__":
    main()
