"""bench/tls_stages.py runs end to end on small frames and ends with its JSON line (figures never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_ps_tls_native import needs_native

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")


@needs_native
def test_tls_stages_bench_reports_each_sides_cpu_against_plaintext_and_the_cipher():
    # Execute: 2 timed frames of 1 MB each way of the comparison
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "tls_stages.py"), "--mb", "1", "--frames", "2"],
                          capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)

    # Assert: both sides measured in both modes, on the cipher the bench compares with
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "tls_stages" and result["mb"] == 1 and result["frames"] == 2
    assert result["negotiated_cipher"] == "TLS_AES_256_GCM_SHA384" and result["cipher_cpu_s_per_gb"] > 0
    assert set(result["plaintext"]) >= {"send_user_cpu_s_per_gb", "send_sys_cpu_s_per_gb", "recv_user_cpu_s_per_gb",
                                        "recv_sys_cpu_s_per_gb", "wall_s_per_gb"}
    # the kernel splits a thread's CPU into user and system time by sampling ticks: over 2 MB one part can read 0
    native = result["native"]
    assert native["recv_user_cpu_s_per_gb"] + native["recv_sys_cpu_s_per_gb"] > 0 and "tls_adds_over_cipher" in native


def test_tls_stages_bench_refuses_sizes_below_one():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "tls_stages.py"), "--frames", "0"],
                          capture_output=True, text=True, env=ENV, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "--mb and --frames must be at least 1 (got --mb 64, --frames 0)" in proc.stderr
