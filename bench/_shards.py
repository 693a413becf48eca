"""Shards for benchmarks, each in its own process as deployed: ``hfleet ps serve`` of a job file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve_shards(job: Path, count: int, workdir: Path, *, expected_workers: int, certs: Path | None = None,
                 timeout_s: float = 60.0) -> tuple[list[subprocess.Popen], list[str]]:
    """Start shards 0..count-1 of ``job`` (TLS + tokens from ``certs``, or plaintext without auth when None);
    return the processes and their addresses once every one serves. Stop them with `stop_shards`."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("HFLEET_METRICS_PORT", None)
    security = ["--certs", str(certs)] if certs is not None else ["--insecure-plaintext", "--no-auth"]
    files = [workdir / f"{job.stem}-shard-{i}.port" for i in range(count)]
    procs = [subprocess.Popen([sys.executable, "-m", "hybridfleet", "ps", "serve", str(job), "--shard", str(i),
                               "--port", "0", "--port-file", str(files[i]), "--expected-workers",
                               str(expected_workers), *security], env=env, stderr=subprocess.DEVNULL)
             for i in range(count)]
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop_shards(procs)
            raise RuntimeError(f"shards of {job} did not start")
        time.sleep(0.05)
    return procs, [f.read_text().strip() for f in files]


def stop_shards(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
