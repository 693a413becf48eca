"""Back-to-back real `hfleet launch` runs (torch and paddle, 2 processes each): every one exits 0.

The soak proper (>= 50 per framework, beside the frameworks' own launchers) is
`bench/launch_soak.py`; ten launches without the anchors are
``python bench/launch_soak.py --launches 5 --no-anchor``. This loop keeps the exit-time
flake from coming back unnoticed on every change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHES_PER_FRAMEWORK = 1


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.paddle
def test_a_launch_per_framework_exits_cleanly():
    # Execute
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "launch_soak.py"), "--launches",
                           str(LAUNCHES_PER_FRAMEWORK), "--no-anchor"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=900)
    # Assert
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "launch_soak"
    assert result["per_framework"] == {f: {"launches": LAUNCHES_PER_FRAMEWORK, "failures": 0} for f in ("torch", "paddle")}, proc.stdout
    assert (result["launches"], result["failures"]) == (2 * LAUNCHES_PER_FRAMEWORK, 0)
