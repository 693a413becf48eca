"""Observability overhead: what metrics and event logging add to a training step, and scrape latency.

    OMP_NUM_THREADS=1 python bench/obs_overhead.py [--quick]

1. Step overhead. The demo job runs once (`hfleet run`, torch, no baselines) and its
   workers' own step-duration histograms give the mean step time. In the same run,
   the work the instrumentation adds to one step (`StepTimer` begin + 3 marks + end,
   as `PSSession.step` calls it, plus one metrics report per `eval_every_steps` steps
   with its TensorBoard scalars) is timed over many repetitions against the same step
   with that work off (nothing). overhead = added seconds per step / step seconds.
   Measuring the added work directly is deliberate: two whole demo runs on two shared
   cores differ by far more than 1% from run to run, which would hide what is measured.
   Side by side, an A/B in one process: a real `PSSession` (the worker's engine) steps
   the demo model's gradients through 2 real shards, in alternating blocks with the
   instrumentation on and replaced by a no-op, each block paired with its neighbour of the
   other mode (`ab_overhead`: median over the pairs of on / off - 1 for this ~1 ms step with
   no model compute; `ab_overhead_demo`: the pairs' median added seconds over the demo's
   step time; still noisy on shared cores, reported for comparison, the key is `overhead`).
2. Scrape latency. 16 processes each export a worker's and a shard's metric families
   (as the demo's processes do); every endpoint is scraped repeatedly, the p95 of one
   scrape is reported.

Prints a table, then one JSON line: {"bench": "obs_overhead", "overhead": ..., "scrape_p95_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from _shards import serve_shards, stop_shards  # noqa: E402

EXPORTER = r"""
import sys, time
from hybridfleet.obs.metrics import ProcessMetrics, ShardMetrics, StepTimer, serve_metrics
m = ProcessMetrics()
t = StepTimer(m)
for _ in range(100):
    t.begin(); t.mark("encode"); t.mark("transfer"); t.mark("wait"); t.end(1 << 20)
m.report(100, {"loss": 0.1, "test_accuracy": 0.9})
m.group(ShardMetrics).rejected_pushes.labels("invalid_argument").inc()
server = serve_metrics(0, metrics=m)
print(server.server_port, flush=True)
time.sleep(600)
"""


def demo_step_seconds(tmp: Path, steps: int) -> tuple[float, int]:
    """Mean worker step time (s) of one demo run and the steps it ran, from the run's own metrics records."""
    data = yaml.safe_load((REPO / "examples" / "digits-hybrid.yaml").read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["train"].update(steps=steps, site_baselines=False)
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "hybridfleet", "run", str(job), "--quiet", "--run-root", str(tmp / "runs")],
                   check=True, env=env, cwd=REPO, capture_output=True)
    (run_dir,) = (tmp / "runs" / data["name"]).iterdir()
    finals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finals = [r for r in finals if r.get("final") and str(r.get("process", "")).startswith("worker-")]
    per_worker = [sum(r["phase_s"].values()) / max(r["step"], 1) for r in finals]
    return sum(per_worker) / len(per_worker), steps


def added_seconds_per_step(reps: int, report_every: int, tmp: Path) -> tuple[float, float]:
    """(instrumented, bare) seconds per step of the work the instrumentation adds, best of 5."""
    os.environ["HFLEET_SCALARS"] = "tensorboard"
    os.environ["HFLEET_SCALARS_DIR"] = str(tmp / "scalars")
    from hybridfleet.obs.metrics import StepTimer
    from hybridfleet.obs.scalars import record_report

    timer = StepTimer()

    def instrumented() -> None:
        for i in range(reps):
            timer.begin()
            timer.mark("encode")
            timer.mark("transfer")
            timer.mark("wait")
            timer.end(1 << 20)
            if i % report_every == 0:
                record_report(i, {"loss": 0.5, "test_accuracy": 0.9}, "torch")

    def bare() -> None:
        for i in range(reps):
            if i % report_every == 0:
                pass

    def best(fn) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) / reps

    return best(instrumented), best(bare)


class _NoTimer:
    """The instrumentation switched off: what `PSSession.step` calls, doing nothing."""

    def begin(self) -> None: ...
    def mark(self, phase: str) -> None: ...
    def end(self, raw_gradient_bytes: int = 0) -> None: ...
    def phase_totals(self) -> dict: return {}


def ab_step_seconds(tmp: Path, blocks: int, steps: int) -> tuple[float, float, float, float]:
    """Median seconds per `PSSession.step` with instrumentation (and a report every 50 steps) on and off,
    and over adjacent (on, off) block pairs the median of on / off - 1 and of on - off (seconds)."""
    import statistics

    import numpy as np

    from hybridfleet.obs.log import redirect_log
    from hybridfleet.ps.worker.session import PSSession, WorkerConfig
    from hybridfleet.spec import load_spec

    data = yaml.safe_load((REPO / "examples" / "digits-hybrid.yaml").read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["security"] = {"tls": "off", "tokens": "off"}
    job = tmp / "ab-job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))  # the hospital stays the first site: its worker initialises
    shards, addresses = serve_shards(job, 2, tmp, expected_workers=1)
    try:
        cfg = WorkerConfig(job=load_spec(job), site="hospital", servers=addresses)
        rng = np.random.default_rng(0)
        shapes = {"0.weight": (128, 64), "0.bias": (128,), "2.weight": (10, 128), "2.bias": (10,)}
        params = {k: rng.standard_normal(v).astype(np.float32) * 0.01 for k, v in shapes.items()}
        grads = {k: rng.standard_normal(v).astype(np.float32) * 1e-3 for k, v in shapes.items()}
        session = PSSession(shapes, cfg, "torch")
        with open(os.devnull, "w") as sink, redirect_log(sink):
            session.start(params)
            for _ in range(steps):  # warm-up: caches, allocator, first reports
                session.step(grads)
            session.report(loss=0.5)
            timers = {"on": session.timer, "off": _NoTimer()}
            times: dict[str, list[float]] = {"on": [], "off": []}
            for b in range(blocks):
                for mode in (("on", "off") if b % 2 == 0 else ("off", "on")):
                    session.timer = timers[mode]
                    start = time.perf_counter()
                    for i in range(steps):
                        session.step(grads)
                        if mode == "on" and i % 50 == 0:
                            session.report(loss=0.5)
                    times[mode].append((time.perf_counter() - start) / steps)
            session.close()
        # each block is paired with the other mode's block next to it in time, so drifts in the
        # machine's load cancel; the median of the pairs' ratios is the A/B figure
        ratios = [on / off for on, off in zip(times["on"], times["off"])]
        diffs = [on - off for on, off in zip(times["on"], times["off"])]
        return (statistics.median(times["on"]), statistics.median(times["off"]), statistics.median(ratios) - 1,
                statistics.median(diffs))
    finally:
        stop_shards(shards)


def scrape_p95(processes: int, rounds: int) -> tuple[float, float, int]:
    """(p50, p95) seconds of one scrape over ``processes`` exporting processes, and the bytes of one page."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", EXPORTER], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(processes)]
    try:
        ports = [int(p.stdout.readline()) for p in procs]
        times, size = [], 0
        for _ in range(rounds):
            for port in ports:
                start = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    size = len(resp.read())
                times.append(time.perf_counter() - start)
        times.sort()
        return times[len(times) // 2], times[int(0.95 * (len(times) - 1))], size
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short demo and fewer scrapes (< 1 min)")
    args = parser.parse_args()
    steps = 60 if args.quick else 300
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        step_s, _ = demo_step_seconds(tmp, steps)
        on_s, off_s = added_seconds_per_step(5000 if args.quick else 200000, 50, tmp)
        ab_on_s, ab_off_s, ab_overhead, ab_added = ab_step_seconds(tmp, 8 if args.quick else 60, 25 if args.quick else 50)
    p50, p95, size = scrape_p95(16, 5 if args.quick else 50)
    added = max(0.0, on_s - off_s)
    overhead = added / step_s
    print(f"{'':38s} {'value':>14s}")
    print(f"{'demo step time (mean, s)':38s} {step_s:14.6f}")
    print(f"{'instrumented step extras (s)':38s} {on_s:14.9f}")
    print(f"{'same loop, instrumentation off (s)':38s} {off_s:14.9f}")
    print(f"{'overhead (added / step)':38s} {overhead:14.6f}")
    print(f"{'A/B PSSession step, instrumented (s)':38s} {ab_on_s:14.6f}")
    print(f"{'A/B PSSession step, off (s)':38s} {ab_off_s:14.6f}")
    print(f"{'A/B overhead (median of paired blocks)':38s} {ab_overhead:14.4f}")
    print(f"{'A/B added s per step / demo step':38s} {ab_added / step_s:14.4f}")
    print(f"{'scrape p50, 16 processes (s)':38s} {p50:14.6f}")
    print(f"{'scrape p95, 16 processes (s)':38s} {p95:14.6f}")
    print(f"{'bytes per scrape page':38s} {size:14d}")
    print(json.dumps({"bench": "obs_overhead", "overhead": round(overhead, 6), "scrape_p95_s": round(p95, 6),
                      "step_s": round(step_s, 6), "added_s_per_step": round(added, 9), "scrape_p50_s": round(p50, 6),
                      "ab_overhead": round(ab_overhead, 4), "ab_added_s_per_step": round(ab_added, 9),
                      "ab_overhead_demo": round(ab_added / step_s, 5),
                      "processes": 16, "quick": args.quick}))


if __name__ == "__main__":
    main()
