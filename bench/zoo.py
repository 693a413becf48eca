"""The examples on one machine: the plain script, collective DDP and the parameter server, same settings.

For each example (digits, fashion, charlm; bench/_zoo_workloads.py) and framework, three modes
train the same model (the script's arguments: the example job's ``args:`` in every mode) with the
same optimizer and schedule, batch per worker, steps and seeds:

* ``alone``: the example's script run plainly (no parameter server) on all the sites' rows;
* ``ddp``: ``hfleet launch`` with N processes on gloo, the same model and loop under
  DDP / paddle.DataParallel (bench/_zoo_ddp.py), each rank on 1/N of all the rows;
* ``ps``: ``hfleet run`` of the example's job with N workers split over its sites and
  2 shards, dense BSP on 127.0.0.1, each site on its own rows.

Step time: seconds per step between the first and the last evaluation of rank 0 (startup
excluded; evaluation included, alike in every mode). Time to target: wall-clock seconds from
starting the command (launcher, imports, rendezvous or joining the shards included, as a user
waits for them) to the first evaluation of rank 0 that reaches the target.

    python bench/zoo.py                 # every example, torch and paddle, 4 processes
    python bench/zoo.py --quick         # digits only, 60 steps: a few minutes (six jobs start)
    python bench/zoo.py --workloads digits --frameworks torch --nproc 2 --steps 6 --eval-every 2

An example whose files are not in this checkout is a ``skipped`` row naming them. Ends with
one JSON line: ``ps_vs_ddp`` (the worst ps / ddp step-time ratio over examples and frameworks;
above 1: the parameter server is slower) and ``joint_vs_alone`` (the worst relative metric gap of
the joint ps model against the script alone; above 0: the joint model is worse), with every row.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import yaml
from _zoo_workloads import FRAMEWORKS, REPO, WORKLOADS, Workload

RUN_TIMEOUT_S = 1800


def _usage(parser: argparse.ArgumentParser, message: str) -> None:
    parser.error(message)  # exit status 2, before anything starts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits only, 60 steps, a low target")
    parser.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--frameworks", default="torch,paddle")
    parser.add_argument("--nproc", type=int, default=4, help="processes of ddp, workers of ps (split over sites)")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="default: each workload's")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker; default: each workload's")
    parser.add_argument("--eval-every", type=int, default=None, help="default: each workload's")
    parser.add_argument("--target", type=float, default=None, help="default: each workload's")
    args = parser.parse_args(argv)
    default_workloads = "digits" if args.quick else ",".join(WORKLOADS)
    args.workloads = [w for w in (args.workloads or default_workloads).split(",") if w]
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    for w in args.workloads:
        if w not in WORKLOADS:
            _usage(parser, f"--workloads: unknown {w} (choose from {', '.join(WORKLOADS)})")
    for f in args.frameworks:
        if f not in FRAMEWORKS:
            _usage(parser, f"--frameworks: unknown {f} (choose from {', '.join(FRAMEWORKS)})")
    if args.nproc < 2:
        _usage(parser, f"--nproc: must be >= 2 (got {args.nproc})")
    if args.shards < 1:
        _usage(parser, f"--shards: must be >= 1 (got {args.shards})")
    for flag in ("steps", "batch_size", "eval_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _usage(parser, f"--{flag.replace('_', '-')}: must be >= 1 (got {value})")
    return args


def settings(workload: Workload, args: argparse.Namespace) -> dict:
    """Steps, batch per worker, evaluation interval and target of one workload under these flags."""
    quick = args.quick
    return {"steps": args.steps or (min(workload.steps, 60) if quick else workload.steps),
            "batch_size": args.batch_size or workload.batch_size,
            "eval_every": args.eval_every or (min(workload.eval_every, 10) if quick else workload.eval_every),
            "target": args.target if args.target is not None else (workload.quick_target if quick
                                                                   else workload.target),
            "seed": 0}


# -- data ----------------------------------------------------------------------------------------------

def site_datasets(workload: Workload, framework: str) -> dict[str, Path]:
    """The example job's site -> packed dataset, packed first with the example's pack_sites.py if absent."""
    job = yaml.safe_load(workload.job(framework).read_text())
    sites = {site: REPO / spec["data"] for site, spec in job["sites"].items()}
    if not all((path / "manifest.json").exists() for path in sites.values()):
        subprocess.run([sys.executable, str(workload.folder / "pack_sites.py")], cwd=REPO, check=True,
                       capture_output=True, timeout=RUN_TIMEOUT_S)
    return sites


def pack_all(sites: dict[str, Path], dest: Path) -> Path:
    """Every site's rows in one packed dataset (site by site, in the job's order): the data the
    script alone and the collective ranks train on."""
    from hybridfleet.data import open_dataset

    parts = []
    for path in sites.values():
        dataset = open_dataset(str(path))
        parts.append(dataset.take(np.arange(len(dataset))))
    merged = {column: np.concatenate([part[column] for part in parts]) for column in parts[0]}
    src = dest.with_suffix(".npz")
    np.savez(src, **merged)
    subprocess.run([sys.executable, "-m", "hybridfleet.cli.app", "data", "pack", str(src), str(dest), "--overwrite"],
                   cwd=REPO, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    return dest


# -- the three modes -----------------------------------------------------------------------------------

def _train_section(s: dict) -> dict:
    return {"steps": s["steps"], "batch_size": s["batch_size"], "seed": s["seed"], "eval_every_steps": s["eval_every"],
            "site_baselines": False}


def _ps_job(workload: Workload, framework: str, sites: dict[str, Path], s: dict, nproc: int, shards: int) -> dict:
    """The example's job with N workers over its sites, the shards applying the script's own optimizer, dense BSP."""
    job = yaml.safe_load(workload.job(framework).read_text())
    names = list(job["sites"])
    if nproc < len(names):
        raise ValueError(f"--nproc {nproc}: the {workload.name} job has {len(names)} sites, one worker each at least")
    for i, site in enumerate(names):
        job["sites"][site].update(workers=nproc // len(names) + (1 if i < nproc % len(names) else 0),
                                  data=str(sites[site]))
    job["entrypoint"] = str(workload.script(framework))
    job["args"] = workload.args(framework)  # the job's own, as the alone and ddp rows get them
    ps = job.setdefault("ps", {})
    for key in ("optimizer", "compression", "local_steps"):
        ps.pop(key, None)
    ps.update(shards=shards, sync="bsp")
    # a worker starved of CPU for a few seconds must stay in the BSP quorum, as in the DDP row (no
    # heartbeats there): a dropped worker would change the rounds, not only the step time
    ps["heartbeat_timeout_s"] = max(float(ps.get("heartbeat_timeout_s", 0)), 60.0)
    job["train"] = {**job.get("train", {}), **_train_section(s)}
    for key in ("checkpoint", "registry"):
        job.pop(key, None)
    return job


def _alone_job(workload: Workload, framework: str, all_rows: Path, s: dict) -> dict:
    return {"name": f"zoo-{workload.name}-alone", "framework": framework, "entrypoint": str(workload.script(framework)),
            "mode": "ps", "sites": {"all": {"workers": 1, "data": str(all_rows)}}, "ps": {"shards": 1, "sync": "bsp"},
            "train": _train_section(s), "security": {"tls": "off", "tokens": "off"}}


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])}
    for key in [k for k in env if k.startswith("HFLEET_")]:
        del env[key]
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd``; returns its result, its wall time in seconds and the wall-clock time it was started."""
    started_ts, started = time.time(), time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({done.returncode}): {(done.stderr or done.stdout)[-3000:]}")
    return done, time.monotonic() - started, started_ts


def _metric_records(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("{") and '"metrics"' in line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "metrics":
                out.append(rec)
    return out


def run_alone(workload: Workload, framework: str, all_rows: Path, s: dict,
              tmp: Path) -> tuple[list[dict], float, float]:
    job = tmp / f"alone-{framework}.yaml"
    job.write_text(yaml.safe_dump(_alone_job(workload, framework, all_rows, s)))
    env = {**_env(), "HFLEET_JOB": str(job), "HFLEET_SITE": "all"}
    done, wall_s, started_ts = _run([sys.executable, str(workload.script(framework)), *workload.args(framework)], env)
    return _metric_records(done.stderr.splitlines()), wall_s, started_ts


def _free_port() -> int:
    """A port free now on 127.0.0.1: the rendezvous must not meet another job's process group on the default."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ddp(workload: Workload, framework: str, all_rows: Path, s: dict, nproc: int,
            tmp: Path) -> tuple[list[dict], float, float]:
    cmd = [sys.executable, "-m", "hybridfleet.cli.app", "launch", "--framework", framework, "--nproc-per-node",
           str(nproc), "--device", "cpu", "--master", f"127.0.0.1:{_free_port()}", "--log-dir", str(tmp / f"launch-{framework}"),
           str(REPO / "bench" / "_zoo_ddp.py"), workload.name, framework, str(all_rows),
           *(str(s[k]) for k in ("steps", "batch_size", "eval_every", "seed")), *workload.args(framework)]
    done, wall_s, started_ts = _run(cmd, _env())
    text = done.stdout + "\n" + "\n".join(p.read_text(errors="replace") for p in (tmp / f"launch-{framework}").rglob("*")
                                          if p.is_file())
    records = [json.loads(line.split("ZOO ", 1)[1]) for line in text.splitlines() if "ZOO {" in line]
    unique = {r["step"]: r for r in records}  # a launcher may echo rank 0's lines into its own log too
    return [unique[k] for k in sorted(unique)], wall_s, started_ts


def run_ps(workload: Workload, framework: str, sites: dict[str, Path], s: dict, nproc: int, shards: int,
           tmp: Path) -> tuple[list[dict], float, float, dict]:
    spec = _ps_job(workload, framework, sites, s, nproc, shards)
    job = tmp / f"ps-{framework}.yaml"
    job.write_text(yaml.safe_dump(spec))
    runs = tmp / f"runs-{framework}"
    cmd = [sys.executable, "-m", "hybridfleet.cli.app", "run", str(job), "--quiet", "--no-baselines", "--no-metrics",
           "--scalars", "off", "--run-root", str(runs)]
    _, wall_s, started_ts = _run(cmd, _env())
    (metrics,) = runs.rglob("metrics.jsonl")
    records = [r for r in _metric_records(metrics.read_text().splitlines()) if r.get("rank") == 0]
    aggregate = any(site.get("aggregate") for site in spec["sites"].values())
    workers = {site: site_spec["workers"] for site, site_spec in spec["sites"].items()}
    return records, wall_s, started_ts, {"site_aggregation": aggregate, "workers": workers}


# -- figures -------------------------------------------------------------------------------------------

def figures(workload: Workload, records: list[dict], target: float, started_ts: float) -> dict:
    """Step time, time to target (from ``started_ts``, when the command started) and final metric of one run's
    rank-0 metric records."""
    evals: dict[int, dict] = {}
    for rec in records:
        evals.setdefault(int(rec["step"]), rec)  # the first record of a step: a final one repeats the last step
    steps = sorted(evals)
    if not steps or workload.metric not in evals[steps[-1]]:
        raise RuntimeError(f"no {workload.metric} reported (records: {records[-3:]})")
    step_s = None
    if len(steps) >= 2:
        first, last = evals[steps[0]], evals[steps[-1]]
        step_s = (last["elapsed_s"] - first["elapsed_s"]) / (steps[-1] - steps[0])
    finals = [r for r in records if r.get("final")]
    final_value = float((finals[-1] if finals else evals[steps[-1]])[workload.metric])
    reached = [evals[k] for k in steps
               if workload.metric in evals[k] and workload.reached(float(evals[k][workload.metric]), target)]
    return {"step_s": step_s, "time_to_target_s": reached[0]["ts"] - started_ts if reached else None,
            "steps_to_target": int(reached[0]["step"]) if reached else None, workload.metric: final_value,
            "evaluations": len(steps)}


def bench_one(workload: Workload, framework: str, args: argparse.Namespace, tmp: Path) -> Iterator[dict]:
    """The workload's three rows (alone, DDP, PS), each as soon as its mode has run."""
    s = settings(workload, args)
    sites = site_datasets(workload, framework)
    tmp = tmp / workload.name  # each workload's jobs, logs and run directories apart: they are globbed
    tmp.mkdir(exist_ok=True)
    all_rows = pack_all(sites, tmp / f"{workload.name}-all")
    base = {"workload": workload.name, "framework": framework, "metric": workload.metric, "target": s["target"],
            "steps": s["steps"], "batch_size": s["batch_size"]}
    records, wall_s, started_ts = run_alone(workload, framework, all_rows, s, tmp)
    yield {**base, "mode": "alone", "processes": 1, "wall_s": wall_s, **figures(workload, records, s["target"], started_ts)}
    records, wall_s, started_ts = run_ddp(workload, framework, all_rows, s, args.nproc, tmp)
    yield {**base, "mode": "ddp", "processes": args.nproc, "wall_s": wall_s,
           **figures(workload, records, s["target"], started_ts)}
    records, wall_s, started_ts, extra = run_ps(workload, framework, sites, s, args.nproc, args.shards, tmp)
    yield {**base, "mode": "ps", "processes": args.nproc, "shards": args.shards, "wall_s": wall_s, **extra,
           **figures(workload, records, s["target"], started_ts)}


def summarise(rows: list[dict]) -> dict:
    """The JSON keys: worst ps/ddp step-time ratio and worst joint-vs-alone metric gap over examples and frameworks."""
    ratios, gaps = {}, {}
    for key in {(r["workload"], r["framework"]) for r in rows if "mode" in r}:
        by_mode = {r["mode"]: r for r in rows if (r["workload"], r["framework"]) == key and "mode" in r}
        if {"alone", "ddp", "ps"} - set(by_mode):
            continue
        if by_mode["ps"]["step_s"] and by_mode["ddp"]["step_s"]:
            ratios[key] = by_mode["ps"]["step_s"] / by_mode["ddp"]["step_s"]
        metric = by_mode["ps"]["metric"]
        gaps[key] = WORKLOADS[key[0]].gap(by_mode["ps"][metric], by_mode["alone"][metric])
    return {"ps_vs_ddp": round(max(ratios.values()), 4) if ratios else None,
            "ps_vs_ddp_by": {f"{w}/{f}": round(v, 4) for (w, f), v in sorted(ratios.items())},
            "joint_vs_alone": round(max(gaps.values()), 5) if gaps else None,
            "joint_vs_alone_by": {f"{w}/{f}": round(v, 5) for (w, f), v in sorted(gaps.items())}}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_row(r: dict) -> None:
    if "skipped" in r:
        print(f"{r['workload']:<9} {r['framework']:<9} skipped: {r['skipped']}", flush=True)
        return
    step_ms = None if r["step_s"] is None else r["step_s"] * 1000
    print(f"{r['workload']:<9} {r['framework']:<9} {r['mode']:<6} {_fmt(step_ms, '8.2f')} "
          f"{_fmt(r['time_to_target_s'], '11.2f')} {_fmt(r['steps_to_target'], '10d')} {r['metric']:<14} "
          f"{r[r['metric']]:>8.4f} {r['wall_s']:>7.1f}", flush=True)


def main() -> None:
    args = parse_args()
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/zoo.py", {"torch": "PyTorch", "paddle": "PaddlePaddle"} if set(args.frameworks) == set(FRAMEWORKS)
            else {"torch": "PyTorch"} if args.frameworks == ["torch"] else {"paddle": "PaddlePaddle"})
    # each row is printed as its mode finishes, so a run cut short (a time bound) keeps what it measured
    print(f"examples alone, collective DDP ({args.nproc} processes, gloo) and PS BSP ({args.nproc} workers, "
          f"{args.shards} shards, dense) on 127.0.0.1")
    print(f"{'workload':<9} {'framework':<9} {'mode':<6} {'step_ms':>8} {'to_target_s':>11} {'steps_to_t':>10} "
          f"{'metric':<14} {'final':>8} {'wall_s':>7}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hfleet-bench-zoo-") as tmp:
        for name in args.workloads:
            workload = WORKLOADS[name]
            for framework in args.frameworks:
                missing = workload.missing(framework)
                if missing:
                    measured: Iterable[dict] = [{"workload": name, "framework": framework,
                                                 "skipped": f"not in this checkout: {', '.join(missing)}"}]
                elif not workload.glue_ready:
                    measured = [{"workload": name, "framework": framework, "skipped": "the collective runner's "
                                 "glue (model, optimizer, loss, metric) is not written: GLUE in bench/_zoo_workloads.py"}]
                else:
                    measured = bench_one(workload, framework, args, Path(tmp))
                for row in measured:
                    rows.append(row)
                    _print_row(row)
    print(json.dumps({"bench": "zoo", **summarise(rows), "nproc": args.nproc, "shards": args.shards,
                      "quick": args.quick, "ratio_is": "ps step time / ddp step time (worst); joint_vs_alone: "
                      "relative metric gap of ps against the script alone (worst, > 0: ps worse)", "rows": rows}))


if __name__ == "__main__":
    main()
