"""Launch reliability: many short `hfleet launch` runs in a row, every one must exit 0.

Each launch trains the shipped collective example for two epochs on 2 CPU processes,
saving a checkpoint every epoch, the way the README runs it. The anchor is the
framework's own launcher (torchrun / paddle.distributed.launch) on the same script,
run the same number of times in the same session, so a failure that the framework
itself shows is told apart from one hfleet adds.

    python bench/launch_soak.py              # 50 launches per framework (and 50 anchor runs each)
    python bench/launch_soak.py --quick      # 3 per framework, < 1 min on 2 cores

Ends with one JSON line: {"bench": "launch_soak", "launches": N, "failures": F, ...}
where ``launches`` and ``failures`` count `hfleet launch` runs over both frameworks.
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

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"torch": REPO / "examples/collective/train_torch.py", "paddle": REPO / "examples/collective/train_paddle.py"}
SCRIPT_ARGS = ["--epochs", "2", "--ckpt-every", "1"]
LAUNCH_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(kind: str, framework: str, log_dir: Path) -> list[str]:
    py, port = sys.executable, _free_port()
    script = [str(SCRIPTS[framework]), *SCRIPT_ARGS]
    if kind == "hfleet launch":
        return [py, "-m", "hybridfleet", "launch", "--framework", framework, "--nproc-per-node", "2", "--device", "cpu",
                "--master", f"127.0.0.1:{port}", "--log-dir", str(log_dir), *script]
    if framework == "torch":
        return [py, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={port}", *script]
    return [py, "-m", "paddle.distributed.launch", "--nproc_per_node=2", f"--master=127.0.0.1:{port}",
            f"--log_dir={log_dir}", *script]


def soak(kind: str, framework: str, count: int, work: Path) -> dict:
    """Run ``count`` launches of ``kind``; returns counts, wall times and the tail of each failure."""
    failures, walls = [], []
    for i in range(count):
        log_dir = work / f"{kind.split()[0]}-{framework}-{i}"
        env = dict(os.environ, OMP_NUM_THREADS="1", HFLEET_CKPT_DIR=str(log_dir / "ckpt"), CUDA_VISIBLE_DEVICES="")
        if framework == "paddle":
            env.pop("CUDA_VISIBLE_DEVICES")
        started = time.monotonic()
        try:
            proc = subprocess.run(_command(kind, framework, log_dir), capture_output=True, text=True, env=env,
                                  cwd=REPO, timeout=LAUNCH_TIMEOUT_S)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code, output = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
        walls.append(time.monotonic() - started)
        if code != 0:
            failures.append({"run": i, "exit_code": code, "tail": output.strip().splitlines()[-5:]})
    return {"launches": count, "failures": len(failures), "median_s": sorted(walls)[len(walls) // 2] if walls else 0.0,
            "failed_runs": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 launches per framework")
    parser.add_argument("--launches", type=int, default=None, help="launches per framework (default 50; --quick 3)")
    parser.add_argument("--frameworks", default="torch,paddle", help="comma-separated: torch, paddle")
    parser.add_argument("--no-anchor", action="store_true", help="skip the frameworks' own launchers")
    args = parser.parse_args()
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    count = args.launches if args.launches is not None else (3 if args.quick else 50)
    frameworks = [f for f in args.frameworks.split(",") if f]
    require("bench/launch_soak.py", {f: {"torch": "PyTorch", "paddle": "PaddlePaddle"}.get(f, f) for f in frameworks})
    rows = []
    with tempfile.TemporaryDirectory(prefix="hfleet-soak-") as tmp:
        for framework in frameworks:
            kinds = ["hfleet launch"] + ([] if args.no_anchor else ["torchrun" if framework == "torch" else "paddle.distributed.launch"])
            for kind in kinds:
                rows.append((framework, kind, soak(kind, framework, count, Path(tmp))))
    print(f"{'framework':<9} {'launcher':<26} {'launches':>8} {'failures':>8} {'median s':>9}")
    for framework, kind, r in rows:
        print(f"{framework:<9} {kind:<26} {r['launches']:>8} {r['failures']:>8} {r['median_s']:>9.1f}")
        for failure in r["failed_runs"]:
            print(f"  run {failure['run']} exit {failure['exit_code']}: " + " | ".join(failure["tail"]))
    ours = [r for _, kind, r in rows if kind == "hfleet launch"]
    anchors = [r for _, kind, r in rows if kind != "hfleet launch"]
    print(json.dumps({
        "bench": "launch_soak",
        "launches": sum(r["launches"] for r in ours),
        "failures": sum(r["failures"] for r in ours),
        "per_framework": {f: {"launches": r["launches"], "failures": r["failures"]} for f, kind, r in rows if kind == "hfleet launch"},
        "anchor_launches": sum(r["launches"] for r in anchors),
        "anchor_failures": sum(r["failures"] for r in anchors),
    }))


if __name__ == "__main__":
    main()
