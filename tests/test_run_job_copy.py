"""A run keeps the job as it ran (``job.json``: the resolved spec, secrets redacted) and the compare page diffs
those copies; a real `hfleet run` writing it is checked in tests/test_obs_live_tty.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import yaml

from hybridfleet.obs.runinfo import load_run
from hybridfleet.spec import load_spec
from hybridfleet.spec.resolved import REDACTED, resolved_job
from hybridfleet.ui.compare import spec_diff
from tests.test_ui import in_process_ui
from tests.test_ui_runs import completed_summary, write_run

REPO = Path(__file__).resolve().parents[1]


def _spec(tmp_path: Path, **changes):
    data = yaml.safe_load((REPO / "examples" / "digits-hybrid.yaml").read_text())
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def test_the_copy_is_the_resolved_spec_with_every_secret_redacted(tmp_path):
    # Prepare
    spec = _spec(tmp_path, **{"registry.url": "postgresql://ops:hunter2@db.internal:5432/registry",
                              "checkpoint.store": "s3://AKIDEXAMPLE:s3cr3t@minio.local/ckpt",
                              "args": ["--api-token=abc123", "--password", "pw9", "--width", "64"]})
    # Execute
    copy = resolved_job(spec)
    text = json.dumps(copy)
    # Assert: the secrets are gone, everything else is the spec as it runs (defaults filled in)
    assert "hunter2" not in text and "s3cr3t" not in text and "abc123" not in text and "pw9" not in text
    assert copy["registry"]["url"] == f"postgresql://ops:{REDACTED}@db.internal:5432/registry"
    assert copy["checkpoint"]["store"] == f"s3://AKIDEXAMPLE:{REDACTED}@minio.local/ckpt"
    assert copy["args"] == [f"--api-token={REDACTED}", "--password", REDACTED, "--width", "64"]
    assert copy["security"]["tokens"] == "auto" and copy["security"]["token_ttl_s"] == spec.security.token_ttl_s
    plain = spec.model_dump(mode="json")
    for key in ("registry", "checkpoint", "args"):
        plain.pop(key), copy.pop(key)
    assert copy == plain


def test_compare_diffs_the_runs_job_copies_not_their_pids_or_start_times(tmp_path):
    # Prepare: two finished runs of one job, with another learning rate and registry password
    root = tmp_path / "runs"
    specs = [_spec(tmp_path, **{"ps.optimizer.lr": lr, "registry.url": f"postgresql://u:{pw}@db/r"})
             for lr, pw in ((0.003, "one"), (0.01, "two"))]
    dirs = []
    for i, spec in enumerate(specs):
        run = write_run(root, "digits", f"r{i}", summary=completed_summary("digits"), started=1.7e9 + i)
        (run / "job.json").write_text(json.dumps(resolved_job(spec)))
        dirs.append(run)
    before = {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    # Execute
    rows = {r["key"]: r for r in spec_diff([load_run(d) for d in dirs])}
    with in_process_ui(root) as url:
        page = httpx.get(url + "/compare", params=[("run", "digits/r0"), ("run", "digits/r1")], timeout=30)
    # Assert
    assert rows["ps.optimizer.lr"]["differs"] and rows["ps.optimizer.lr"]["cells"] == ["0.003", "0.01"]
    assert not rows["registry.url"]["differs"] and rows["registry.url"]["cells"][0] == f"postgresql://u:{REDACTED}@db/r"
    assert not rows["sites.hospital.workers"]["differs"] and "pid" not in rows and "started" not in rows
    assert page.status_code == 200 and "ps.optimizer.lr" in page.text and "u:one@" not in page.text
    assert {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_a_job_copy_that_is_not_an_object_marks_the_run_broken_and_compare_still_answers(tmp_path):
    # Prepare
    root = tmp_path / "runs"
    good = write_run(root, "digits", "r0", summary=completed_summary("digits"))
    bad = write_run(root, "digits", "r1", summary=completed_summary("digits"))
    (bad / "job.json").write_text("[1, 2]")
    # Execute
    with in_process_ui(root) as url:
        page = httpx.get(url + "/compare", params=[("run", "digits/r0"), ("run", "digits/r1")], timeout=30)
    # Assert
    assert load_run(bad).problems == ["job.json holds a JSON list, not an object"] and load_run(good).job_spec is None
    assert page.status_code == 200
