"""`hfleet launch` end to end on CPU: both frameworks, real processes, gloo.

Each test starts real torch / paddle process groups through the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridfleet.ckpt.run_model import read_model_card
from hybridfleet.launch.collective import group_pids

REPO = Path(__file__).resolve().parents[1]
HFLEET = [sys.executable, "-m", "hybridfleet.cli.app"]
FRAMEWORKS = ["torch", "paddle"]
# Few large steps: each step of a 2-process run is a gloo all-reduce, slow on 2 shared cores.
EPOCHS = 15
TRAIN_ARGS = ["--epochs", str(EPOCHS), "--batch-size", "64", "--lr", "0.2"]

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _final(output: str) -> dict:
    lines = [line.split("]:", 1)[-1] for line in output.splitlines() if '"event": "final"' in line]
    assert lines, output[-3000:]
    return json.loads(lines[-1])


def _launch(framework: str, log_dir: Path, script: Path, *args: str, flags: tuple[str, ...] = (), **env: str):
    cmd = [*HFLEET, "launch", "--framework", framework, "--nproc-per-node", "2", "--device", "cpu",
           "--log-dir", str(log_dir), *flags, str(script), *args]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=240)


def _rank0_log(log_dir: Path, framework: str, attempt: int) -> str:
    attempt_dir = log_dir / f"attempt_{attempt}"
    pattern = "*/attempt_*/0/stdout.log" if framework == "torch" else "workerlog.0"
    return "".join(p.read_text() for p in attempt_dir.glob(pattern))


@dataclass
class RestartedRun:
    """A 2-process launch whose rank 1 SIGKILLs itself in epoch 3 of the first attempt, beside a 1-process run
    of the same training (both started together)."""

    framework: str
    log_dir: Path
    launch: subprocess.CompletedProcess
    single: subprocess.CompletedProcess


@pytest.fixture(scope="module", params=FRAMEWORKS)
def restarted_run(request, tmp_path_factory) -> RestartedRun:
    """One launch shared by the tests below: checkpoints every 2 epochs, one restart allowed. The example's
    SGD is stateless and its sampler is seeded by epoch, so the resumed run trains exactly as an
    uninterrupted one would."""
    framework = request.param
    script = REPO / "examples" / "collective" / f"train_{framework}.py"
    log_dir = tmp_path_factory.mktemp(f"restarted-{framework}") / "logs"
    single = subprocess.Popen([sys.executable, str(script), *TRAIN_ARGS], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        launch = _launch(framework, log_dir, script, *TRAIN_ARGS, "--ckpt-every", "2",
                         flags=("--max-restarts", "1"), HFLEET_EXAMPLE_KILL_RANK1_AT_EPOCH="3")
        out, err = single.communicate(timeout=240)
    finally:
        single.kill()
        single.wait()
    return RestartedRun(framework, log_dir, launch, subprocess.CompletedProcess(single.args, single.returncode, out, err))


def test_two_process_run_reaches_the_one_process_accuracy(restarted_run):
    # Prepare / Execute: the shared run (a restart on the way changes nothing it learns)
    single, double, log_dir = restarted_run.single, restarted_run.launch, restarted_run.log_dir
    assert single.returncode == 0, single.stderr[-3000:]

    # Assert
    assert double.returncode == 0, double.stdout[-3000:] + double.stderr[-3000:]
    one, two = _final(single.stdout), _final(_rank0_log(log_dir, restarted_run.framework, 1))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["test_acc"] >= 0.93
    assert abs(one["test_acc"] - two["test_acc"]) <= 0.02
    # the run ends in a model: rank 0's final checkpoint, named with lineage in MODEL.json
    card = read_model_card(str((log_dir / "model").resolve()))
    assert card["final"]["metrics"]["test_acc"] == two["test_acc"]
    assert card["lineage"]["framework"] == restarted_run.framework and card["lineage"]["git"]["commit"]
    assert "model: file://" in double.stderr


def test_killed_rank_restarts_and_resumes_after_the_newest_checkpoint(restarted_run):
    # Prepare / Execute: the shared run; rank 1 died in epoch 3, the newest checkpoint was epoch 2's
    run, log_dir, framework = restarted_run.launch, restarted_run.log_dir, restarted_run.framework

    # Assert
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    failed = [json.loads(line) for line in run.stderr.splitlines() if '"event":"attempt_failed"' in line]
    assert [(f["attempt"], f["rank"]) for f in failed] == [(0, 1)]
    first, second = _rank0_log(log_dir, framework, 0), _rank0_log(log_dir, framework, 1)
    assert '"final"' not in first
    resumed = [json.loads(line) for line in second.splitlines() if line.startswith('{"event": "resumed"')]
    assert resumed == [{"event": "resumed", "checkpoint_epoch": 2, "start_epoch": 3, "restart": 1}]
    epochs = [json.loads(line)["epoch"] for line in second.splitlines() if line.startswith('{"event": "epoch"')]
    assert epochs == list(range(3, EPOCHS + 1))
    assert _final(second)["world_size"] == 2


DYING_SCRIPT = """
import os, sys, time
framework = sys.argv[1]
if framework == "torch":
    import torch.distributed as dist
    dist.init_process_group("gloo")
else:
    import paddle.distributed as dist
    dist.init_parallel_env()
dist.barrier()  # both ranks are past every collective call: rank 1's death is the only failure
if dist.get_rank() == 1:
    print("rank 1 about to die", flush=True)
    time.sleep(1)  # let rank 0 leave the barrier's last socket read
    os.kill(os.getpid(), 9)
time.sleep(120)  # rank 0 would outlive its peer without the launcher
"""


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dead_rank_stops_the_group_and_is_reported_with_exit_code_and_log(framework, tmp_path):
    # Prepare
    script = tmp_path / "dying.py"
    script.write_text(DYING_SCRIPT)

    # Execute
    run = _launch(framework, tmp_path / "logs", script, framework)

    # Assert
    assert run.returncode == 8
    assert "rank 1 failed with exit code -9 (killed by signal 9)" in run.stderr
    assert "rank 1 about to die" in run.stderr
    leftovers = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(script) not in leftovers
    assert not [p for p in _pids_with_env("HFLEET_LOG_DIR", str(tmp_path / "logs"))]


def _pids_with_env(name: str, value: str) -> list[int]:
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_group_pids_finds_tagged_processes_only_while_they_live(tmp_path):
    # Prepare
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=_env(HFLEET_LAUNCH_ID="tag-under-test"))
    try:
        # Execute / Assert: once the child has exec'd (before that /proc shows the parent's environment)
        deadline = time.monotonic() + 10
        while group_pids("tag-under-test") != [proc.pid] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert group_pids("tag-under-test") == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert group_pids("tag-under-test") == []


@pytest.mark.torch  # trains or probes torch
def test_script_arguments_pass_through_untouched_even_when_they_look_like_launch_flags(tmp_path):
    # Prepare: a one-process torch script that records its argv and the launcher's settings
    script = tmp_path / "argv.py"
    script.write_text(
        "import json, os, sys\n"
        "keys = ['HFLEET_RESTART_COUNT', 'HFLEET_CKPT_DIR', 'HFLEET_DIST_BACKEND']\n"
        "json.dump({'argv': sys.argv[1:], **{k: os.environ.get(k) for k in keys}}, open(sys.argv[-1], 'w'))\n"
    )
    out = tmp_path / "argv.json"
    script_args = ["--log-dir", "inner", "-n", "5", "--framework", "x", "--", str(out)]

    # Execute
    run = subprocess.run([*HFLEET, "launch", "--framework", "torch", "--device", "cpu", "--log-dir",
                          str(tmp_path / "logs"), str(script), *script_args],
                         env=_env(), capture_output=True, text=True, timeout=120)

    # Assert
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen == {"argv": script_args, "HFLEET_RESTART_COUNT": "0",
                    "HFLEET_CKPT_DIR": str(tmp_path / "logs" / "ckpt"), "HFLEET_DIST_BACKEND": "gloo"}
