"""`hfleet ui` facing a hostile run directory and hostile viewers, over real HTTP: every value escaped,
a strict Content-Security-Policy, a malformed run.json shown as a broken run (never a 500), no
database created, registry pages with the viewer's own permissions, and no token in a URL."""

from __future__ import annotations

from markupsafe import escape
import json
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.browser import chromium_page
from tests.test_ui import in_process_ui as ui

REPO = Path(__file__).resolve().parents[1]
XSS = "<script>alert(1)</script>"


def make_run(root: Path, job: str, stamp: str, info: bytes | str | dict, summary: dict | None = None) -> Path:
    """A run directory as `hfleet run` leaves one, with ``info`` as its run.json (raw bytes allowed)."""
    run = root / job / stamp
    run.mkdir(parents=True)
    data = json.dumps(info) if isinstance(info, dict) else info
    (run / "run.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "process": "worker-0", "loss": 0.5}) + "\n")
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


GOOD = {"job": "digits", "framework": "torch", "sync": "bsp", "pid": 999999999, "started": 1.7e9, "steps": 10,
        "sites": ["hospital"]}  # fmt: skip
DONE = {"job": "digits", "status": "completed", "test_accuracy": 0.93, "restarts": 0, "wall_s": 12.5}


# ------------------------------------------------------------------ escaping and headers
def test_a_stored_script_in_run_json_and_summary_is_rendered_escaped(tmp_path):
    # Prepare: a job that writes markup into every field it controls
    make_run(tmp_path, "x", "r1", {**GOOD, "job": XSS}, {**DONE, "job": XSS, "site_alone_accuracy": {XSS: 0.5},
                                                          "status": "completed'><img src=x onerror=alert(1)>"})  # fmt: skip
    make_run(tmp_path, "x", "live", {**GOOD, "job": XSS, "pid": os.getpid(), "steps": XSS})  # a live run's progress line
    with ui(tmp_path) as url:
        # Execute
        listing = httpx.get(url + "/").text
        detail = httpx.get(url + "/runs/x/r1").text
        live = httpx.get(url + "/runs/x/live").text
    # Assert
    assert "<script" not in live and "&lt;script&gt;alert(1)&lt;/script&gt;" in live
    for body in (listing, detail):
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
        assert "<script" not in body and "onerror=alert" not in body.replace("onerror=alert(1)&gt;", "")
    assert "<img src=x" not in listing and "<img src=x" not in detail  # the run page's own plots are <img src="/runs/


def test_every_page_carries_a_strict_csp_and_nosniff(tmp_path):
    make_run(tmp_path, "digits", "r1", GOOD, DONE)
    with ui(tmp_path, token="s3cret") as url:
        headers = {"Authorization": "Bearer s3cret"}
        responses = [httpx.get(url + path, headers=headers) for path in ("/", "/runs/digits/r1", "/models", "/nope")]
        responses.append(httpx.get(url + "/"))  # the 401 too
        report = httpx.get(url + "/runs/digits/r1/report", headers=headers)
    for response in responses + [report]:
        csp = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert csp.startswith("default-src 'none'")
        scripts = re.search(r"script-src ([^;]*)", csp)
        assert scripts is None or scripts.group(1) == "'self'", csp  # the UI's own /static/live.js, nothing inline
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.status_code < 500
    assert [r.status_code for r in responses] == [200, 200, 200, 404, 401]
    from hybridfleet.obs.report import STYLE_CSP_SOURCE

    assert f"style-src {STYLE_CSP_SOURCE}" in report.headers["content-security-policy"]


def test_the_report_renders_under_its_csp_without_a_violation(tmp_path):
    # The hash in the header must match the report's inline style exactly, or Chromium drops the style.
    make_run(tmp_path, "digits", "r1", GOOD, DONE)
    with ui(tmp_path) as url, chromium_page() as page:
        messages = []
        page.on("console", lambda m: messages.append(m.text))
        page.goto(url + "/runs/digits/r1/report")
        colour = page.eval_on_selector("#status", "e => getComputedStyle(e).backgroundColor")
        page.goto(url + "/")
        runs_colour = page.eval_on_selector(".status", "e => getComputedStyle(e).backgroundColor")
    assert not [m for m in messages if "Content Security Policy" in m], messages
    assert colour == runs_colour == "rgb(34, 170, 119)"  # .completed{background:#2a7}


# ------------------------------------------------------------------ malformed runs
@pytest.mark.parametrize("info,problem", [
    (b"{", "run.json is not readable JSON"),
    (b"\xff\xfe not utf-8", "run.json is not readable JSON"),
    (b"[" * 100_000, "run.json is not readable JSON"),
    ("[1, 2]", "run.json holds a JSON list, not an object"),
    ({**GOOD, "started": "yesterday"}, "'started' must be a UNIX time in seconds"),
    ({**GOOD, "steps": "many"}, "'steps' must be an integer >= 0"),
    ({**GOOD, "steps": 1e300}, "'steps' must be an integer >= 0"),
    ({**GOOD, "pid": [1]}, "'pid' must be a positive integer"),
])
def test_a_malformed_run_json_shows_a_broken_run_and_the_others_still_list(tmp_path, info, problem):
    # Prepare
    make_run(tmp_path, "digits", "good", GOOD, DONE)
    make_run(tmp_path, "digits", "bad", info, {**DONE, "site_alone_accuracy": [1, 2]})
    with ui(tmp_path) as url:
        # Execute
        listing = httpx.get(url + "/")
        detail = httpx.get(url + "/runs/digits/bad")
        report = httpx.get(url + "/runs/digits/bad/report")
        api = httpx.get(url + "/api/runs").json()
    # Assert
    assert listing.status_code == detail.status_code == report.status_code == 200
    assert "digits/good" in listing.text and "COMPLETED" in listing.text
    shown = str(escape(problem))  # as the template writes it
    assert "digits/bad" in listing.text and "BROKEN" in listing.text and shown in listing.text
    assert "This run is broken" in detail.text and shown in detail.text
    assert "broken" in report.text
    assert {r["run"]: r["status"] for r in api} == {"digits/good": "completed", "digits/bad": "broken"}


# ------------------------------------------------------------------ no database created
def test_the_ui_creates_no_registry_database_and_says_none_is_configured(tmp_path):
    # Prepare: a HOME of its own, no registry in the environment
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFLEET_REGISTRY")}
    env.update(HOME=str(home), PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    missing_db = tmp_path / "nowhere" / "registry.db"
    pages = []
    for extra in ([], ["--registry", str(missing_db)]):
        proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "ui", "--runs", str(tmp_path / "runs"), "--port",
                                 "0", *extra], stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        try:
            url = re.search(r"http://[\d.]+:\d+", proc.stderr.readline()).group(0)
            # Execute
            pages.append(httpx.get(url + "/models", timeout=10))
        finally:
            proc.terminate()
            proc.wait(10)
    # Assert
    assert [p.status_code for p in pages] == [200, 200]
    assert "no registry configured" in pages[0].text and "--registry URL" in pages[0].text
    assert "no registry configured" in pages[1].text and "opens existing registries only" in pages[1].text
    assert list(home.rglob("*")) == [] and not missing_db.parent.exists()


# ------------------------------------------------------------------ the viewer's own permissions
@pytest.fixture
def two_namespaces(tmp_path):
    """A real registry with alpha/model and beta/secret; ann reads alpha only. (registry, ann's token)"""
    from hybridfleet.ckpt import save_checkpoint
    from hybridfleet.registry import Registry

    save_checkpoint(f"file://{tmp_path / 'ckpt'}", 3, tensors={"w": np.ones(4, np.float32)},
                    metrics={"test_accuracy": 0.91})  # fmt: skip
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", store=str(tmp_path / "store"))
    registry.register("alpha/model", f"file://{tmp_path / 'ckpt'}", metrics={"f1": 0.8})
    registry.register("beta/secret", f"file://{tmp_path / 'ckpt'}")
    registry.move_alias("alpha/model", "prod", 1, reason="first release")
    token = registry.add_principal("ann")
    registry.grant("ann", "reader", "alpha")
    return registry, token


def test_a_reader_of_one_namespace_signs_in_and_sees_only_it(tmp_path, two_namespaces):
    from hybridfleet.ui.registry_view import RegistryAccess

    registry, token = two_namespaces
    access = RegistryAccess(registry.db_url)
    with ui(tmp_path / "runs", registry=access) as url, httpx.Client(base_url=url) as viewer:
        # Execute
        anonymous = viewer.get("/models")
        wrong = viewer.post("/login", data={"registry_token": "hfr_not-a-token"})
        signed = viewer.post("/login", data={"registry_token": token})
        models = viewer.get("/models")
        alpha = viewer.get("/models/alpha/model")
        beta = viewer.get("/models/beta/secret")
    # Assert
    assert anonymous.status_code == 401 and 'name="registry_token"' in anonymous.text and "alpha" not in anonymous.text
    assert wrong.status_code == 401 and "not valid" in wrong.text and "set-cookie" not in wrong.headers
    cookie = signed.headers["set-cookie"]
    assert signed.status_code == 303 and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert models.status_code == 200 and "alpha/model" in models.text and "beta" not in models.text
    assert ">ann<" in models.text
    assert alpha.status_code == 200 and "first release" in alpha.text and "(claimed)" in alpha.text
    assert "(checkpoint)" in alpha.text and "0.91" in alpha.text
    assert beta.status_code == 404 and "no permission to see it" in beta.text and "0.91" not in beta.text


def test_a_fixed_registry_token_shows_its_principals_view_to_everyone(tmp_path, two_namespaces):
    from hybridfleet.ui.registry_view import RegistryAccess

    registry, token = two_namespaces
    with ui(tmp_path / "runs", registry=RegistryAccess(registry.db_url, token)) as url:
        models = httpx.get(url + "/models")
        beta = httpx.get(url + "/models/beta/secret")
    assert models.status_code == 200 and "alpha/model" in models.text and "beta/secret" not in models.text
    assert beta.status_code == 404  # the same answer as for a model that does not exist


def test_a_token_in_the_url_is_ignored_and_the_form_sets_an_httponly_cookie(tmp_path):
    make_run(tmp_path, "digits", "r1", GOOD, DONE)
    with ui(tmp_path, token="s3cret") as url, httpx.Client(base_url=url) as viewer:
        in_url = viewer.get("/?token=s3cret", headers={"Accept": "text/html"})
        wrong = viewer.post("/login", data={"ui_token": "guess"})
        signed = viewer.post("/login", data={"ui_token": "s3cret"})
        listing = viewer.get("/")
    assert in_url.status_code == 401 and "set-cookie" not in in_url.headers and 'name="ui_token"' in in_url.text
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert signed.status_code == 303 and "HttpOnly" in signed.headers["set-cookie"]
    assert "SameSite=strict" in signed.headers["set-cookie"]
    assert listing.status_code == 200 and "digits/r1" in listing.text
