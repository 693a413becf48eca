"""Launch overhead: time from the command to the first training step.

`hfleet launch` against the frameworks' own launchers, started the same way, on the same
tiny script (it writes a timestamp at its first step), several repetitions, median.

    python bench/launch.py            # 5 repetitions, 2 processes
    python bench/launch.py --quick    # 2 repetitions, < 1 min on 2 cores

Ends with one JSON line: {"bench": "launch", "vs_torchrun": ours/theirs, "vs_paddle_launch": ours/theirs}
(a ratio above 1 means `hfleet launch` is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_STEP_SCRIPT = """
import os, sys, time
framework = sys.argv[1]
if framework == "torch":
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1); dist.all_reduce(t)
else:
    import paddle, paddle.distributed as dist
    dist.init_parallel_env()
    t = paddle.ones([1]); dist.all_reduce(t)
if dist.get_rank() == 0:
    with open(os.environ["BENCH_STAMP"], "w") as f:
        f.write(repr(time.time()))
if framework == "torch":
    dist.barrier()
    dist.destroy_process_group()
from hybridfleet.launch.helpers import finish
finish()  # either launcher: no interpreter teardown, where a finished gloo rank can abort
"""


def _commands(framework: str, nproc: int, script: Path, log_dir: Path) -> dict[str, list[str]]:
    py = sys.executable
    ours = [py, "-m", "hybridfleet.cli.app", "launch", "--framework", framework, "--nproc-per-node", str(nproc),
            "--device", "cpu", "--log-dir", str(log_dir / "ours"), str(script), framework]
    if framework == "torch":
        theirs = [py, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(script), framework]
    else:
        theirs = [py, "-m", "paddle.distributed.launch", f"--nproc_per_node={nproc}",
                  f"--log_dir={log_dir / 'theirs'}", str(script), framework]
    return {"hfleet launch": ours, "torchrun" if framework == "torch" else "paddle.distributed.launch": theirs}


def time_to_first_step_s(cmd: list[str], stamp: Path) -> float:
    """Seconds from starting ``cmd`` to the timestamp its rank 0 writes at the first step."""
    stamp.unlink(missing_ok=True)
    env = {**os.environ, "BENCH_STAMP": str(stamp), "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    started = time.time()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    if done.returncode != 0 or not stamp.exists():
        raise RuntimeError(f"{cmd[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(stamp.read_text()) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions: under a minute")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=None)
    args = parser.parse_args()
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/launch.py", {"torch": "PyTorch", "paddle": "PaddlePaddle"})
    repeats = args.repeats or (2 if args.quick else 5)
    nproc = args.nproc or 2  # paddle needs 2 for a process group

    rows, ratios = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        script = tmp_dir / "first_step.py"
        script.write_text(FIRST_STEP_SCRIPT)
        for framework in ("torch", "paddle"):
            commands = _commands(framework, nproc, script, tmp_dir / framework)
            samples: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(repeats):  # interleaved so drift in machine load hits both sides alike
                for name, cmd in commands.items():
                    samples[name].append(time_to_first_step_s(cmd, tmp_dir / "stamp"))
            medians = {name: statistics.median(values) for name, values in samples.items()}
            ours, (theirs_name, theirs) = medians["hfleet launch"], [(k, v) for k, v in medians.items()
                                                                       if k != "hfleet launch"][0]
            ratios["vs_torchrun" if framework == "torch" else "vs_paddle_launch"] = round(ours / theirs, 3)
            for name, values in samples.items():
                rows.append((framework, name, medians[name], min(values), max(values)))

    print(f"time to first training step, {nproc} process(es), median of {repeats}")
    print(f"{'framework':<10} {'launcher':<28} {'median_s':>9} {'min_s':>7} {'max_s':>7}")
    for framework, name, median_s, low, high in rows:
        print(f"{framework:<10} {name:<28} {median_s:>9.3f} {low:>7.3f} {high:>7.3f}")
    print(json.dumps({"bench": "launch", **ratios, "nproc": nproc, "repeats": repeats,
                      "ratio_is": "hfleet launch / framework launcher"}))


if __name__ == "__main__":
    main()
