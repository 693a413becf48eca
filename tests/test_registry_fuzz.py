"""A short run of the REST fuzzer (bench/fuzz_rest.py, Schemathesis from the server's own OpenAPI
schema against a live `hfleet registry serve`): no generated request gets a 5xx or hangs."""

from __future__ import annotations

import pytest

from tests.test_bench_smoke import last_json, run_bench

pytestmark = pytest.mark.torch  # the served model is a torch checkpoint


def test_generated_requests_never_get_a_server_error_or_hang():
    pytest.importorskip("schemathesis", reason="schemathesis not installed: pip install 'hybridfleet[dev]'")
    proc = run_bench("fuzz_rest.py", "--quick", timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["bench"] == "fuzz_rest" and result["requests"] >= 300
    assert result["server_errors"] == 0, proc.stderr[-3000:]
    assert result["hangs"] == 0 and result["transport_errors"] == 0 and result["server_alive"]
    assert sum(result["statuses"].values()) == result["requests"]
    assert result["statuses"].get("200", 0) > 0 and result["statuses"].get("401", 0) > 0  # both tokens and refusals ran
