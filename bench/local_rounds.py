"""Local SGD (DiLoCo) round by round: the global model's test accuracy after each outer round and the
hospital site's bytes to and from the shards by then, for several H and pseudo-gradient codecs.

    python bench/local_rounds.py                              # torch; H 25, 50, 75; none, int8, int4, sign
    python bench/local_rounds.py --framework paddle --local-steps 25 --codecs int4,sign

Where ``bench/wan.py`` asks how soon local mode reaches the target, this asks what it cannot do
with fewer bytes: how many outer rounds each H needs before the global model reaches the target,
and so the least the capped site must exchange (every round it pushes one pseudo-gradient and
pulls one set of new parameters, each through the codec). The job is ``bench/wan.py``'s
local variant without the link cap (bytes are the workers' own counters; a cap changes time,
not bytes or accuracy): digits hybrid job, 2 sites x 2 workers, site aggregation, inner Adam,
outer Nesterov SGD lr 0.7, momentum 0.9, shards initialised by the cloud site, the same seeds
and steps per worker.

``bytes`` = the hospital site's workers' bytes to and from the shards as of the round's
metrics records (what would cross the WAN in ``bench/wan.py``). The last line is JSON:
per (H, codec) the accuracy after each round, the first round at or above the target and the
bytes by then.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compression import ENTRYPOINTS, digits_job, fail, quiet_parent_logs, run_job  # noqa: E402
from wan import DIGITS_CAPPED_SITE as CAPPED_SITE, records  # noqa: E402

CODECS = ("none", "int8", "int4", "sign")


def rounds(run_dir: Path, local_steps: int) -> list[dict]:
    """Per outer round: its step, the global model's test accuracy and the capped site's bytes by then."""
    by_step: dict[int, dict] = {}
    for r in records(run_dir / "metrics.jsonl"):
        if (r.get("event") == "metrics" and r.get("site") == CAPPED_SITE and "test_accuracy" in r
                and r.get("step", 0) % local_steps == 0):
            entry = by_step.setdefault(r["step"], {"step": r["step"], "acc": r["test_accuracy"], "procs": {}})
            entry["procs"].setdefault(r["process"], r["sent"] + r["received"])
    return [{"step": e["step"], "acc": round(e["acc"], 5), "bytes": sum(e["procs"].values())}
            for _, e in sorted(by_step.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=sorted(ENTRYPOINTS), default="torch")
    ap.add_argument("--steps", type=int, default=150, help="training steps per worker (default 150, as bench/wan.py)")
    ap.add_argument("--local-steps", default="25,50,75", help="comma-separated H values (default 25,50,75)")
    ap.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {', '.join(CODECS)}")
    ap.add_argument("--inner-lr", type=float, default=0.002)
    ap.add_argument("--target", type=float, default=0.93)
    args = ap.parse_args()
    try:
        hs = [int(h) for h in args.local_steps.split(",")]
    except ValueError:
        ap.error(f"--local-steps: comma-separated integers (got {args.local_steps!r})")
    if any(h < 1 or h > args.steps for h in hs):
        ap.error(f"--local-steps: each must be in 1..{args.steps} (got {args.local_steps})")
    codecs = args.codecs.split(",")
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        ap.error(f"--codecs: unknown {', '.join(unknown)} (choose from {', '.join(CODECS)})")
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/local_rounds.py", {"torch": "PyTorch", "sklearn": "scikit-learn", "pyarrow": "pyarrow"})
    quiet_parent_logs("error")
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-local-rounds-"))
    out = []
    for h in hs:
        for codec in codecs:
            compression = {"codec": codec, "error_feedback": True} if codec != "none" else {"codec": "none"}
            job = digits_job(f"rounds-h{h}-{codec}", args.framework, args.steps, compression, eval_every_steps=h,
                             aggregate=True, local_steps=h, inner_lr=args.inner_lr, init_site="cloud")
            summary = run_job(job, workdir)
            if summary["status"] != "completed":
                fail(f"H={h} {codec} run ended {summary['status']}", [summary["run_dir"]], workdir)
            rs = rounds(Path(summary["run_dir"]), h)
            hit = next((r for r in rs if r["acc"] >= args.target), None)
            out.append({"local_steps": h, "codec": codec, "rounds": rs, "final_acc": summary["test_accuracy"],
                        "target_round": None if hit is None else rs.index(hit) + 1,
                        "bytes_to_target": None if hit is None else hit["bytes"]})
            accs = " ".join(f"{r['acc']:.3f}" for r in rs)
            reach = "not reached" if hit is None else f"round {rs.index(hit) + 1}, {hit['bytes'] / 1e6:.2f} MB"
            print(f"H={h:<4}{codec:<6} accuracy per round: {accs:<48} target {args.target}: {reach}", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({"bench": "local_rounds", "framework": args.framework, "steps": args.steps,
                      "target": args.target, "inner_lr": args.inner_lr, "runs": out}))


if __name__ == "__main__":
    main()
