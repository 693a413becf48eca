"""Time to target over a rate-capped WAN link: dense BSP (the fair anchor, with site aggregation, and the
per-worker row), top-k BSP, and local SGD / DiLoCo (dense, int8, int4, PowerSGD), on three workloads.

    sudo python bench/wan.py                          # digits, torch, 20 Mbit/s, target 0.93
    sudo python bench/wan.py --framework paddle
    sudo python bench/wan.py --quick                  # 100 Mbit/s, target 0.85, a few minutes on a quiet machine
    sudo python bench/wan.py --rate-mbit 50
    sudo python bench/wan.py --workload fashion --estimate-dense   # the examples' CNN; dense timed per step
    sudo python bench/wan.py --workload charlm --estimate-dense    # the character transformer, test_bpc
    sudo python bench/wan.py --quick --variants dense,local_int4   # the anchor and local + int4 only
    sudo python bench/wan.py --workload fashion --estimate-dense --variants dense,local_int4 \
        --local-steps 200 --outer-lr 1 --outer-momentum 0            # plain outer averaging, H = 200

The capped site's workers (digits: 2 per site; the examples' jobs: their own count, 1 per site)
run in their own network namespace (``hf-hosp``), joined to the host by a veth pair whose egress
is capped both ways with ``tc qdisc tbf`` (see ``_wan_net.py``); the shards bind the host end
(10.231.0.1), which the cloud site's workers reach without the cap. The cap is checked first
with a raw TCP transfer each way across the link. With one worker per site, site aggregation
changes nothing, so the per-worker row is the anchor's job again (``--variants`` can leave it out).

Workloads (``_wan_workloads.py``): ``digits`` trains the digits job of ``compression.py`` (2048,512 MLP,
1.19M parameters; sites hospital, behind the link, and cloud) and measures test accuracy; ``fashion``
and ``charlm`` train ``examples/<name>/train_<framework>.py`` with the job of
``examples/<name>-hybrid[-paddle].yaml`` (its first site behind the link, its second the cloud) and
measure ``test_accuracy`` (higher is better) and ``test_bpc`` (held-out bits per character, lower is
better); their site datasets are packed first with ``examples/<name>/pack_sites.py --out DIR`` when
missing. When a workload's script, job file or pack script is not in the checkout the bench prints
``{"bench": "wan", "skipped": reason}`` naming them and exits 0. Every variant runs the same job
(same seeds, same number of training steps per worker):

* dense BSP, the anchor: ``codec: none``, the job's server-side optimizer (digits: SGD lr 0.3), ``aggregate:
  true`` on both sites (one leader per site talks to the shards), like every variant below;
* dense BSP per worker: the same without site aggregation (every worker pushes and pulls on its own), the
  anchor these figures were once compared with, kept as a second row;
* top-k BSP: ``codec: topk`` 1% + error feedback, compressed downlink, site aggregation;
* local dense / local + int8 / local + int4 / local + PowerSGD: ``sync: local`` (DiLoCo): each worker takes
  ``--local-steps`` steps with the script's own optimizer (digits: Adam, lr ``--inner-lr``), then the sites'
  averaged pseudo-gradients (plain, or int8 / int4 / rank-``--rank`` PowerSGD factors with error feedback;
  the shards send the new parameters back through the same codec) go to the shards, which apply the outer
  step: Nesterov SGD (lr 0.7, momentum 0.9, DiLoCo's) unless ``--outer-lr`` / ``--outer-momentum`` say
  otherwise (``--outer-lr 1 --outer-momentum 0`` is plain averaging of the sites' models, FedAvg's outer
  step); site aggregation on both sites. The JSON line names the outer step (``outer_optimizer``).

In every variant the cloud site's first worker initialises the shards (``ps.init_site``), so the
initial values do not cross the capped link; the other workers hold the same initial values (same
seed) and pull nothing at join.

Time to target = the ``elapsed_s`` of the first metrics record (any worker) whose metric reaches the
target; ``elapsed_s`` counts from the worker's session start (after imports, before joining the
shards). Local runs evaluate every outer round, right after the new global parameters arrived, so
only the global model is scored, never a worker's half-way inner state. WAN bytes to target = the
capped site's workers' bytes to and from the shards in their metrics records of the step that
reached the target: that is the traffic that crosses the capped link. The cloud site's workers
share the shards' network (as a cloud site does), so neither their exchanges nor their
initialisation of the shards touch the WAN; a site's internal averaging is LAN traffic. ``link MB``
is the same check from below: what the link's own interface counters (both directions; TLS, gRPC
framing, TCP/IP headers and heartbeats included) had counted by the time the last capped-site
worker wrote its record of that step.

BSP runs are stopped once the target is reached; their final metric comes from the same job run
again without the cap (a BSP run's result does not depend on the link: same seeds, same rounds).
With ``--quick`` nothing is stopped early and every final metric is from the capped run. Local runs
always run all steps over the capped link. With ``--estimate-dense`` (for workloads whose dense
anchor would need an hour over the link) the two dense rows are not run to target over the link:
their steps to target and final metric come from the uncapped run, their step time is the median
over ``--timing-steps`` (>= 30) steps of a capped run (per window of ``--eval-every`` steps between
two metrics records of a capped-site worker, so a window's evaluation is counted in its steps), and
time to target = steps to target x that median step time; WAN bytes to target = the capped run's
bytes at its first record plus its measured bytes per step times the remaining steps (no link
counter figure). Both figures are in the output (``dense_steps_to_target``, ``dense_step_s``);
every other variant is timed end to end on the link.

Every ratio is against the fair anchor (dense BSP with site aggregation). The local-mode keys use
local + int4 (local + int8 and local + PowerSGD have their own ``local_int8_*`` / ``local_powersgd_*``
keys): speedup = dense time / top-k BSP time; local_speedup = dense / local + int4; local_vs_topk =
top-k BSP / local + int4; local_bytes_reduction = 1 - local + int4 WAN bytes to target / dense's;
local_acc_drop = how much worse local + int4's final metric is than dense's (``*_acc`` keys hold the
workload's metric: accuracy, or bits per character for charlm, where worse means higher);
adam_acc_drop = the same for local + int8 against local dense, and adam_acc_drop_int4 for local +
int4 against local dense (the inner optimizer of every local variant is the script's own). The
per-worker row's figures are under ``dense_per_worker_*``.

``--variants`` runs only the named variants (the anchor and local + int4, say); the JSON line keeps
every key, those of a variant not run (and every ratio that needs it) null, and ``variants`` names
the ones that ran.

Needs root; without it (or when ``ip netns`` fails) it prints
``{"bench": "wan", "skipped": reason}`` and exits 0. The last line is JSON. A variant that misses the
target within the job's steps is named in its ``not_reached`` list (its time, bytes and ratios null, its
final metric kept) and the bench then exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _wan_net  # noqa: E402
from _wan_workloads import REPO, WORKLOADS, Workload, ensure_packed, example_job, missing_files, site_names  # noqa: E402
from _wan_workloads import variant_from_example  # noqa: E402
from compression import ENTRYPOINTS, digits_job, fail, num_parameters, quiet_parent_logs, run_job  # noqa: E402

from hybridfleet.spec.rules import OUTER_OPTIMIZER_DEFAULT  # noqa: E402

CAP_TOLERANCE = (0.5, 1.2)  # measured / set rate outside this range means the cap does not hold
INNER_LR = 0.002
DIGITS_CAPPED_SITE = "hospital"  # the site behind the link (digits_job's hospital_netns)
DIGITS_SITE_WORKERS = 2  # digits_job's workers per site
LOCAL_STEPS = 25
OUTER_LR, OUTER_MOMENTUM = OUTER_OPTIMIZER_DEFAULT["lr"], OUTER_OPTIMIZER_DEFAULT["momentum"]  # DiLoCo's
MIN_TIMING_STEPS = 30
DENSE_ROWS = ("dense", "dense_per_worker")
# name -> (label, compression, site aggregation, local mode)
VARIANTS = {
    "dense": ("dense BSP (none) + site aggr. [anchor]", {"codec": "none"}, True, False),
    "dense_per_worker": ("dense BSP (none), per-worker push", {"codec": "none"}, False, False),
    "compressed": ("top-k BSP 1% + EF + site aggr.", {"codec": "topk", "ratio": 0.01, "error_feedback": True}, True,
                   False),
    "local": ("local (DiLoCo) dense + site aggr.", {"codec": "none"}, True, True),
    "local_int8": ("local (DiLoCo) int8 + EF + site aggr.", {"codec": "int8", "error_feedback": True}, True, True),
    "local_int4": ("local (DiLoCo) int4 + EF + site aggr.", {"codec": "int4", "error_feedback": True}, True, True),
    "local_powersgd": ("local (DiLoCo) PowerSGD + EF + site aggr.", {"codec": "powersgd", "error_feedback": True},
                       True, True),
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


def first_reaching(metrics_path: Path, target: float, workload: Workload) -> dict | None:
    """The first metrics record (by ``elapsed_s``) whose metric reaches the target, or None."""
    hits = [r for r in records(metrics_path)
            if workload.reached(r.get(workload.metric), target) and "elapsed_s" in r]
    return min(hits, key=lambda r: r["elapsed_s"]) if hits else None


def final_metric(summary: dict, metrics_path: Path, metric: str) -> float | None:
    """The metric of global rank 0's final report (the saved model's), else the run summary's."""
    for r in records(metrics_path):
        if r.get("final") and r.get("rank") == 0 and r.get(metric) is not None:
            return float(r[metric])
    return summary.get(metric)


def capped_records_at(metrics_path: Path, step: int, capped: str) -> dict[str, dict]:
    """The capped site's workers' first metrics record of ``step``, by process."""
    per_process: dict[str, dict] = {}
    for r in records(metrics_path):
        if (r.get("step") == step and "sent" in r and r.get("site") == capped
                and str(r.get("process", "")).startswith("worker-")):
            per_process.setdefault(r["process"], r)
    return per_process


def wan_bytes_at(metrics_path: Path, step: int, capped: str) -> tuple[int, float | None]:
    """The capped site's workers' bytes to and from the shards as of their records of ``step``,
    and the wall-clock time the last of those records was written."""
    recs = capped_records_at(metrics_path, step, capped).values()
    return sum(r["sent"] + r["received"] for r in recs), max((r["ts"] for r in recs), default=None)


def step_timing(metrics_path: Path, capped: str) -> tuple[float | None, int, float | None, int | None, int | None]:
    """From a capped run: (median seconds per step over the windows between consecutive records of each
    capped-site worker, steps those windows cover, bytes per step of the capped site, first step with
    a record, the capped site's bytes at that step)."""
    by_worker: dict[str, list[dict]] = {}
    for r in records(metrics_path):
        if (r.get("site") == capped and "sent" in r and "elapsed_s" in r and isinstance(r.get("step"), int)
                and str(r.get("process", "")).startswith("worker-") and not r.get("final")):
            by_worker.setdefault(r["process"], []).append(r)
    per_step, covered = [], 0
    for recs in by_worker.values():
        recs.sort(key=lambda r: r["step"])
        for a, b in zip(recs, recs[1:]):
            if b["step"] > a["step"]:
                per_step.append((b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]))
                covered = max(covered, b["step"] - recs[0]["step"])
    steps = sorted({r["step"] for recs in by_worker.values() for r in recs})
    if len(steps) < 2:
        return (None if not per_step else statistics.median(per_step)), covered, None, None, None
    first, last = steps[0], steps[-1]
    b_first, _ = wan_bytes_at(metrics_path, first, capped)
    b_last, _ = wan_bytes_at(metrics_path, last, capped)
    return statistics.median(per_step), covered, (b_last - b_first) / (last - first), first, b_first


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
    """`run_ps_job` ``on_started`` hook: stops the job's processes once a worker reports the target
    and every worker of the capped site has written its record of that step (its bytes to target)."""

    def __init__(self, target: float, workload: Workload, capped: str, capped_workers: int, poll_s: float = 0.25,
                 wait_capped_s: float = 120.0):
        self.target = target
        self.workload = workload
        self.capped = capped
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
            hit = first_reaching(metrics_path, self.target, self.workload)
            if hit is not None:
                # the capped site's workers get the same round's parameters later, across the link
                deadline = time.monotonic() + self.wait_capped_s
                while (len(capped_records_at(metrics_path, hit["step"], self.capped)) < self.capped_workers
                       and time.monotonic() < deadline and not self._done.wait(self.poll_s)):
                    pass
                self.stopped_early = True
                supervisor.stop(grace_s=2.0)
                return

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def variant_job(name: str, args, steps: int | None, capped: bool = True, eval_every: int | None = None) -> dict:
    """The job of variant ``name`` for ``args.workload`` (``capped``: the capped site in the namespace)."""
    _, compression, aggregate, local = VARIANTS[name]
    if compression["codec"] == "powersgd":
        compression = {**compression, "rank": args.rank}
    job_steps = steps if steps is not None else args.job_steps
    local_steps = min(args.local_steps, job_steps) if local else None
    eval_every = eval_every or local_steps or args.eval_every
    job_name = f"wan-{args.workload}-{name.replace('_', '-')}{'' if capped else '-uncapped'}"
    netns = _wan_net.NAMESPACE if capped else None
    outer = args.outer_optimizer if local else None
    if args.workload == "digits":
        return digits_job(job_name, args.framework, job_steps, compression, eval_every_steps=eval_every,
                          optimizer=outer, host=_wan_net.HOST_ADDR, aggregate=aggregate, hospital_netns=netns,
                          local_steps=local_steps, inner_lr=args.inner_lr if local else None, init_site="cloud")
    return variant_from_example(args.example_job, job_name, compression=compression, aggregate=aggregate,
                                local_steps=local_steps, eval_every_steps=eval_every, steps=steps,
                                host=_wan_net.HOST_ADDR, netns=netns, outer_optimizer=outer)


def run_variant(name: str, args, steps: int | None, workdir: Path, stop_early: bool, link: _wan_net.WanLink) -> dict:
    """One job over the link; its time, WAN and link bytes to target, final metric, wall time and run dir."""
    job = variant_job(name, args, steps)
    capped_workers = job["sites"][args.capped]["workers"]
    hook = StopAtTarget(args.target, args.wl, args.capped, capped_workers) if stop_early else None
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
    hit = first_reaching(metrics_path, args.target, args.wl)
    stopped = hook is not None and hook.stopped_early
    if hit is None and summary["status"] != "completed":
        fail(f"{name} run ended {summary['status']} before reaching {args.target}", [summary["run_dir"]], workdir)
    if not stopped and summary["status"] != "completed":
        fail(f"{name} run ended {summary['status']}", [summary["run_dir"]], workdir)
    wan_bytes, capped_ts = (None, None) if hit is None else wan_bytes_at(metrics_path, hit["step"], args.capped)
    if hit is not None and capped_ts is None:
        fail(f"{name}: no {args.capped} worker wrote a record of step {hit['step']}", [summary["run_dir"]], workdir)
    return {"time_s": None if hit is None else hit["elapsed_s"], "step": None if hit is None else hit["step"],
            "bytes": wan_bytes, "link_bytes": None if capped_ts is None else sampler.bytes_by(capped_ts),
            "final_acc": None if stopped else final_metric(summary, metrics_path, args.wl.metric), "wall_s": wall_s,
            "stopped_early": stopped, "run_dir": summary["run_dir"]}


def run_uncapped(name: str, args, steps: int | None, workdir: Path) -> tuple[dict | None, float | None, str]:
    """The same job run without the cap (a BSP run's result does not depend on the link): its first
    record reaching the target, its final metric and its run dir."""
    summary = run_job(variant_job(name, args, steps, capped=False), workdir)
    if summary["status"] != "completed":
        fail(f"{name} (uncapped) run ended {summary['status']}", [summary["run_dir"]], workdir)
    metrics_path = Path(summary["run_dir"]) / "metrics.jsonl"
    return (first_reaching(metrics_path, args.target, args.wl), final_metric(summary, metrics_path, args.wl.metric),
            summary["run_dir"])


def estimate_dense(name: str, args, steps: int | None, workdir: Path, link: _wan_net.WanLink) -> dict:
    """A dense row timed as (steps to target, uncapped) x (median step time over the capped link)."""
    started = time.monotonic()
    hit, final, run_dir = run_uncapped(name, args, steps, workdir)
    job = variant_job(name, args, args.timing_steps, eval_every=args.eval_every)
    summary = run_job(job, workdir)
    if summary["status"] != "completed":
        fail(f"{name} (timing, capped) run ended {summary['status']}", [summary["run_dir"]], workdir)
    step_s, covered, bytes_per_step, first, first_bytes = step_timing(Path(summary["run_dir"]) / "metrics.jsonl",
                                                                      args.capped)
    if step_s is None or covered < MIN_TIMING_STEPS - args.eval_every:
        fail(f"{name}: the capped timing run's records cover {covered} steps (at least "
             f"{MIN_TIMING_STEPS - args.eval_every} wanted)", [summary["run_dir"]], workdir)
    out = {"time_s": None, "step": None, "bytes": None, "link_bytes": None, "final_acc": final,
           "wall_s": time.monotonic() - started, "stopped_early": False, "run_dir": run_dir, "estimated": True,
           "step_s": round(step_s, 4), "timing_steps": covered, "final_uncapped": True}
    if hit is not None:
        out.update(step=hit["step"], time_s=round(hit["step"] * step_s, 2))
        if bytes_per_step is not None:
            out["bytes"] = int(first_bytes + bytes_per_step * (hit["step"] - first))
    return out


NOT_RUN = {"time_s": None, "step": None, "bytes": None, "link_bytes": None, "final_acc": None, "wall_s": None,
           "stopped_early": False, "run_dir": None}  # the figures of a variant --variants left out


def skip(reason: str) -> None:
    print(f"skipped: {reason}")
    print(json.dumps({"bench": "wan", "skipped": reason}))
    sys.exit(0)


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return None if a is None or not b else round(a / b, digits)


def ratio_drop(part: int | None, whole: int | None) -> float | None:
    return None if part is None or not whole else round(1 - part / whole, 5)


def outer_optimizer(lr: float, momentum: float) -> dict:
    """The shards' outer step in local mode: SGD at `lr`, Nesterov when `momentum` > 0."""
    return {"name": "sgd", "lr": lr, "momentum": momentum, "nesterov": momentum > 0}


def describe_outer(opt: dict) -> str:
    if opt["momentum"] == 0 and opt["lr"] == 1:
        return "outer plain averaging (SGD lr 1)"
    kind = f"Nesterov SGD lr {opt['lr']:g}, momentum {opt['momentum']:g}" if opt["nesterov"] else f"SGD lr {opt['lr']:g}"
    return f"outer {kind}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    ap.add_argument("--framework", choices=sorted(ENTRYPOINTS), default="torch")
    ap.add_argument("--quick", action="store_true", help="100 Mbit/s, the quick target, at most 60 steps, "
                                                         "nothing stopped")
    ap.add_argument("--rate-mbit", type=float, default=None, help="tbf rate each way (default 20; quick 100)")
    ap.add_argument("--target", type=float, default=None,
                    help="metric to reach (digits 0.93 / quick 0.85; fashion 0.90 / 0.75; charlm bpc 2.0 / 3.5)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per worker and run (digits 150, quick 60; examples: the job's own)")
    ap.add_argument("--eval-every", type=int, default=5, help="BSP: steps between metric evaluations")
    ap.add_argument("--local-steps", type=int, default=None,
                    help=f"local mode: inner steps per outer round (default {LOCAL_STEPS}; quick 10)")
    ap.add_argument("--inner-lr", type=float, default=INNER_LR, help="digits local mode: the inner Adam's learning rate")
    ap.add_argument("--outer-lr", type=float, default=OUTER_LR,
                    help=f"local mode: the shards' outer SGD learning rate (default {OUTER_LR}, DiLoCo's)")
    ap.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM,
                    help=f"local mode: the outer SGD's Nesterov momentum (default {OUTER_MOMENTUM}); 0 with "
                         "--outer-lr 1 averages the sites' models (FedAvg)")
    ap.add_argument("--rank", type=int, default=4, help="local + PowerSGD: the rank of each matrix's factors")
    ap.add_argument("--estimate-dense", action="store_true",
                    help="time the dense rows as uncapped steps to target x median capped step time")
    ap.add_argument("--timing-steps", type=int, default=MIN_TIMING_STEPS,
                    help=f"--estimate-dense: steps of the capped timing run (>= {MIN_TIMING_STEPS})")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants to run, in the table's order (default: all of "
                         f"{', '.join(VARIANTS)}); the keys of the others are null")
    args = ap.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        what = f"unknown {', '.join(unknown)}" if unknown else "name at least one"
        ap.error(f"--variants: {what} (choose from {', '.join(VARIANTS)})")
    args.variants = [v for v in VARIANTS if v in chosen]
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
    if args.outer_lr <= 0:
        ap.error(f"--outer-lr: must be > 0 (got {args.outer_lr})")
    if not 0 <= args.outer_momentum < 1:
        ap.error(f"--outer-momentum: must be in [0, 1) (got {args.outer_momentum})")
    args.outer_optimizer = outer_optimizer(args.outer_lr, args.outer_momentum)
    if not 1 <= args.rank <= 1024:
        ap.error(f"--rank: must be in 1..1024 (got {args.rank})")
    if args.timing_steps < MIN_TIMING_STEPS:
        ap.error(f"--timing-steps: must be >= {MIN_TIMING_STEPS} (got {args.timing_steps})")
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/wan.py", {"torch": "PyTorch", "sklearn": "scikit-learn", "pyarrow": "pyarrow"})
    args.wl = WORKLOADS[args.workload]
    args.target = args.target if args.target is not None else (args.wl.quick_target if args.quick else args.wl.target)
    return args


def prepare_workload(args, root: Path = REPO) -> None:
    """Check the workload's files (skip, naming the missing ones), load its job, pack its data;
    sets ``args.capped``, ``args.example_job``, ``args.job_steps``."""
    missing = missing_files(args.wl, args.framework, root)
    if missing:
        skip(f"workload {args.workload} ({args.framework}) needs {', '.join(missing)}, not in this checkout")
    args.example_job = None
    if args.workload == "digits":
        args.capped = DIGITS_CAPPED_SITE
        args.job_steps = args.steps or (args.wl.quick_steps if args.quick else args.wl.steps)
        return
    args.example_job = example_job(args.wl, args.framework, root)
    args.capped = site_names(args.example_job)[0]
    default_steps = int((args.example_job.get("train") or {}).get("steps", args.wl.quick_steps))
    args.job_steps = args.steps or (min(args.wl.quick_steps, default_steps) if args.quick else default_steps)
    if args.quick and args.steps is None:
        args.steps = args.job_steps
    ensure_packed(args.example_job, args.wl, root)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prepare_workload(args)
    steps = args.steps if args.workload != "digits" else args.job_steps

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
        for name in args.variants:
            local = VARIANTS[name][3]
            if args.estimate_dense and name in DENSE_ROWS:
                results[name] = estimate_dense(name, args, steps, workdir, link)
            else:
                results[name] = run_variant(name, args, steps, workdir, stop_early=not local and not args.quick,
                                            link=link)
            print(f"  {name}: done in {results[name]['wall_s']:.1f} s", file=sys.stderr)
        for name, r in results.items():
            if r["final_acc"] is None and r["stopped_early"]:
                r["final_acc"] = run_uncapped(name, args, steps, workdir)[1]
                r["final_uncapped"] = True
    finally:
        link.teardown()
    report(args, results, up_mbit, down_mbit, workdir)


def workers_behind_link(args) -> int:
    """How many workers the capped site runs: the example job's own count, 2 for digits."""
    job = getattr(args, "example_job", None)
    return int(job["sites"][args.capped]["workers"]) if job else DIGITS_SITE_WORKERS


def report(args, results: dict[str, dict], up_mbit: float, down_mbit: float, workdir: Path) -> None:
    """Print the table and the JSON line (its ``not_reached`` names the variants that missed the target,
    whose figures are null; then exit 1 when there is one)."""
    wl, metric = args.wl, args.wl.metric
    capped_workers = workers_behind_link(args)
    what = (f"digits hybrid job, {num_parameters():,} parameters" if args.workload == "digits"
            else f"{args.workload} job ({args.wl.jobs[args.framework]})")
    workers = f"{capped_workers} worker{'s' if capped_workers != 1 else ''}"
    settings = []  # name only the settings of the variants that ran
    if any(name.startswith("local") for name in results):
        settings.append(f"local: H={min(args.local_steps, args.job_steps)}, {describe_outer(args.outer_optimizer)}; ")
    if "local_powersgd" in results:
        settings.append(f"PowerSGD rank {args.rank}; ")
    print(f"\n{what}, {args.framework}; {args.capped} ({workers}) behind {args.rate_mbit:g} Mbit/s, the other site "
          f"local; target {metric} {'>=' if wl.higher_is_better else '<='} {args.target}; {args.job_steps} steps; "
          f"{''.join(settings)}shards initialised by the other site")
    print(f"{'variant':<42}{'time to target s':>17}{'at step':>9}{'WAN MB to target':>18}{'link MB':>10}"
          f"{'final ' + metric[5:]:>16}{'wall s':>9}")
    for name, r in results.items():
        t = "not reached" if r["time_s"] is None else f"{r['time_s']:.1f}{'~' if r.get('estimated') else ''}"
        step = "-" if r["step"] is None else str(r["step"])
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}"
        link_mb = "-" if r["link_bytes"] is None else f"{r['link_bytes'] / 1e6:.2f}"
        acc = "-" if r["final_acc"] is None else f"{r['final_acc']:.4f}{'*' if r.get('final_uncapped') else ''}"
        print(f"{VARIANTS[name][0]:<42}{t:>17}{step:>9}{mb:>18}{link_mb:>10}{acc:>16}{r['wall_s']:>9.1f}")
    print("(* final metric of the same BSP job run to the end without the cap; its capped run stopped at the target)")
    for name in DENSE_ROWS:
        r = results.get(name, NOT_RUN)
        if r.get("estimated"):
            print(f"(~ {name}: {r['step']} steps to target uncapped x median {r['step_s']:.3f} s/step over "
                  f"{r['timing_steps']} capped steps)")
    missing = [n for n, r in results.items() if r["time_s"] is None or r["final_acc"] is None]
    dense, per_worker, topk, local, local_int8, local_int4, powersgd = (results.get(n, NOT_RUN) for n in VARIANTS)

    def worse(anchor: float | None, other: float | None) -> float | None:
        return None if anchor is None or other is None else round(wl.worse_by(anchor, other), 5)

    print(json.dumps({
        "bench": "wan", "workload": args.workload, "framework": args.framework, "rate_mbit": args.rate_mbit,
        "capped_workers": capped_workers, "metric": metric, "higher_is_better": wl.higher_is_better,
        "anchor_site_aggregation": True,
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
        "local_acc_drop": worse(dense["final_acc"], local_int4["final_acc"]),
        "adam_acc_drop": worse(local["final_acc"], local_int8["final_acc"]),
        "adam_acc_drop_int4": worse(local["final_acc"], local_int4["final_acc"]),
        "dense_time_estimated": bool(dense.get("estimated")), "dense_steps_to_target": dense["step"],
        "dense_step_s": dense.get("step_s"), "dense_timing_steps": dense.get("timing_steps"),
        "dense_per_worker_time_s": per_worker["time_s"],
        "dense_per_worker_wan_mb": None if per_worker["bytes"] is None else round(per_worker["bytes"] / 1e6, 3),
        "dense_per_worker_bytes": per_worker["bytes"], "dense_per_worker_link_bytes": per_worker["link_bytes"],
        "dense_per_worker_acc": per_worker["final_acc"], "dense_per_worker_step_s": per_worker.get("step_s"),
        "dense_per_worker_steps_to_target": per_worker["step"],
        "local_powersgd_time_s": powersgd["time_s"],
        "local_powersgd_wan_mb": None if powersgd["bytes"] is None else round(powersgd["bytes"] / 1e6, 3),
        "local_powersgd_final": powersgd["final_acc"], "local_powersgd_bytes": powersgd["bytes"],
        "local_powersgd_link_bytes": powersgd["link_bytes"],
        "local_powersgd_speedup": ratio(dense["time_s"], powersgd["time_s"]),
        "local_powersgd_bytes_reduction": ratio_drop(powersgd["bytes"], dense["bytes"]),
        "local_powersgd_acc_drop": worse(dense["final_acc"], powersgd["final_acc"]),
        "powersgd_rank": args.rank,
        "local_steps": min(args.local_steps, args.job_steps), "outer_optimizer": args.outer_optimizer,
        "inner_lr": args.inner_lr if args.workload == "digits" else None,  # examples: the script's own optimizer
        "steps": args.job_steps,
        "target": args.target, "measured_up_mbit": round(up_mbit, 2), "measured_down_mbit": round(down_mbit, 2),
        "variants": list(results), "not_reached": missing,
    }), flush=True)
    if missing:  # the figures above are printed either way; a variant that missed the target fails the run
        fail(f"target {args.target} not reached within {args.job_steps} steps by: {', '.join(missing)}",
             [r["run_dir"] for r in results.values()], workdir)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
