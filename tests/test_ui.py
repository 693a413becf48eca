"""`hfleet ui` in headless Chromium: click from the runs list to a finished run and its report, and to a
live run with its progress; refusals: no token beyond loopback, a busy port, unknown runs."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from hybridfleet.obs.runinfo import load_run
from tests.browser import chromium_page, pixel_stddev
from tests.obs_fixtures import DEMO_STEPS, demo_job

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}


@contextmanager
def ui_server(runs: Path, *extra: str):
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "ui", "--runs", str(runs), "--port", "0", *extra],
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stderr.readline()
        match = re.search(r"http://([\d.]+):(\d+)/", line)
        assert match, line + proc.stderr.read()
        url = f"http://{match.group(1)}:{match.group(2)}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/api/runs", timeout=1)
                break
            except urllib.error.HTTPError:
                break  # answering (with 401 when a token is required)
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_click_from_runs_to_a_finished_run_and_its_report(demo_run, tmp_path):
    # Prepare
    runs = demo_run.run_dir.parent.parent
    with ui_server(runs) as url, chromium_page() as page:
        # Execute
        page.goto(url + "/")
        row = page.locator("#runs tr", has_text=demo_run.run_dir.name)
        row_text = row.inner_text()
        row.locator("a").click()
        page.wait_for_url(re.compile(r"/runs/"))
        detail = page.locator("body").inner_text()
        page.click("#report-link")
        page.wait_for_url(re.compile(r"/report$"))
        shot = page.screenshot(full_page=True)
        (tmp_path / "ui-report.png").write_bytes(shot)
        headings = page.locator("h2").all_inner_texts()
        first_plot = page.locator("img").first.screenshot()
        # Assert
        assert "COMPLETED" in row_text and f"{DEMO_STEPS}/{DEMO_STEPS}" in row_text
        assert "Summary" in detail and "joint test accuracy" in detail and "COMPLETED" in detail
        assert any(h.startswith("Training loss (lower is better)") for h in headings), headings
        assert any(h.startswith("Test accuracy (higher is better)") for h in headings), headings
        assert "Restarts and events" in headings
        assert pixel_stddev(first_plot) > 10


@pytest.mark.slow
@pytest.mark.torch  # the live run is the torch demo
def test_click_to_a_live_run_shows_live_progress_per_site(tmp_path):
    # Prepare: a long job with one worker a site, stopped once seen
    runs = tmp_path / "runs"
    job = demo_job(tmp_path, "torch", steps=5000)
    data = yaml.safe_load(job.read_text())
    for site in data["sites"].values():
        site["workers"] = 1
    job.write_text(yaml.safe_dump(data))
    run = subprocess.Popen([sys.executable, "-m", "hybridfleet", "run", str(job), "--quiet", "--no-baselines",
                            "--run-root", str(runs)], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        # the UI and the browser start while the run does
        with ui_server(runs) as url, chromium_page() as page:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not list(runs.glob("*/*/metrics.jsonl")):
                time.sleep(0.5)
            # Execute
            page.goto(url + "/")
            listed = page.locator("#runs").inner_text()
            page.locator("#runs a").first.click()
            page.wait_for_url(re.compile(r"/runs/"))
            sites = ""
            while time.monotonic() < deadline:
                page.reload()
                sites = page.locator("#sites").inner_text()
                if re.search(r"hospital\s+1/1\s+[1-9]", sites) and re.search(r"cloud\s+1/1\s+[1-9]", sites):
                    break
                time.sleep(1)
            status = page.locator(".status").first.inner_text()
            page.click("#report-link")
            report_status = page.locator("#status").inner_text()
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(60)
    # Assert
    assert "LIVE" in listed
    assert status == "LIVE" and report_status == "LIVE"
    assert re.search(r"hospital\s+1/1\s+[1-9]", sites) and re.search(r"cloud\s+1/1\s+[1-9]", sites), sites
    assert run.returncode == 143
    assert load_run(next(runs.glob("*/*"))).status == "stopped"  # SIGTERM: stopped, not crashed


def test_binding_beyond_loopback_without_a_token_is_refused(tmp_path):
    # Execute
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "ui", "--runs", str(tmp_path), "--host", "127.0.0.2",
                             "--port", "0"], capture_output=True, text=True, env={**ENV, "HFLEET_UI_TOKEN": ""},
                            timeout=60)
    # Assert
    assert result.returncode == 8
    assert "--host 127.0.0.2 exposes the UI" in result.stderr and "--token" in result.stderr
    assert "Traceback" not in result.stderr


def test_with_a_token_requests_without_it_get_401_and_with_it_200(tmp_path):
    with ui_server(tmp_path, "--host", "127.0.0.2", "--token", "s3cret") as url:
        # Execute
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(url + "/", timeout=5)
        ok = urllib.request.urlopen(urllib.request.Request(url + "/", headers={"Authorization": "Bearer s3cret"}),
                                    timeout=5)
        # Assert
        assert denied.value.code == 401
        assert ok.status == 200 and b"No runs yet" in ok.read()


def test_a_busy_port_is_an_error_naming_it(tmp_path):
    # Prepare
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Execute
        result = subprocess.run([sys.executable, "-m", "hybridfleet", "ui", "--runs", str(tmp_path), "--port",
                                 str(port)], capture_output=True, text=True, env=ENV, timeout=60)
    # Assert
    assert result.returncode == 16 and f"port {port} on 127.0.0.1 is in use: the UI cannot serve there" in result.stderr
    assert "hint: choose another with --port" in result.stderr


def test_unknown_and_escaping_run_paths_are_404(tmp_path):
    with ui_server(tmp_path) as url:
        for path in ("/runs/nope/nope", "/runs/..%2F..%2Fetc/passwd", "/runs/a/b/report"):
            with pytest.raises(urllib.error.HTTPError) as missing:
                urllib.request.urlopen(url + path, timeout=5)
            assert missing.value.code == 404


class _Models:
    """A registry view holding two versions and an alias history (the interface the models pages read)."""

    def whoami(self):
        return {"name": "ann"}

    def models(self):
        return [{"name": "default/digits", "description": "hospital + cloud digits classifier", "latest": 2}]

    def versions(self, name):
        return [{"version": 1, "step": 200, "metrics": {"test_accuracy": 0.95}, "created_s": 1.7e9,
                 "lineage": {"job": "digits-hybrid", "run_id": "20231114-000000"}},  # a run this UI does not hold
                {"version": 2, "step": 300, "metrics": {"test_accuracy": 0.97}, "created_s": 1.7e9 + 60,
                 "metric_sources": {"test_accuracy": {"source": "checkpoint", "origin": "manifest"}},
                 "lineage": {"job": "digits-hybrid", "run_id": "20231114-000100"}}]

    def history(self, name):
        return [{"alias": "production", "action": "move", "to_version": 1, "reason": "first", "at_s": 1.7e9,
                 "actor": "ci"},
                {"alias": "production", "action": "move", "from_version": 1, "to_version": 2,
                 "reason": "better accuracy", "at_s": 1.7e9 + 90, "actor": "ci"}]


class _Access:
    """`RegistryAccess` with a fixed principal, over `_Models`."""

    viewer_signs_in = False

    def view(self, token=None):
        return _Models()


@contextmanager
def in_process_ui(runs: Path, registry=None, no_registry_reason: str = "no registry configured", token=None,
                  **app_options):
    """The UI app on a real socket, served by uvicorn in a thread (``app_options``: more `create_app` arguments);
    yields its base URL."""
    import threading

    import uvicorn

    from hybridfleet.ui.app import bind, create_app

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(runs, token=token, registry=registry, no_registry_reason=no_registry_reason, **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_models_page_lists_models_versions_and_alias_history(tmp_path):
    # Prepare: the run that produced v2 is under the UI's runs root; v1's run is not
    (tmp_path / "digits-hybrid" / "20231114-000100").mkdir(parents=True)
    with in_process_ui(tmp_path, _Access()) as url, chromium_page() as page:
        # Execute
        page.goto(url + "/")
        page.click("text=Models")
        page.click("text=digits")
        page.wait_for_selector("#versions tr >> nth=1")  # the model page has loaded
        versions = page.locator("#versions tr").all_inner_texts()
        aliases = page.locator("#aliases").inner_text()
        current = page.locator("#current-aliases").inner_text()
        links = page.locator("#versions td.lineage a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
    # Assert: each version names the run that produced it, linked to its page and report when served here
    assert links == ["/runs/digits-hybrid/20231114-000100", "/runs/digits-hybrid/20231114-000100/report"]
    assert "digits-hybrid / 20231114-000000 (not here)" in versions[2]
    # Assert: newest version first, metrics formatted with their source, alias history with time and actor
    assert versions[1].startswith("v2") and "test_accuracy = 0.97 (checkpoint)" in versions[1]
    assert "test_accuracy = 0.95 (claimed)" in versions[2] and "300" in versions[1]
    assert "better accuracy" in aliases and "production" in aliases and "ci" in aliases and "2023-11-14" in aliases
    assert "production" in current and "v2" in current


def test_the_models_page_reads_the_real_registry(tmp_path):
    # Prepare: a real registry (SQLite) with one version of a real checkpoint and an alias move
    import numpy as np

    from hybridfleet.ckpt import save_checkpoint
    from hybridfleet.ui.registry_view import RegistryAccess

    save_checkpoint(f"file://{tmp_path / 'ckpt'}", 300, tensors={"w": np.ones(4, np.float32)},
                    metrics={"test_accuracy": 0.97})
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    from hybridfleet.registry import Registry

    registry = Registry(db, store=f"file://{tmp_path / 'store'}")
    registry.create_model("digits")
    registry.register("digits", f"file://{tmp_path / 'ckpt'}")
    registry.move_alias("digits", "production", 1, reason="better accuracy")
    token = registry.add_principal("ann")
    registry.grant("ann", "reader", "default")
    # Execute
    with in_process_ui(tmp_path / "runs", RegistryAccess(db, token)) as url, chromium_page() as page:
        page.goto(url + "/")
        page.click("text=Models")
        page.click("text=digits")
        page.wait_for_selector("#versions tr >> nth=1")  # the model page has loaded
        versions = page.locator("#versions").inner_text()
        aliases = page.locator("#aliases").inner_text()
    # Assert
    assert "0.97" in versions
    assert "better accuracy" in aliases and "production" in aliases


def test_without_the_registry_package_the_models_page_is_left_out(tmp_path, monkeypatch):
    from hybridfleet.ui import registry_view

    monkeypatch.setattr(registry_view, "registry_available", lambda: False)  # as where the package is not installed
    access, reason = registry_view.open_access("sqlite:///anything.db")
    with in_process_ui(tmp_path, access, reason) as url:
        body = urllib.request.urlopen(url + "/", timeout=5).read().decode()
        models = urllib.request.urlopen(url + "/models", timeout=5).read().decode()
        assert access is None and "/models" not in body
        assert "the registry package is not installed" in models
