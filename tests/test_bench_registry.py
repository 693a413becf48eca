"""bench/registry.py runs end to end with --quick and ends with its JSON line (figures never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_registry_bench_quick_reports_the_issue_keys():
    pytest.importorskip("mlflow", reason="the bench extra (mlflow-skinny) is part of the dev extra")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "registry.py"), "--quick"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "registry"
    for key in ("resolve_vs_mlflow", "search_vs_mlflow", "register_copy_fraction", "rest_resolve_p95_ms"):
        assert result[key] > 0
    assert result["already_in_store_copied_bytes"] == 0
    assert "resolve by alias p95 (ms)" in proc.stdout
