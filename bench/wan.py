"""Time to accuracy over a rate-capped WAN link: dense vs top-k 1% + EF with site aggregation.

    sudo python bench/wan.py                          # torch, 20 Mbit/s, target 0.93
    sudo python bench/wan.py --framework paddle
    sudo python bench/wan.py --quick                  # 100 Mbit/s, target 0.85, about 2 minutes
    sudo python bench/wan.py --rate-mbit 50

The hospital site's 2 workers run in their own network namespace (``hf-hosp``),
joined to the host by a veth pair whose egress is capped both ways with
``tc qdisc tbf`` (see ``_wan_net.py``); the shards bind the host end
(10.231.0.1), which the cloud site's 2 workers reach without the cap. The cap
is checked first with a raw TCP transfer each way across the link.

Both runs train the digits job of ``compression.py`` (2048,512 MLP, 1.19M
parameters, server-side SGD lr 0.3, same seeds). Dense: ``codec: none``, every worker
pushes and pulls on its own. Compressed: ``codec: topk``, ratio 0.01, error
feedback, compressed downlink, and ``aggregate: true`` on both sites, so one
leader per site talks to the shards.

Time to target = the ``elapsed_s`` of the first metrics record (any worker)
whose ``test_accuracy`` reaches the target; ``elapsed_s`` counts from the
worker's session start (after imports, before joining the shards). A run is
stopped once the target is reached. speedup = dense_s / compressed_s.

Needs root; without it (or when ``ip netns`` fails) it prints
``{"bench": "wan", "skipped": reason}`` and exits 0. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _wan_net  # noqa: E402
from compression import ENTRYPOINTS, digits_job, fail, num_parameters, quiet_parent_logs, run_job  # noqa: E402

CAP_TOLERANCE = (0.5, 1.2)  # measured / set rate outside this range means the cap does not hold
DENSE = {"codec": "none"}
COMPRESSED = {"codec": "topk", "ratio": 0.01, "error_feedback": True}


def first_reaching(metrics_path: Path, target: float) -> dict | None:
    """The first metrics record (by ``elapsed_s``) whose test_accuracy is >= target, or None."""
    if not metrics_path.exists():
        return None
    hits = []
    for line in metrics_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        acc = rec.get("test_accuracy")
        if acc is not None and acc >= target and "elapsed_s" in rec:
            hits.append(rec)
    return min(hits, key=lambda r: r["elapsed_s"]) if hits else None


class StopAtTarget:
    """`run_ps_job` ``on_started`` hook: stops the job's processes once a worker reports the target accuracy."""

    def __init__(self, target: float, poll_s: float = 0.25):
        self.target = target
        self.poll_s = poll_s
        self.stopped_early = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, supervisor, layout) -> None:
        self._thread = threading.Thread(target=self._watch, args=(supervisor, layout.run_dir / "metrics.jsonl"),
                                        daemon=True)
        self._thread.start()

    def _watch(self, supervisor, metrics_path: Path) -> None:
        while not self._done.wait(self.poll_s):
            if first_reaching(metrics_path, self.target) is not None:
                self.stopped_early = True
                supervisor.stop(grace_s=2.0)
                return

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def run_variant(name: str, args, steps: int, compression: dict, aggregate: bool, workdir: Path) -> dict:
    """One job over the link; its time to target, wall time and run dir."""
    job = digits_job(f"wan-{name}", args.framework, steps, compression, eval_every_steps=args.eval_every,
                     host=_wan_net.HOST_ADDR, aggregate=aggregate, hospital_netns=_wan_net.NAMESPACE)
    hook = StopAtTarget(args.target)
    started = time.monotonic()
    try:
        summary = run_job(job, workdir, on_started=hook)
    except Exception:
        print(f"{name} run raised; kept: {workdir}", file=sys.stderr)
        raise
    finally:
        hook.close()
    wall_s = time.monotonic() - started
    hit = first_reaching(Path(summary["run_dir"]) / "metrics.jsonl", args.target)
    if hit is None and summary["status"] != "completed":
        fail(f"{name} run ended {summary['status']} before reaching {args.target}", [summary["run_dir"]], workdir)
    return {"time_s": None if hit is None else hit["elapsed_s"], "step": None if hit is None else hit["step"],
            "final_acc": summary["test_accuracy"], "wall_s": wall_s, "stopped_early": hook.stopped_early,
            "run_dir": summary["run_dir"]}


def skip(reason: str) -> None:
    print(f"skipped: {reason}")
    print(json.dumps({"bench": "wan", "skipped": reason}))
    sys.exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=sorted(ENTRYPOINTS), default="torch")
    ap.add_argument("--quick", action="store_true", help="100 Mbit/s, target 0.85, at most 60 steps")
    ap.add_argument("--rate-mbit", type=float, default=None, help="tbf rate each way (default 20; quick 100)")
    ap.add_argument("--target", type=float, default=None, help="test accuracy to reach (default 0.93; quick 0.85)")
    ap.add_argument("--steps", type=int, default=None, help="most steps per run (default 150; quick 60)")
    ap.add_argument("--eval-every", type=int, default=5, help="steps between accuracy evaluations")
    args = ap.parse_args()
    args.rate_mbit = args.rate_mbit if args.rate_mbit is not None else (100.0 if args.quick else 20.0)
    if args.rate_mbit <= 0:
        ap.error(f"--rate-mbit: must be > 0 (got {args.rate_mbit})")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps: must be >= 1 (got {args.steps})")
    if args.eval_every < 1:
        ap.error(f"--eval-every: must be >= 1 (got {args.eval_every})")
    args.target = args.target if args.target is not None else (0.85 if args.quick else 0.93)
    steps = args.steps or (60 if args.quick else 150)

    reason = _wan_net.unavailable_reason()
    if reason:
        skip(reason)
    link = _wan_net.WanLink(args.rate_mbit)
    try:
        link.setup()
    except _wan_net.WanUnavailable as err:
        skip(str(err))
    quiet_parent_logs("error")  # stopping a run at its target makes the supervisor warn about every exit
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-wan-"))
    try:
        probe_s = 1.5 if args.quick else 3.0
        up_mbit, down_mbit = link.measure_mbit("up", probe_s), link.measure_mbit("down", probe_s)
        print(f"link {_wan_net.NS_ADDR} <-> {_wan_net.HOST_ADDR}: tbf {args.rate_mbit:g} Mbit/s each way; "
              f"raw TCP measured up {up_mbit:.2f} Mbit/s, down {down_mbit:.2f} Mbit/s")
        low, high = (f * args.rate_mbit for f in CAP_TOLERANCE)
        if not (low <= up_mbit <= high and low <= down_mbit <= high):
            fail(f"the cap does not hold: measured {up_mbit:.2f} / {down_mbit:.2f} Mbit/s, "
                 f"expected {low:g}..{high:g}", [], workdir)
        dense = run_variant("dense", args, steps, DENSE, False, workdir)
        print(f"  dense: done in {dense['wall_s']:.1f} s", file=sys.stderr)
        compressed = run_variant("compressed", args, steps, COMPRESSED, True, workdir)
        print(f"  compressed: done in {compressed['wall_s']:.1f} s", file=sys.stderr)
    finally:
        link.teardown()

    print(f"\ndigits hybrid job, {args.framework}, {num_parameters():,} parameters; hospital (2 workers) behind "
          f"{args.rate_mbit:g} Mbit/s, cloud (2 workers) local; target test accuracy {args.target}")
    print(f"{'variant':<34}{'time to target s':>17}{'at step':>9}{'final acc':>11}{'wall s':>9}")
    labels = {"dense": "dense (none), per-worker push", "compressed": "top-k 1% + EF + site aggregation"}
    for name, r in (("dense", dense), ("compressed", compressed)):
        t = "not reached" if r["time_s"] is None else f"{r['time_s']:.1f}"
        step = "-" if r["step"] is None else str(r["step"])
        acc = "-" if r["final_acc"] is None or r["stopped_early"] else f"{r['final_acc']:.4f}"
        print(f"{labels[name]:<34}{t:>17}{step:>9}{acc:>11}{r['wall_s']:>9.1f}")
    print("(runs stop once the target is reached; final acc is shown only for runs that ran all steps)")
    if dense["time_s"] is None or compressed["time_s"] is None:
        missing = [n for n, r in (("dense", dense), ("compressed", compressed)) if r["time_s"] is None]
        fail(f"target {args.target} not reached within {steps} steps by: {', '.join(missing)}",
             [dense["run_dir"], compressed["run_dir"]], workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({
        "bench": "wan", "framework": args.framework, "rate_mbit": args.rate_mbit,
        "dense_s": dense["time_s"], "compressed_s": compressed["time_s"],
        "speedup": round(dense["time_s"] / compressed["time_s"], 3),
        "target": args.target, "measured_up_mbit": round(up_mbit, 2), "measured_down_mbit": round(down_mbit, 2),
    }))


if __name__ == "__main__":
    main()
