"""bench/tls_cost.py runs end to end on a small exchange and ends with its JSON line (figures never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridfleet.ps.wire import tls

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.torch  # its workers are bench/ps_exchange.py's, which load torch as a torch job's worker does
def test_tls_cost_bench_reports_the_cpu_tls_adds_and_the_ciphers_own_cost():
    # Prepare / Execute: a 4 MB exchange, one timed round per run (TLS + tokens, then plaintext)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "tls_cost.py"), "--mb", "4", "--rounds", "1"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)

    # Assert: both runs were measured (CPU of every process) and the cipher ran on the same bytes
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "tls_cost" and result["mb"] == 4 and result["rounds"] == 2
    assert result["tls_run_cpu_s"] > 0 and result["plaintext_run_cpu_s"] > 0
    assert result["cipher_cpu_s_per_round"] > 0 and result["aes_gcm_gb_s"] > 0
    assert "tls_cpu_over_cipher" in result and "tls_cpu_s_per_round" in result
    # the timed rounds' CPU of every process, and the cipher also in the OpenSSL the TLS links
    assert result["tls_rounds_cpu_s"] > 0 and result["plaintext_rounds_cpu_s"] > 0 and result["timed_rounds"] == 1
    if result["stack_openssl"] is not None:  # the native TLS extension is built
        assert result["stack_cipher_cpu_s_per_round"] > 0 and result["stack_aes_gcm_gb_s"] > 0
        assert "tls_cpu_over_stack_cipher" in result
    assert result["records"] == tls.records_between_native_ends()  # the same environment as the runs
