"""Honest egress figures: every sent byte is counted by kind, and the egress test mode finds a
site's training rows in what it sent when they are there (positive control) and reports none
for a real `hfleet run` job, with torch and with paddle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.ps.worker.egress import EgressCapture, scan_rows
from tests.ps_helpers import PARAMS, raw, start_cluster

REPO = Path(__file__).resolve().parents[1]


def test_scan_finds_rows_in_each_encoding_and_nothing_in_other_bytes():
    rows = np.arange(40 * 8, dtype=np.float32).reshape(40, 8) / 7
    noise = np.random.default_rng(0).bytes(100_000)
    capture = noise[:500] + rows[3].astype("<f8").tobytes() + noise[500:900] + rows[17].astype("<f4").tobytes()
    result = scan_rows(capture, rows)
    assert result == {"bytes_scanned": len(capture), "rows_scanned": 40, "rows_found": 2, "first_found": 3}
    assert scan_rows(noise, rows)["rows_found"] == 0


def test_client_capture_holds_every_counted_byte_and_a_leaked_row_is_found(tmp_path):
    # Prepare: a client in the capture mode whose INIT push carries a training row as parameter values
    cluster = start_cluster(tmp_path)
    try:
        client = cluster.client("a")
        client.bytes.capture = EgressCapture(tmp_path / "egress.bin")
        client.join(PARAMS, cluster.spec.ps.block_size_bytes, "none", "torch")
        rows = np.random.default_rng(1).normal(size=(30, 12)).astype(np.float32)
        leaked = {"fc.weight": rows[5], "fc.bias": np.zeros(4, np.float32)}  # a careless program's bug
        blocks = {}
        for name, arr in leaked.items():
            blocks.update(client.plan.split(name, arr.reshape(-1)))
        client.push(raw(blocks), codec="none", kind="INIT")
        client.pull(full=True)
        _, counted = client.bytes.stop_capture()
        captured = (tmp_path / "egress.bin").read_bytes()
        # Assert: what was captured is exactly what was counted, and the leaked row is found
        assert len(captured) == counted
        assert set(client.bytes.sent) >= {"control", "framing", "init"}
        result = scan_rows(captured, rows)
        assert result["rows_found"] == 1 and result["first_found"] == 5
        client.close()
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("example", ["digits-hybrid.yaml", "digits-hybrid-paddle.yaml"])
def test_hfleet_run_egress_scan_finds_no_training_row(tmp_path, example):
    from hybridfleet.launch.psjob import run_ps_job
    from hybridfleet.spec import load_spec

    data = yaml.safe_load((REPO / "examples" / example).read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["train"].update(steps=40, site_baselines=False, eval_every_steps=0)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    summary = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "runs",
                         egress_scan=True)
    assert summary["status"] == "completed", summary
    scan = summary["egress_scan"]
    assert set(scan) == {"hospital", "cloud"}
    for site, s in scan.items():
        assert s["workers_scanned"] == 2 and s["rows_scanned"] > 100 and s["rows_found"] == 0, (site, s)
        # the scan covered what the site's workers sent up to their scan (all but the final Leave)
        assert 0.99 * summary["bytes_sent_by_site"][site] <= s["bytes_scanned"] <= summary["bytes_sent_by_site"][site]
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["egress_scan"] == scan
