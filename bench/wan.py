"""Time to accuracy over a rate-capped WAN link: dense BSP, top-k BSP, and local SGD / DiLoCo (dense, int8, int4).

    sudo python bench/wan.py                          # torch, 20 Mbit/s, target 0.93
    sudo python bench/wan.py --framework paddle
    sudo python bench/wan.py --quick                  # 100 Mbit/s, target 0.85, about 3 minutes
    sudo python bench/wan.py --rate-mbit 50

The hospital site's 2 workers run in their own network namespace (``hf-hosp``),
joined to the host by a veth pair whose egress is capped both ways with
``tc qdisc tbf`` (see ``_wan_net.py``); the shards bind the host end
(10.231.0.1), which the cloud site's 2 workers reach without the cap. The cap
is checked first with a raw TCP transfer each way across the link.

Every run trains the digits job of ``compression.py`` (2048,512 MLP, 1.19M
parameters, same seeds, same number of training steps per worker):

* dense BSP: ``codec: none``, server-side SGD lr 0.3, every worker pushes and pulls on its own;
* top-k BSP: ``codec: topk`` 1% + error feedback, compressed downlink, ``aggregate: true`` on both
  sites (one leader per site talks to the shards), server-side SGD lr 0.3;
* local dense / local + int8 / local + int4: ``sync: local`` (DiLoCo): each worker takes ``--local-steps``
  steps with the script's own Adam (lr ``--inner-lr``), then the sites' averaged pseudo-gradients (plain,
  or int8 / int4 with error feedback; the shards send the new parameters back through the same codec)
  go to the shards, which apply Nesterov SGD (lr 0.7, momentum 0.9); site aggregation on both sites.

In every variant the cloud site's first worker initialises the shards (``ps.init_site: cloud``), so the
initial values do not cross the capped link; the other workers hold the same initial values (same
seed) and pull nothing at join.

Time to target = the ``elapsed_s`` of the first metrics record (any worker) whose
``test_accuracy`` reaches the target; ``elapsed_s`` counts from the worker's session
start (after imports, before joining the shards). Local runs evaluate every outer
round, right after the new global parameters arrived, so only the global model is
scored, never a worker's half-way inner state. WAN bytes to target = the hospital
site's workers' bytes to and from the shards in their metrics records of the step that
reached the target: that is the traffic that crosses the capped link. The cloud site's
workers share the shards' network (as a cloud site does), so neither their exchanges
nor their initialisation of the shards touch the WAN; a site's internal averaging is
LAN traffic. ``link MB`` is the same check from below: what the link's own interface
counters (both directions; TLS, gRPC framing, TCP/IP headers and heartbeats included)
had counted by the time the last hospital worker wrote its record of that step.

BSP runs are stopped once the target is reached (dense BSP takes minutes at 20
Mbit/s); their final accuracy comes from the same job run again without the cap
(a BSP run's result does not depend on the link: same seeds, same rounds). With
``--quick`` nothing is stopped early and every final accuracy is from the capped run.
Local runs always run all steps over the capped link.

The local-mode keys use local + int4 (4-bit pseudo-gradients, the fewest bytes; local + int8 is
printed and its ``local_int8_*`` figures are in the JSON line too): speedup = dense BSP time /
top-k BSP time; local_speedup = dense BSP / local + int4; local_vs_topk = top-k BSP / local + int4;
local_bytes_reduction = 1 - local + int4 WAN bytes to target / dense BSP's; local_acc_drop = dense
BSP final accuracy - local + int4's; adam_acc_drop = local dense final - local + int8 final, and
adam_acc_drop_int4 the same against local + int4 (all train with Adam as the inner optimizer:
dense Adam against compressed Adam; int8 is the compression the Adam claim is made for, int4
is reported beside it).

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
INNER_LR = 0.002
CAPPED_SITE = "hospital"  # the site behind the link (digits_job's hospital_netns)
LOCAL_STEPS = 25
# name -> (label, compression, site aggregation, local mode)
VARIANTS = {
    "dense": ("dense BSP (none), per-worker push", {"codec": "none"}, False, False),
    "compressed": ("top-k BSP 1% + EF + site aggr.", {"codec": "topk", "ratio": 0.01, "error_feedback": True}, True,
                   False),
    "local": ("local (DiLoCo) dense + site aggr.", {"codec": "none"}, True, True),
    "local_int8": ("local (DiLoCo) int8 + EF + site aggr.", {"codec": "int8", "error_feedback": True}, True, True),
    "local_int4": ("local (DiLoCo) int4 + EF + site aggr.", {"codec": "int4", "error_feedback": True}, True, True),
}


def records(metrics_path: Path) -> list[dict]:
    """The metrics records written so far (a line being written right now is skipped)."""
    if not metrics_path.exists():
        return []
    out = []
    for line in metrics_path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def first_reaching(metrics_path: Path, target: float) -> dict | None:
    """The first metrics record (by ``elapsed_s``) whose test_accuracy is >= target, or None."""
    hits = [r for r in records(metrics_path)
            if r.get("test_accuracy") is not None and r["test_accuracy"] >= target and "elapsed_s" in r]
    return min(hits, key=lambda r: r["elapsed_s"]) if hits else None


def capped_records_at(metrics_path: Path, step: int) -> dict[str, dict]:
    """The capped site's workers' first metrics record of ``step``, by process."""
    per_process: dict[str, dict] = {}
    for r in records(metrics_path):
        if (r.get("step") == step and "sent" in r and r.get("site") == CAPPED_SITE
                and str(r.get("process", "")).startswith("worker-")):
            per_process.setdefault(r["process"], r)
    return per_process


def wan_bytes_at(metrics_path: Path, step: int) -> tuple[int, float | None]:
    """The capped site's workers' bytes to and from the shards as of their records of ``step``,
    and the wall-clock time the last of those records was written."""
    recs = capped_records_at(metrics_path, step).values()
    return sum(r["sent"] + r["received"] for r in recs), max((r["ts"] for r in recs), default=None)


class LinkSampler:
    """Samples the link's byte counters (wall-clock time, bytes) while a run goes on."""

    def __init__(self, link: _wan_net.WanLink, period_s: float = 0.05):
        self.link = link
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "LinkSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time(), self.link.link_bytes()))
            if self._done.wait(self.period_s):
                self.samples.append((time.time(), self.link.link_bytes()))
                return

    def bytes_by(self, ts: float) -> int | None:
        """Bytes across the link from the run's start up to the first sample at or after ``ts``."""
        if not self.samples:
            return None
        start = self.samples[0][1]
        for t, n in self.samples:
            if t >= ts:
                return n - start
        return None


class StopAtTarget:
    """`run_ps_job` ``on_started`` hook: stops the job's processes once a worker reports the target accuracy
    and every worker of the capped site has written its record of that step (its bytes to target)."""

    def __init__(self, target: float, capped_workers: int, poll_s: float = 0.25, wait_capped_s: float = 120.0):
        self.target = target
        self.capped_workers = capped_workers
        self.poll_s = poll_s
        self.wait_capped_s = wait_capped_s
        self.stopped_early = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, supervisor, layout) -> None:
        self._thread = threading.Thread(target=self._watch, args=(supervisor, layout.run_dir / "metrics.jsonl"),
                                        daemon=True)
        self._thread.start()

    def _watch(self, supervisor, metrics_path: Path) -> None:
        while not self._done.wait(self.poll_s):
            hit = first_reaching(metrics_path, self.target)
            if hit is not None:
                # the capped site's workers get the same round's parameters later, across the link
                deadline = time.monotonic() + self.wait_capped_s
                while (len(capped_records_at(metrics_path, hit["step"])) < self.capped_workers
                       and time.monotonic() < deadline and not self._done.wait(self.poll_s)):
                    pass
                self.stopped_early = True
                supervisor.stop(grace_s=2.0)
                return

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def variant_job(name: str, args, steps: int, capped: bool = True) -> dict:
    _, compression, aggregate, local = VARIANTS[name]
    local_steps = min(args.local_steps, steps) if local else None
    return digits_job(f"wan-{name.replace('_', '-')}{'' if capped else '-uncapped'}", args.framework, steps,
                      compression, eval_every_steps=local_steps or args.eval_every, host=_wan_net.HOST_ADDR,
                      aggregate=aggregate, hospital_netns=_wan_net.NAMESPACE if capped else None,
                      local_steps=local_steps, inner_lr=args.inner_lr if local else None, init_site="cloud")


def run_variant(name: str, args, steps: int, workdir: Path, stop_early: bool, link: _wan_net.WanLink) -> dict:
    """One job over the link; its time, WAN and link bytes to target, final accuracy, wall time and run dir."""
    job = variant_job(name, args, steps)
    hook = StopAtTarget(args.target, job["sites"][CAPPED_SITE]["workers"]) if stop_early else None
    started = time.monotonic()
    try:
        with LinkSampler(link) as sampler:
            summary = run_job(job, workdir, on_started=hook)
    except Exception:
        print(f"{name} run raised; kept: {workdir}", file=sys.stderr)
        raise
    finally:
        if hook is not None:
            hook.close()
    wall_s = time.monotonic() - started
    metrics_path = Path(summary["run_dir"]) / "metrics.jsonl"
    hit = first_reaching(metrics_path, args.target)
    stopped = hook is not None and hook.stopped_early
    if hit is None and summary["status"] != "completed":
        fail(f"{name} run ended {summary['status']} before reaching {args.target}", [summary["run_dir"]], workdir)
    if not stopped and summary["status"] != "completed":
        fail(f"{name} run ended {summary['status']}", [summary["run_dir"]], workdir)
    wan_bytes, capped_ts = (None, None) if hit is None else wan_bytes_at(metrics_path, hit["step"])
    if hit is not None and capped_ts is None:
        fail(f"{name}: no {CAPPED_SITE} worker wrote a record of step {hit['step']}", [summary["run_dir"]], workdir)
    return {"time_s": None if hit is None else hit["elapsed_s"], "step": None if hit is None else hit["step"],
            "bytes": wan_bytes, "link_bytes": None if capped_ts is None else sampler.bytes_by(capped_ts),
            "final_acc": None if stopped else summary["test_accuracy"], "wall_s": wall_s, "stopped_early": stopped,
            "run_dir": summary["run_dir"]}


def final_acc_uncapped(name: str, args, steps: int, workdir: Path) -> float:
    """The final accuracy of the same BSP job run without the cap (its result does not depend on the link)."""
    summary = run_job(variant_job(name, args, steps, capped=False), workdir)
    if summary["status"] != "completed":
        fail(f"{name} (uncapped) run ended {summary['status']}", [summary["run_dir"]], workdir)
    return summary["test_accuracy"]


def skip(reason: str) -> None:
    print(f"skipped: {reason}")
    print(json.dumps({"bench": "wan", "skipped": reason}))
    sys.exit(0)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return None if a is None or not b else round(a / b, digits)


def ratio_drop(part: int | None, whole: int | None) -> float | None:
    return None if part is None or not whole else round(1 - part / whole, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=sorted(ENTRYPOINTS), default="torch")
    ap.add_argument("--quick", action="store_true", help="100 Mbit/s, target 0.85, at most 60 steps, nothing stopped")
    ap.add_argument("--rate-mbit", type=float, default=None, help="tbf rate each way (default 20; quick 100)")
    ap.add_argument("--target", type=float, default=None, help="test accuracy to reach (default 0.93; quick 0.85)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per worker and run (default 150; quick 60)")
    ap.add_argument("--eval-every", type=int, default=5, help="BSP: steps between accuracy evaluations")
    ap.add_argument("--local-steps", type=int, default=None,
                    help=f"local mode: inner steps per outer round (default {LOCAL_STEPS}; quick 10)")
    ap.add_argument("--inner-lr", type=float, default=INNER_LR, help="local mode: the inner Adam's learning rate")
    args = ap.parse_args()
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/wan.py", {"torch": "PyTorch", "sklearn": "scikit-learn", "pyarrow": "pyarrow"})
    args.rate_mbit = args.rate_mbit if args.rate_mbit is not None else (100.0 if args.quick else 20.0)
    if args.rate_mbit <= 0:
        ap.error(f"--rate-mbit: must be > 0 (got {args.rate_mbit})")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps: must be >= 1 (got {args.steps})")
    if args.eval_every < 1:
        ap.error(f"--eval-every: must be >= 1 (got {args.eval_every})")
    args.local_steps = args.local_steps if args.local_steps is not None else (10 if args.quick else LOCAL_STEPS)
    if args.local_steps < 1:
        ap.error(f"--local-steps: must be >= 1 (got {args.local_steps})")
    if args.inner_lr <= 0:
        ap.error(f"--inner-lr: must be > 0 (got {args.inner_lr})")
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
    results: dict[str, dict] = {}
    try:
        probe_s = 1.5 if args.quick else 3.0
        up_mbit, down_mbit = link.measure_mbit("up", probe_s), link.measure_mbit("down", probe_s)
        print(f"link {_wan_net.NS_ADDR} <-> {_wan_net.HOST_ADDR}: tbf {args.rate_mbit:g} Mbit/s each way; "
              f"raw TCP measured up {up_mbit:.2f} Mbit/s, down {down_mbit:.2f} Mbit/s")
        low, high = (f * args.rate_mbit for f in CAP_TOLERANCE)
        if not (low <= up_mbit <= high and low <= down_mbit <= high):
            fail(f"the cap does not hold: measured {up_mbit:.2f} / {down_mbit:.2f} Mbit/s, "
                 f"expected {low:g}..{high:g}", [], workdir)
        for name, (_, _, _, local) in VARIANTS.items():
            results[name] = run_variant(name, args, steps, workdir, stop_early=not local and not args.quick,
                                        link=link)
            print(f"  {name}: done in {results[name]['wall_s']:.1f} s", file=sys.stderr)
        for name, r in results.items():
            if r["final_acc"] is None:
                r["final_acc"] = final_acc_uncapped(name, args, steps, workdir)
                r["final_uncapped"] = True
    finally:
        link.teardown()

    print(f"\ndigits hybrid job, {args.framework}, {num_parameters():,} parameters; hospital (2 workers) behind "
          f"{args.rate_mbit:g} Mbit/s, cloud (2 workers) local; target test accuracy {args.target}; {steps} steps; "
          f"local: H={min(args.local_steps, steps)}, inner Adam lr {args.inner_lr:g}, outer Nesterov SGD lr 0.7; "
          f"shards initialised by the cloud site")
    print(f"{'variant':<40}{'time to target s':>17}{'at step':>9}{'WAN MB to target':>18}{'link MB':>9}"
          f"{'final acc':>11}{'wall s':>9}")
    for name, r in results.items():
        t = "not reached" if r["time_s"] is None else f"{r['time_s']:.1f}"
        step = "-" if r["step"] is None else str(r["step"])
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}"
        link_mb = "-" if r["link_bytes"] is None else f"{r['link_bytes'] / 1e6:.2f}"
        acc = f"{r['final_acc']:.4f}{'*' if r.get('final_uncapped') else ''}"
        print(f"{VARIANTS[name][0]:<40}{t:>17}{step:>9}{mb:>18}{link_mb:>9}{acc:>11}{r['wall_s']:>9.1f}")
    print("(* final accuracy of the same BSP job run to the end without the cap; its capped run stopped at the target)")
    missing = [n for n, r in results.items() if r["time_s"] is None]
    if missing:
        fail(f"target {args.target} not reached within {steps} steps by: {', '.join(missing)}",
             [r["run_dir"] for r in results.values()], workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    dense, topk, local, local_int8, local_int4 = (results[n] for n in VARIANTS)
    print(json.dumps({
        "bench": "wan", "framework": args.framework, "rate_mbit": args.rate_mbit,
        "dense_s": dense["time_s"], "compressed_s": topk["time_s"],
        "speedup": ratio(dense["time_s"], topk["time_s"]),
        "local_dense_s": local["time_s"], "local_int8_s": local_int8["time_s"], "local_int4_s": local_int4["time_s"],
        "local_speedup": ratio(dense["time_s"], local_int4["time_s"]),
        "local_vs_topk": ratio(topk["time_s"], local_int4["time_s"]),
        "local_int8_speedup": ratio(dense["time_s"], local_int8["time_s"]),
        "dense_bytes": dense["bytes"], "compressed_bytes": topk["bytes"], "local_dense_bytes": local["bytes"],
        "local_int8_bytes": local_int8["bytes"], "local_int4_bytes": local_int4["bytes"],
        "local_bytes_reduction": ratio_drop(local_int4["bytes"], dense["bytes"]),
        "local_int8_bytes_reduction": ratio_drop(local_int8["bytes"], dense["bytes"]),
        "dense_link_bytes": dense["link_bytes"], "compressed_link_bytes": topk["link_bytes"],
        "local_dense_link_bytes": local["link_bytes"], "local_int8_link_bytes": local_int8["link_bytes"],
        "local_int4_link_bytes": local_int4["link_bytes"],
        "local_link_bytes_reduction": ratio_drop(local_int4["link_bytes"], dense["link_bytes"]),
        "dense_acc": dense["final_acc"], "compressed_acc": topk["final_acc"], "local_dense_acc": local["final_acc"],
        "local_int8_acc": local_int8["final_acc"], "local_int4_acc": local_int4["final_acc"],
        "local_acc_drop": round(dense["final_acc"] - local_int4["final_acc"], 5),
        "adam_acc_drop": round(local["final_acc"] - local_int8["final_acc"], 5),
        "adam_acc_drop_int4": round(local["final_acc"] - local_int4["final_acc"], 5),
        "local_steps": min(args.local_steps, steps), "inner_lr": args.inner_lr, "steps": steps,
        "target": args.target, "measured_up_mbit": round(up_mbit, 2), "measured_down_mbit": round(down_mbit, 2),
    }))


if __name__ == "__main__":
    main()
