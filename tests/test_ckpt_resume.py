"""Exact resume: a run SIGKILLed after a checkpoint and resumed ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

SCRIPT = Path(__file__).with_name("ckpt_resume_script.py")
TOTAL_STEPS, KILL_AT = 14, 8  # KILL_AT is mid-epoch (6 batches per epoch)


def start(framework: str, ckpt: Path, out: Path, pause_after: int = -1) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HFLEET_LOG_LEVEL": "warning", "PYTHONPATH": str(SCRIPT.parents[1])}
    cmd = [sys.executable, str(SCRIPT), "--framework", framework, "--ckpt", str(ckpt), "--steps", str(TOTAL_STEPS),
           "--out", str(out), "--pause-after", str(pause_after)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


@pytest.mark.slow
@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch), pytest.param("paddle", marks=pytest.mark.paddle)])
def test_sigkilled_run_resumes_to_bitwise_identical_parameters(tmp_path, framework):
    # Prepare: an uninterrupted run and a run that pauses after checkpoint KILL_AT, side by side
    uninterrupted = start(framework, tmp_path / "ckpt-full", tmp_path / "full.safetensors")
    victim = start(framework, tmp_path / "ckpt-killed", tmp_path / "unused.safetensors", pause_after=KILL_AT)
    # Execute: SIGKILL once checkpoint KILL_AT is written, then resume from the newest checkpoint
    for line in victim.stdout:
        if line.strip() == f"CHECKPOINT_SAVED {KILL_AT}":
            break
    else:
        pytest.fail(f"training never reported checkpoint {KILL_AT}: {victim.stderr.read()[-3000:]}")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    resumed_stdout = finish(start(framework, tmp_path / "ckpt-killed", tmp_path / "resumed.safetensors"))
    finish(uninterrupted)
    # Assert
    assert victim.returncode == -signal.SIGKILL
    assert f"RESUMED_FROM {KILL_AT}" in resumed_stdout
    full, resumed = load_file(str(tmp_path / "full.safetensors")), load_file(str(tmp_path / "resumed.safetensors"))
    assert sorted(full) == sorted(resumed)
    for name in full:
        assert np.array_equal(full[name], resumed[name]), f"{name} differs after resume"
