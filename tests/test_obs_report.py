"""`hfleet report`: the report of a real demo run opened in headless Chromium (titles, drawn plots),
and bad input: missing, foreign, crashed/half-written and live run directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridfleet.errors import ReportError
from hybridfleet.obs.report import SECTIONS, write_report
from tests.browser import chromium_page, pixel_stddev

REPO = Path(__file__).resolve().parents[1]
TITLES = [title for _, title, _ in SECTIONS]


def _hfleet(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "hybridfleet", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow
def test_demo_report_opens_in_chromium_with_every_title_and_drawn_plots(demo_run, tmp_path):
    # Prepare: `hfleet run` wrote the report at the end and printed its path
    report = demo_run.run_dir / "report.html"
    assert demo_run.summary["report"] == str(report) and report.is_file()
    with chromium_page() as page:
        # Execute
        page.goto(report.as_uri())
        shot = page.screenshot(full_page=True)
        (tmp_path / f"report-{demo_run.framework}.png").write_bytes(shot)
        headings = page.locator("h2").all_inner_texts()
        status = page.locator("#status").inner_text()
        images = page.locator("img")
        plots = [images.nth(i).screenshot() for i in range(images.count())]
        natural = page.evaluate("Array.from(document.images).map(i => [i.naturalWidth, i.complete])")
        # Assert
        assert page.title() == f"{demo_run.summary['job']} run report"
        assert status == "COMPLETED"
        assert headings == ["Summary", *TITLES]
        assert len(plots) == len(TITLES)  # every plot has data in the demo
        assert all(w > 0 and done for w, done in natural)
        assert all(pixel_stddev(p) > 10 for p in plots), [round(pixel_stddev(p), 1) for p in plots]
    assert {p.name for p in (demo_run.run_dir / "report").iterdir()} == {f"{k}.png" for k, _, _ in SECTIONS}


def test_report_of_a_missing_directory_is_a_clear_error_and_writes_nothing(tmp_path):
    # Execute
    result = _hfleet("report", str(tmp_path / "nope"))
    # Assert
    assert result.returncode == 15
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "nope").exists()


def test_report_of_a_foreign_directory_is_refused_and_leaves_it_unchanged(tmp_path):
    # Prepare
    (tmp_path / "notes.txt").write_text("hello")
    before = sorted(p.name for p in tmp_path.iterdir())
    # Execute
    result = _hfleet("report", str(tmp_path))
    # Assert
    assert result.returncode == 15
    assert "is not a hybridfleet run directory" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _crashed_run(src: Path, dst: Path) -> Path:
    """A copy of a real run as a crash leaves it: no summary.json, a half-written last line, a dead pid."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report*", "summary.json", "certs", "snapshots"))
    with (dst / "metrics.jsonl").open("a") as f:
        f.write('{"ts": 1, "event": "metrics", "proc')
    info = json.loads((dst / "run.json").read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    info["pid"] = dead.pid
    (dst / "run.json").write_text(json.dumps(info))
    return dst


@pytest.mark.slow
def test_report_of_a_crashed_half_written_run_is_partial_and_says_what_is_missing(demo_run, tmp_path):
    # Prepare
    run = _crashed_run(demo_run.run_dir, tmp_path / "run")
    # Execute
    result = _hfleet("report", str(run))
    # Assert
    assert result.returncode == 0, result.stderr
    assert "status crashed" in result.stdout and "summary.json" in result.stdout
    page = (run / "report.html").read_text()
    assert "CRASHED" in page and "Missing: summary.json" in page and "1 unreadable line" in page


def test_report_of_a_live_run_says_live_not_failed(tmp_path):
    # Prepare: this test process plays the live supervisor
    run = tmp_path / "runs" / "job" / "20260101-000000"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"job": "job", "pid": os.getpid(), "started": 1.0}))
    (run / "metrics.jsonl").write_text(json.dumps({"event": "metrics", "process": "worker-a-0", "site": "a",
                                                   "step": 10, "loss": 0.5, "elapsed_s": 1.0}) + "\n")
    # Execute
    path = write_report(run)
    # Assert
    page = path.read_text()
    assert "LIVE" in page and "still in progress" in page and "FAILED" not in page


def test_report_error_is_a_value_error_with_its_own_exit_code():
    assert issubclass(ReportError, ValueError)
