"""Top-k on a small model: how many coordinates a step must keep to train.

    python bench/sparse_small_model.py             # torch, 300 steps
    python bench/sparse_small_model.py --quick     # 100 steps

The job is examples/digits-cnn.yaml (a BatchNorm CNN of 1,386 parameters; two sites, one
worker each, one shard, BSP, TLS and tokens on). The
variants differ only in ``ps.compression`` and the server's optimizer: dense (the
anchor), top-k 1% (about 18 coordinates a step, 1 per bias), top-k 10%, top-k 1% with DGC
momentum 0.9 on the workers, all with server-side plain SGD (lr 0.3); DGC again with lr
0.03 (momentum multiplies the step by about 10); and dense, top-k 1%
and 10% with server-side SGD momentum 0.9 (lr 0.03). Accuracy is the summary's joint test accuracy (the saved model's). The last line
is JSON; ``spec check``'s and connect's advice (`hybridfleet.codec.advice`) cites it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
PLAIN_SGD = {"name": "sgd", "lr": 0.3}
MOMENTUM_SGD = {"name": "sgd", "lr": 0.03, "momentum": 0.9}
VARIANTS = {  # name: (compression, server-side optimizer)
    "dense": ({"codec": "none"}, PLAIN_SGD),
    "topk_1pct": ({"codec": "topk", "ratio": 0.01, "error_feedback": True}, PLAIN_SGD),
    "topk_10pct": ({"codec": "topk", "ratio": 0.1, "error_feedback": True}, PLAIN_SGD),
    "topk_1pct_dgc": ({"codec": "topk", "ratio": 0.01, "error_feedback": True, "momentum": 0.9}, PLAIN_SGD),
    "topk_1pct_dgc_lr0.03": ({"codec": "topk", "ratio": 0.01, "error_feedback": True, "momentum": 0.9},
                             {"name": "sgd", "lr": 0.03}),
    "dense_server_momentum": ({"codec": "none"}, MOMENTUM_SGD),
    "topk_1pct_server_momentum": ({"codec": "topk", "ratio": 0.01, "error_feedback": True}, MOMENTUM_SGD),
    "topk_10pct_server_momentum": ({"codec": "topk", "ratio": 0.1, "error_feedback": True}, MOMENTUM_SGD),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = parser.parse_args()
    chosen = [v for v in args.only.split(",") if v] or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: must be >= 1 (got {args.steps})")
    steps = args.steps or (100 if args.quick else 300)
    from hybridfleet.launch.psjob import run_ps_job  # after the settings are checked: it imports the job machinery
    from hybridfleet.spec import load_spec

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            compression, optimizer = VARIANTS[name]
            data = yaml.safe_load((REPO / "examples/digits-cnn.yaml").read_text())
            data["entrypoint"] = str(REPO / data["entrypoint"])
            for site in data["sites"].values():
                site["data"] = str(REPO / site["data"])
            data["ps"]["optimizer"] = optimizer
            data["ps"]["compression"] = compression
            data["train"].update(steps=steps, eval_every_steps=0)
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(yaml.safe_dump(data))
            summary = run_ps_job(load_spec(path), path, echo=False, show_progress=False, run_root=Path(tmp) / "runs",
                                 report=False)
            results[name] = summary["test_accuracy"]
            print(f"{name:>14}  joint test accuracy {summary['test_accuracy']}", flush=True)
    print(json.dumps({"bench": "sparse_small_model", "steps": steps, "parameters": 1386,
                      "anchor": "dense", "accuracy": results,
                      **({"ratio": round(results["topk_1pct"] / results["dense"], 4)}
                         if {"dense", "topk_1pct"} <= set(results) else {})}))


if __name__ == "__main__":
    main()
