"""The runs side of `hfleet ui` in headless Chromium: the runs list (status, duration, joint metric, bytes,
framework, newest first, a run that trained nothing flagged), the run page (plots inline, model and
registry version, bytes by site and kind, process logs as text/plain), compare runs (accuracy overlaid,
spec side by side); refusals change nothing and no run folder content yields a 500.

Run folders are written as `hfleet run` leaves them (same files and fields); the slow test reads a real
demo run. Each page's screenshot is kept under $HFLEET_UI_SCREENSHOTS (default tests/artifacts/ui/).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from tests.browser import chromium_page, pixel_stddev, save_screenshot
from tests.test_ui import in_process_ui

XSS = "<script>alert(1)</script>"
DEAD_PID = 999999999


def _worker_metrics(site: str, worker: int, steps: int, sent_per_step: int, acc0: float,
                    t0: float = 1.7e9) -> list[dict]:
    out = []
    for step in range(10, steps + 1, 10):
        out.append({"ts": t0 + step, "process": f"worker-{site}-{worker}", "site": site, "rank": worker,
                    "step": step, "elapsed_s": step / 10, "loss": 1.0 / step, "test_accuracy": acc0 + step / 1000,
                    "sent": step * sent_per_step, "received": step * sent_per_step,
                    "sent_gradients": step * (sent_per_step - 10), "sent_control": step * 10,
                    "phase_s": {"compute": step / 100, "encode": 0.0, "transfer": step / 200, "wait": 0.0}})
    return out


def write_run(root: Path, job: str, stamp: str, *, framework: str = "torch", sync: str = "bsp", steps: int = 40,
              summary: dict | None = None, events: list[dict] | None = None, metrics: list[dict] | None = None,
              logs: dict[str, str] | None = None, started: float = 1.7e9, mtime: float | None = None) -> Path:
    """A run directory with run.json, events.jsonl, metrics.jsonl and, when given, summary.json and logs/."""
    run = root / job / stamp
    (run / "logs").mkdir(parents=True)
    info = {"job": job, "framework": framework, "sync": sync, "pid": DEAD_PID, "started": started, "steps": steps,
            "sites": ["cloud", "hospital"], "resumed_from": None}
    (run / "run.json").write_text(json.dumps(info))
    records = metrics if metrics is not None else (_worker_metrics("hospital", 0, steps, 100, 0.8)
                                                   + _worker_metrics("cloud", 1, steps, 200, 0.7))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    evs = events if events is not None else [{"ts": 1.7e9, "process": "shard-0", "event": "start"},
                                             {"ts": 1.7e9 + 30, "process": "shard-0", "event": "exit", "returncode": 0}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    for name, text in (logs or {}).items():
        (run / "logs" / name).write_text(text)
    if mtime is not None:
        os.utime(run, (mtime, mtime))
    return run


def completed_summary(job: str, framework: str = "torch", accuracy: float = 0.97) -> dict:
    return {"job": job, "framework": framework, "sync": "bsp", "shards": 2, "workers": 2, "status": "completed",
            "test_accuracy": accuracy, "test_accuracy_source": "the saved model (worker-hospital-0's final report)",
            "site_alone_accuracy": {"hospital": 0.86, "cloud": 0.78},
            "bytes_sent_by_site": {"hospital": 4000, "cloud": 8_000_000},
            "bytes_received_by_site": {"hospital": 3900, "cloud": 7_900_000},
            "bytes_sent_by_kind": {"hospital": {"gradients": 3600, "control": 400},
                                   "cloud": {"gradients": 7_999_600, "control": 400}},
            "restarts": 0, "wall_s": 125.0,
            "model": {"url": "file:///runs/model", "final_step": 40, "best_step": 30,
                      "registered": {"published": True, "name": "demo/digits", "version": 3, "alias": "staging",
                                     "message": "registered demo/digits v3 as staging (gate passed)"}}}


@pytest.fixture
def three_runs(tmp_path) -> Path:
    """A completed torch run (oldest, its folder changed last), a stopped paddle run, and a completed run that
    trained nothing (newest)."""
    root = tmp_path / "runs"
    write_run(root, "digits", "r1-done", summary=completed_summary("digits"), mtime=1.7e9 + 900,
              logs={"worker-hospital-0.log": f"step 10 {XSS}\n", "shard-0.log": "serving\n"})
    t0 = 1.7e9 + 100
    stop = [{"ts": t0, "process": "shard-0", "event": "start"},
            {"ts": t0 + 2, "process": "worker-hospital-0", "event": "start"},
            {"ts": t0 + 12, "process": "worker-hospital-0", "event": "stop"},
            {"ts": t0 + 12, "process": "shard-0", "event": "stop"}]
    slower = _worker_metrics("hospital", 0, 40, 100, 0.5, t0) + _worker_metrics("cloud", 1, 40, 200, 0.6, t0)
    write_run(root, "digits-paddle", "r2-stopped", framework="paddle", sync="ssp", events=stop, metrics=slower,
              started=t0)
    empty = {**completed_summary("digits"), "bytes_sent_by_site": {"hospital": 0, "cloud": 0},
             "bytes_sent_by_kind": {}, "model": None}
    write_run(root, "digits", "r3-empty", summary=empty, metrics=[], started=1.7e9 + 200)
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ pages in the browser
def test_runs_list_shows_status_duration_metric_bytes_framework_newest_first_and_flags_an_empty_run(three_runs):
    with in_process_ui(three_runs) as url, chromium_page() as page:
        # Execute
        page.goto(url + "/")
        rows = page.locator("#runs tr.run").all_inner_texts()
        empty_rows = page.locator("#runs tr.empty").all_inner_texts()
        save_screenshot(page, "runs-list")
    # Assert: newest started first
    assert [re.search(r"r\d-\w+", r).group(0) for r in rows] == ["r3-empty", "r2-stopped", "r1-done"]
    empty, stopped, done = rows
    assert "COMPLETED" in done and "2m05s" in done and "0.97" in done and "the saved model" in done
    assert "hospital 4.0 kB" in done and "cloud 8.0 MB" in done and "torch" in done and "40/40" in done
    assert "STOPPED" in stopped and "paddle" in stopped and "40s" in stopped and "hospital 4.0 kB" in stopped
    assert "trained nothing" in empty and "cloud 0 B" in empty and "0/40" in empty
    assert len(empty_rows) == 1 and "r3-empty" in empty_rows[0]


def test_run_page_shows_plots_model_registry_version_bytes_by_kind_and_log_links(three_runs):
    with in_process_ui(three_runs) as url, chromium_page() as page:
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        # Execute
        page.goto(url + "/runs/digits/r1-done")
        page.wait_for_load_state("networkidle")
        widths = page.eval_on_selector_all("#plots img", "imgs => imgs.map(i => i.naturalWidth)")
        loss_plot = page.locator("#plots img").first.screenshot()
        model = page.locator("#model").inner_text()
        by_kind = page.locator("#bytes").inner_text()
        summary = page.locator("#summary").inner_text()
        save_screenshot(page, "run-page")
        page.click("text=worker-hospital-0.log")
        log_type = page.evaluate("document.contentType")
        log_text = page.locator("body").inner_text()
        save_screenshot(page, "run-log")
    # Assert
    assert len(widths) == 6 and all(w == 800 for w in widths), widths
    assert pixel_stddev(loss_plot) > 10
    assert "demo/digits v3 as staging" in model and "40 / 30" in model
    assert "gradients 3.6 kB" in by_kind and "control 400 B" in by_kind and "cloud\t8.0 MB" in by_kind
    assert "0.97 (the saved model" in summary and "2m05s" in summary
    assert log_type == "text/plain" and XSS in log_text and dialogs == []


def test_compare_two_ticked_runs_overlays_their_accuracy_and_diffs_their_spec(three_runs):
    with in_process_ui(three_runs) as url, chromium_page() as page:
        # Execute
        page.goto(url + "/")
        page.check("input[value='digits/r1-done']")
        page.check("input[value='digits-paddle/r2-stopped']")
        page.click("#compare-button")
        page.wait_for_url(re.compile(r"/compare\?"))
        page.wait_for_load_state("networkidle")
        plot_width = page.eval_on_selector("#compare-plot", "i => i.naturalWidth")
        plot = page.locator("#compare-plot").screenshot()
        differs = page.locator("#spec-diff tr.differs").all_inner_texts()
        same = page.locator("#spec-diff tr.same").all_inner_texts()
        save_screenshot(page, "compare")
    # Assert
    assert plot_width == 800 and pixel_stddev(plot) > 10
    assert any(r.startswith("framework") and "torch" in r and "paddle" in r for r in differs), differs
    assert any(r.startswith("sync") and "bsp" in r and "ssp" in r for r in differs)
    assert any(r.startswith("steps") for r in same)


@pytest.mark.slow
def test_a_real_run_page_shows_its_registered_model_plots_and_logs(demo_run, tmp_path):
    # Prepare
    runs = demo_run.run_dir.parent.parent
    run_id = f"{demo_run.run_dir.parent.name}/{demo_run.run_dir.name}"
    registered = demo_run.summary["model"]["registered"]
    with in_process_ui(runs) as url, chromium_page() as page:
        # Execute
        page.goto(url + "/")
        row = page.locator("#runs tr", has_text=demo_run.run_dir.name).inner_text()
        page.goto(f"{url}/runs/{run_id}")
        page.wait_for_load_state("networkidle")
        widths = page.eval_on_selector_all("#plots img", "imgs => imgs.map(i => i.naturalWidth)")
        model = page.locator("#model").inner_text()
        logs = page.locator("#logs a").all_inner_texts()
        save_screenshot(page, f"real-run-{demo_run.framework}")
        log = httpx.get(f"{url}/runs/{run_id}/logs/shard-0.log")
    # Assert
    assert "COMPLETED" in row and demo_run.framework in row and "trained nothing" not in row
    assert f"{registered['name']} v{registered['version']}" in model
    assert all(w == 800 for w in widths) and len(widths) == 6
    assert "shard-0.log" in logs and any(n.startswith("worker-") for n in logs)
    assert log.status_code == 200 and log.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("events, status", [
    # Ctrl-C / SIGTERM while workers train: the supervisor stops the workers and exits 130 / 143
    ([("shard-0", "start"), ("worker-a-0", "start"), ("worker-a-0", "stop"), ("shard-0", "stop")], "stopped"),
    # Ctrl-C while the shards start: no worker yet
    ([("shard-0", "start"), ("shard-0", "stop")], "stopped"),
    # every worker exited, the shards were stopped as at a normal end, and then no summary: a crash
    ([("shard-0", "start"), ("worker-a-0", "start"), ("worker-a-0", "exit"), ("shard-0", "stop")], "crashed"),
    ([("shard-0", "start"), ("worker-a-0", "start")], "crashed"),
])
def test_a_run_without_summary_is_stopped_only_when_the_supervisor_stopped_it_early(tmp_path, events, status):
    from hybridfleet.obs.runinfo import load_run

    run = write_run(tmp_path, "digits", "r", events=[{"ts": 1.7e9 + i, "process": p, "event": e}
                                                     for i, (p, e) in enumerate(events)])
    assert load_run(run).status == status


# ------------------------------------------------------------------ refusals and hostile folders
def test_compare_with_fewer_than_two_or_unknown_runs_is_refused_and_changes_nothing(three_runs):
    before = _files(three_runs)
    with in_process_ui(three_runs) as url:
        # Execute
        one = httpx.get(url + "/compare", params={"run": "digits/r1-done"})
        unknown = httpx.get(url + "/compare", params=[("run", "digits/r1-done"), ("run", "../../etc")])
        plot = httpx.get(url + "/compare.png", params={"run": "digits/r1-done"})
    # Assert
    assert one.status_code == 400 and "pick at least 2 runs to compare" in one.text
    assert unknown.status_code == 404 and "no such run" in unknown.text
    assert plot.status_code == 400
    assert _files(three_runs) == before


def test_logs_outside_the_runs_logs_folder_are_not_served(three_runs, tmp_path):
    # Prepare: a link inside logs/ to a file outside the run, and a file that is no log
    secret = tmp_path / "secret.log"
    secret.write_text("the CA key\n")
    logs = three_runs / "digits" / "r1-done" / "logs"
    (logs / "leak.log").symlink_to(secret)
    (logs / "notes.txt").write_text("not a log\n")
    before = _files(three_runs)
    with in_process_ui(three_runs) as url:
        # Execute
        answers = {path: httpx.get(url + path) for path in (
            "/runs/digits/r1-done/logs/leak.log", "/runs/digits/r1-done/logs/notes.txt",
            "/runs/digits/r1-done/logs/..%2Frun.json", "/runs/digits/r1-done/logs/nope.log")}
        page = httpx.get(url + "/runs/digits/r1-done").text
    # Assert
    for path, answer in answers.items():
        assert answer.status_code == 404, path
        assert "the CA key" not in answer.text and '"job"' not in answer.text
    assert "leak.log" not in page and "notes.txt" not in page
    assert _files(three_runs) == before


def test_no_run_folder_content_yields_a_500_and_every_value_is_escaped(tmp_path):
    # Prepare: fields of the wrong type, markup everywhere, half-written lines
    root = tmp_path / "runs"
    bad_summary = {"job": XSS, "status": "completed", "test_accuracy": 0.5, "test_accuracy_source": XSS,
                   "bytes_sent_by_site": {XSS: 5}, "bytes_sent_by_kind": {XSS: {XSS: 5}},
                   "model": {"url": XSS, "final_step": XSS, "registered": {"published": True, "name": XSS,
                                                                             "version": "one", "message": XSS}}}
    write_run(root, "x", "hostile", summary=bad_summary, logs={"a.log": XSS},
              metrics=[{"process": "worker-a-0", "site": XSS, "step": "ten", "test_accuracy": "high",
                        "sent": -5, "sent_" + XSS: "x"}, {"process": "worker-a-0", "step": 3, "test_accuracy": True}])
    write_run(root, "x", "wrong-types", summary={"status": "completed", "bytes_sent_by_kind": {"a": {"b": "many"}},
                                                 "model": [1, 2], "test_accuracy_source": 7})
    broken = write_run(root, "x", "half-written")
    (broken / "metrics.jsonl").write_text('{"process": "worker-a-0", "step": 5\n[1, 2]\n')
    (broken / "summary.json").write_text("{not json")
    with in_process_ui(root) as url:
        # Execute
        bodies = {path: httpx.get(url + path) for path in (
            "/", "/runs/x/hostile", "/runs/x/wrong-types", "/runs/x/half-written",
            "/compare?run=x/hostile&run=x/wrong-types&run=x/half-written",
            "/compare.png?run=x/hostile&run=x/half-written",
            *(f"/runs/x/{r}/plots/{k}.png" for r in ("hostile", "half-written")
              for k in ("loss", "accuracy", "bytes", "phases", "stragglers", "events")))}
    # Assert
    for path, answer in bodies.items():
        assert answer.status_code == 200, (path, answer.status_code, answer.text[-500:])
        assert "<script>" not in answer.text, path
    assert "&lt;script&gt;" in bodies["/runs/x/hostile"].text
    wrong = bodies["/runs/x/wrong-types"].text
    assert "BROKEN" in wrong and "bytes_sent_by_kind" in wrong and "&#39;model&#39; must be an object or null" in wrong


def test_a_live_run_page_counts_worker_steps_reloads_itself_and_does_not_call_summary_missing(tmp_path):
    # Prepare: a run whose supervisor (this test process) is alive, 20 of 40 steps reported
    run = write_run(tmp_path, "digits", "live", metrics=_worker_metrics("hospital", 0, 20, 100, 0.8))
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "pid": os.getpid()}))
    with in_process_ui(tmp_path) as url:
        # Execute
        body = httpx.get(url + "/runs/digits/live").text
    # Assert
    assert "LIVE" in body and "worker step 20 of 40" in body and "worker steps (sum over the site" in body
    assert '<meta http-equiv="refresh" content="5">' in body
    assert "Missing: summary.json" not in body and "trained nothing" not in body
