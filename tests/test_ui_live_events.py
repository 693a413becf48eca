"""A live run's page follows the run by server-sent events: a real HTTP client reads
``/runs/JOB/STAMP/events`` of a live run folder (written by the test as `hfleet run` writes it) and sees
an update after a file changes and the ``end`` event once the run ends; the number of open streams is
capped (503 with its reason); a bad path is refused (404) and changes nothing. In headless Chromium the
page's figure changes without a reload, through /static/live.js.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from hybridfleet.obs.discovery import Target, write_targets
from tests.browser import chromium_page
from tests.test_obs_live_sites import worker_endpoint
from tests.test_ui import in_process_ui
from tests.test_ui_runs import _files, _worker_metrics, completed_summary, write_run

POLL_S = 0.1


def _live_run(root: Path) -> Path:
    """A run whose supervisor (this test process) is alive, 20 of 40 steps reported by the hospital worker."""
    run = write_run(root, "digits", "live", metrics=_worker_metrics("hospital", 0, 20, 100, 0.8),
                    events=[{"ts": 1.7e9, "process": "shard-0", "event": "start"}])
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "pid": os.getpid()}))
    return run


def _report_step(run: Path, step: int) -> None:
    """Append the hospital worker's report of ``step`` to metrics.jsonl, as a running worker does."""
    record = _worker_metrics("hospital", 0, step, 100, 0.8)[-1]
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def _events(lines):
    """(name, data) per server-sent event read from ``lines``."""
    name, data = None, []
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and name is not None:
            yield name, json.loads("\n".join(data))
            name, data = None, []


def test_the_event_stream_sends_an_update_after_a_file_changes_and_ends_when_the_run_ends(tmp_path):
    # Prepare
    run = _live_run(tmp_path)
    seen = []
    with in_process_ui(tmp_path, poll_s=POLL_S) as url, \
            httpx.stream("GET", f"{url}/runs/digits/live/events", timeout=20) as response:
        kind = response.headers["content-type"]
        events = _events(response.iter_lines())
        seen.append(next(events))
        # Execute: a worker reports step 30, then the run ends (summary.json written)
        _report_step(run, 30)
        seen.append(next(events))
        (run / "summary.json").write_text(json.dumps(completed_summary("digits")))
        seen += list(events)  # the server ends the stream after `end`
    # Assert
    assert kind.startswith("text/event-stream")
    first, update = seen[0], seen[1]
    assert first[0] == "progress" and "worker step 20 of 40" in first[1]["progress"] and first[1]["status"] == "live"
    assert update[0] == "progress" and "worker step 30 of 40" in update[1]["progress"]
    assert seen[-1] == ("end", {"status": "completed"})
    assert all(name == "progress" for name, _ in seen[:-1])


def test_streams_beyond_the_cap_are_refused_with_503_and_a_reason_and_a_closed_one_frees_its_slot(tmp_path):
    # Prepare: at most one stream
    _live_run(tmp_path)
    with in_process_ui(tmp_path, max_streams=1, poll_s=POLL_S) as url:
        with httpx.stream("GET", f"{url}/runs/digits/live/events", timeout=20) as first:
            events = _events(first.iter_lines())  # kept: a dropped reader closes the connection
            next(events)
            # Execute
            refused = httpx.get(f"{url}/runs/digits/live/events", timeout=20)
        statuses = []
        for _ in range(100):  # the server notices the closed stream at its next poll
            with httpx.stream("GET", f"{url}/runs/digits/live/events", timeout=20) as again:
                statuses.append(again.status_code)
                if again.status_code == 200:
                    opened = next(_events(again.iter_lines()))
                    break
            time.sleep(POLL_S)
    # Assert
    assert refused.status_code == 503 and "too many live streams open (at most 1)" in refused.text
    assert statuses[-1] == 200 and set(statuses[:-1]) <= {503} and opened[0] == "progress"


def test_a_bad_run_path_is_refused_with_404_and_changes_nothing(tmp_path):
    # Prepare
    _live_run(tmp_path)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "run.json").write_text("{}")
    before = _files(tmp_path)
    with in_process_ui(tmp_path / "digits", max_streams=1, poll_s=POLL_S) as url:
        # Execute
        answers = [httpx.get(url + path, timeout=20) for path in
                   ("/runs/digits/nope/events", "/runs/..%2F..%2Fsecret/x/events", "/runs/.hidden/live/events")]
        with httpx.stream("GET", f"{url}/runs/live/../../secret/events", timeout=20) as odd:
            odd_status = odd.status_code
    with in_process_ui(tmp_path, max_streams=1, poll_s=POLL_S) as url:
        with httpx.stream("GET", f"{url}/runs/digits/live/events", timeout=20) as good:
            good_status = good.status_code
    # Assert: refused, and the refusals took no stream slot (the one slot still serves a good path)
    assert [a.status_code for a in answers] == [404, 404, 404] and odd_status == 404
    assert all("text/event-stream" not in a.headers["content-type"] for a in answers)
    assert good_status == 200
    assert _files(tmp_path) == before


def test_the_live_page_updates_its_figures_without_a_reload(tmp_path):
    # Prepare: a live run whose hospital worker serves its metrics (a real prometheus endpoint)
    run = _live_run(tmp_path)
    with worker_endpoint(20, 2000, 1900, test_accuracy=0.82) as (address, close_worker), \
            in_process_ui(tmp_path, poll_s=POLL_S) as url, chromium_page() as page:
        from playwright.sync_api import expect

        write_targets(run, [Target(address, {"job": "digits", "role": "worker", "site": "hospital",
                                             "process": "worker-hospital-0"})])
        errors = []  # script errors (a CSP refusal among them) and failed loads other than the browser's favicon
        page.on("console", lambda m: errors.append(m.text)
                if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
        page.on("response", lambda r: errors.append(f"{r.status} {r.url}")
                if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)
        page.goto(url + "/runs/digits/live")
        expect(page.locator("#progress")).to_contain_text("worker step 20 of 40")
        first_row = page.locator("#sites tr >> nth=1").inner_text()
        page.evaluate("window.notReloaded = true")
        # Execute: a worker reports step 30; then it exits (its endpoint closes, the supervisor logs the exit)
        _report_step(run, 30)
        expect(page.locator("#progress")).to_contain_text("worker step 30 of 40", timeout=15000)
        close_worker()
        with (run / "events.jsonl").open("a") as f:
            f.write(json.dumps({"ts": 1.7e9 + 40, "process": "worker-hospital-0", "event": "exit",
                                "returncode": 0}) + "\n")
        expect(page.locator("#sites tr.final")).to_contain_text("0/1 (1 exited, code 0) · final", timeout=15000)
        exited_row = page.locator("#sites tr >> nth=1").inner_text()
        kept = page.evaluate("window.notReloaded === true")
        (run / "summary.json").write_text(json.dumps(completed_summary("digits")))
        expect(page.locator("#status")).to_have_text("COMPLETED", timeout=15000)
        note = page.locator("#live").inner_text()
        page.goto("about:blank")  # closes the stream before the server stops
    # Assert
    assert kept, "the page reloaded instead of updating in place"
    assert first_row.split("\t")[:3] == ["hospital", "1/1", "20"] and "0.820" in first_row
    # an exited worker keeps its last logged figures (metrics.jsonl: step 30, accuracy 0.830)
    assert exited_row.split("\t") == ["hospital", "0/1 (1 exited, code 0) · final", "30", "3.0 kB", "3.0 kB", "0.830"]
    assert "The run has ended (completed)" in note
    assert errors == []
