"""Gradient compression on the digits hybrid job: dense vs top-k 1% + error feedback vs 1-bit sign + EF.

    python bench/compression.py                       # torch, 200 steps
    python bench/compression.py --framework paddle
    python bench/compression.py --quick               # 60 steps, about 1-2 minutes

The job is examples/digits-hybrid.yaml with a 2048,512 MLP (1.19M parameters):
a hospital and a cloud site with 2 workers each, 2 shards, BSP, server-side
plain SGD (lr 0.3), TLS and tokens on. The three variants differ only in
``ps.compression``: same seeds, same steps, same optimizer. Top-k sends its kept
values as float16 (``value_dtype: float16``; error feedback keeps the rounding).
With a codec other than ``none`` the shards also send codec-encoded parameter
deltas downstream.

Why plain SGD: a sparse aggregated gradient then gives a sparse parameter
delta, which the compressed downlink carries almost whole. Adam (or momentum)
moves every coordinate every step, so 1% top-k deltas lag far behind the
server's parameters; measured here, Adam lr 1e-3 with top-k oscillated between
0.75 and 0.92 test accuracy over 200 steps while dense reached 0.975. The job
spec now refuses server-side Adam/AdamW with top-k, random-k or sign (see
``spec/rules.py``); Adam with compression trains in ``sync: local`` instead
(``bench/wan.py``, ``adam_acc_drop``).

Bytes are the workers' own counters (``summary.json``): uplink = what every
worker sent, downlink = what every worker received, both sites together.
reduction = 1 - compressed / dense bytes, uplink + downlink. Accuracy is the
final test accuracy of the worst worker. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINTS = {"torch": REPO / "examples/digits/train_torch.py", "paddle": REPO / "examples/digits/train_paddle.py"}
HIDDEN = "2048,512"
DEFAULT_OPTIMIZER = {"name": "sgd", "lr": 0.3}
INPUT_FEATURES, CLASSES = 64, 10
VARIANTS = {
    "dense": {"codec": "none"},
    "topk": {"codec": "topk", "ratio": 0.01, "value_dtype": "float16", "error_feedback": True},
    "sign": {"codec": "sign", "error_feedback": True},
}


def num_parameters(hidden: str = HIDDEN) -> int:
    """Weights and biases of the digits MLP with these hidden widths."""
    widths = [INPUT_FEATURES, *(int(w) for w in hidden.split(",")), CLASSES]
    return sum(d_in * d_out + d_out for d_in, d_out in zip(widths, widths[1:]))


def digits_job(name: str, framework: str, steps: int, compression: dict, *, eval_every_steps: int,
               optimizer: dict | None = None, host: str = "127.0.0.1", aggregate: bool = False,
               hospital_netns: str | None = None, local_steps: int | None = None, inner_lr: float | None = None,
               init_site: str | None = None) -> dict:
    """The digits hybrid job as a dict (hospital + cloud, 2 workers each, 2 shards), ready for YAML.

    With ``local_steps`` the job runs ``sync: local`` (the script's Adam, lr ``inner_lr``, takes the inner
    steps; ``optimizer`` is the outer one, DiLoCo's Nesterov SGD when None)."""
    if framework not in ENTRYPOINTS:
        raise ValueError(f"framework: must be one of {sorted(ENTRYPOINTS)} (got {framework!r})")
    hospital = {"workers": 2, "data": "digits:site-a", "aggregate": aggregate}
    if hospital_netns:
        hospital["netns"] = hospital_netns
    ps = {"shards": 2, "sync": "bsp", "optimizer": optimizer or DEFAULT_OPTIMIZER}
    args = ["--hidden", HIDDEN]
    if local_steps is not None:
        ps = {"shards": 2, "sync": "local", "local_steps": local_steps, **({"optimizer": optimizer} if optimizer else {})}
        args += ["--lr", str(inner_lr)] if inner_lr is not None else []
    if init_site is not None:
        ps["init_site"] = init_site
    return {
        "name": name, "framework": framework, "entrypoint": str(ENTRYPOINTS[framework]),
        "args": args, "mode": "ps",
        "sites": {"hospital": hospital, "cloud": {"workers": 2, "data": "digits:site-b", "aggregate": aggregate}},
        "ps": {**ps, "compression": compression, "host": host, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30},
        "train": {"steps": steps, "batch_size": 32, "seed": 0, "eval_every_steps": eval_every_steps},
        "security": {"tls": "auto", "tokens": "auto"},
    }


def run_job(job: dict, workdir: Path, on_started=None) -> dict:
    """Write ``job`` under ``workdir``, run it with `run_ps_job` (child output to log files only), return its summary.

    No ``report.html``: the benches read ``summary.json`` and ``metrics.jsonl``, and the report's charts
    would add seconds after every run (logs and metrics stay in the run dir)."""
    from hybridfleet.launch.psjob import run_ps_job
    from hybridfleet.spec import load_spec

    workdir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / f"{job['name']}.yaml"
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    spec = load_spec(job_path)
    return run_ps_job(spec, job_path, echo=False, show_progress=False, run_root=workdir / "runs", baselines=False,
                      on_started=on_started, report=False)


def link_bytes(summary: dict) -> tuple[int, int]:
    """(uplink, downlink) bytes of all workers of all sites."""
    return sum(summary["bytes_sent_by_site"].values()), sum(summary["bytes_received_by_site"].values())


def fail(message: str, run_dirs: list[str], workdir: Path) -> None:
    """Say what went wrong and where the logs are (the temp dir is kept), then exit 1."""
    print(f"FAILED: {message}", file=sys.stderr)
    for d in run_dirs:
        print(f"  run dir: {d}", file=sys.stderr)
    print(f"  kept: {workdir}", file=sys.stderr)
    sys.exit(1)


def quiet_parent_logs(level: str = "warning") -> None:
    """Keep this process's own JSON log lines (run start/finish) off the table; children are unaffected."""
    from hybridfleet.obs.log import configure

    configure(level=level)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=sorted(ENTRYPOINTS), default="torch")
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 200")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None,
                    help=f"server-side SGD learning rate, the same for every variant (default {DEFAULT_OPTIMIZER['lr']})")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps: must be >= 1 (got {args.steps})")
    steps = args.steps or (60 if args.quick else 200)
    if args.lr is not None and args.lr <= 0:
        ap.error(f"--lr: must be > 0 (got {args.lr})")
    lr = args.lr or DEFAULT_OPTIMIZER["lr"]
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/compression.py", {"torch": "PyTorch", "sklearn": "scikit-learn", "pyarrow": "pyarrow"})
    optimizer = {"name": "sgd", "lr": lr}
    quiet_parent_logs()
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-compression-"))
    results: dict[str, dict] = {}
    for variant, compression in VARIANTS.items():
        job = digits_job(f"bench-{variant}", args.framework, steps, compression,
                         eval_every_steps=max(1, steps // 5), optimizer=optimizer)
        started = time.monotonic()
        try:
            summary = run_job(job, workdir)
        except Exception:
            print(f"{variant} run raised; kept: {workdir}", file=sys.stderr)
            raise
        if summary["status"] != "completed" or summary["test_accuracy"] is None:
            fail(f"{variant} run ended {summary['status']}", [summary["run_dir"]], workdir)
        up, down = link_bytes(summary)
        results[variant] = {"acc": summary["test_accuracy"], "up": up, "down": down, "total": up + down,
                            "wall_s": time.monotonic() - started, "run_dir": summary["run_dir"]}
        print(f"  {variant}: done in {results[variant]['wall_s']:.1f} s", file=sys.stderr)
    dense_total = results["dense"]["total"]
    for r in results.values():
        r["reduction"] = 1 - r["total"] / dense_total

    print(f"\ndigits hybrid job, {args.framework}, {num_parameters():,} parameters, 4 workers / 2 sites, "
          f"2 shards, {steps} BSP steps, sgd lr {lr:g}")
    print(f"{'variant':<24}{'accuracy':>9}{'uplink MB':>12}{'downlink MB':>13}{'total MB':>11}{'reduction':>11}"
          f"{'wall s':>9}")
    labels = {"dense": "dense (none)", "topk": "top-k 1% + EF", "sign": "1-bit sign + EF"}
    for variant, r in results.items():
        print(f"{labels[variant]:<24}{r['acc']:>9.4f}{r['up'] / 1e6:>12.2f}{r['down'] / 1e6:>13.2f}"
              f"{r['total'] / 1e6:>11.2f}{r['reduction']:>11.4f}{r['wall_s']:>9.1f}")
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({
        "bench": "compression", "framework": args.framework,
        "dense_acc": results["dense"]["acc"], "topk_acc": results["topk"]["acc"], "sign_acc": results["sign"]["acc"],
        "topk_bytes_reduction": round(results["topk"]["reduction"], 5),
        "sign_bytes_reduction": round(results["sign"]["reduction"], 5),
        "steps": steps, "optimizer": "sgd", "lr": lr, "parameters": num_parameters(),
    }))


if __name__ == "__main__":
    main()
