"""`hfleet ui`: a read-only web app over the runs under one directory and, when installed, the registry.

Bound to 127.0.0.1 by default. Bound anywhere else it requires a token: the first
request brings it as ``Authorization: Bearer TOKEN`` or ``?token=TOKEN`` (which then
sets a cookie, so links work in a browser). Nothing here writes: a run's report is
rendered in memory, its directory is only read.
"""

from __future__ import annotations

import errno
import hmac
import re
import socket
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from hybridfleet.errors import LaunchError, ReportError
from hybridfleet.obs.discovery import read_targets
from hybridfleet.obs.live import RunView
from hybridfleet.obs.report import build_report
from hybridfleet.obs.runinfo import list_runs, load_run
from hybridfleet.ui import pages
from hybridfleet.ui.registry_view import RegistrySource

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_COOKIE = "hfleet_ui_token"


def create_app(runs_root: Path, token: str | None = None, registry: RegistrySource | None = None) -> FastAPI:
    """The app over ``runs_root``; with ``token`` every request must carry it."""
    app = FastAPI(title="hybridfleet", docs_url=None, redoc_url=None, openapi_url=None)
    root = Path(runs_root).resolve()

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token is None:
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(_COOKIE) or ""
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:]
        if not hmac.compare_digest(given.encode(), token.encode()):
            return Response("token required: add ?token=TOKEN or an Authorization: Bearer header\n", status_code=401,
                            media_type="text/plain")
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(_COOKIE, token, httponly=True, samesite="strict")
        return response

    def run_dir(job: str, stamp: str) -> Path:
        if not (_PART.match(job) and _PART.match(stamp)):
            raise HTTPException(404, "no such run")
        path = root / job / stamp
        if not path.is_dir():
            raise HTTPException(404, "no such run")
        return path

    def load(job: str, stamp: str):
        try:
            return load_run(run_dir(job, stamp))
        except ReportError as err:
            raise HTTPException(404, str(err)) from None

    @app.get("/", response_class=HTMLResponse)
    def runs_page() -> str:
        runs = []
        for path in list_runs(root):
            try:
                runs.append((f"{path.parent.name}/{path.name}", load_run(path)))
            except ReportError:
                continue
        refresh = 5 if any(r.live for _, r in runs) else None
        return pages.page("Runs", pages.runs_table(runs), refresh_s=refresh, registry=registry is not None)

    @app.get("/runs/{job}/{stamp}", response_class=HTMLResponse)
    def run_page(job: str, stamp: str) -> str:
        run = load(job, stamp)
        sites = None
        if run.live:
            view = RunView(run.job, read_targets(run.path), lambda: (0.0, 0.0), lambda: 0)
            sites = view.snapshot().sites
        body = pages.run_detail(f"{job}/{stamp}", run, sites)
        return pages.page(f"Run {run.job} {stamp}", body, refresh_s=2 if run.live else None,
                          registry=registry is not None)

    @app.get("/runs/{job}/{stamp}/report", response_class=HTMLResponse)
    def report_page(job: str, stamp: str) -> str:
        try:
            _, page, _ = build_report(run_dir(job, stamp))
        except ReportError as err:
            raise HTTPException(404, str(err)) from None
        return page

    @app.get("/api/runs")
    def runs_api() -> JSONResponse:
        out = []
        for path in list_runs(root):
            try:
                run = load_run(path)
            except ReportError:
                continue
            out.append({"run": f"{path.parent.name}/{path.name}", "job": run.job, "status": run.status,
                        "latest_step": pages.latest_step(run), "steps": run.info.get("steps")})
        return JSONResponse(out)

    if registry is not None:
        @app.get("/models", response_class=HTMLResponse)
        def models() -> str:
            return pages.page("Models", pages.models_page(registry.models()), registry=True)

        @app.get("/models/{name:path}", response_class=HTMLResponse)  # names are namespace/model
        def model(name: str) -> str:
            return pages.page(f"Model {name}", pages.model_page(registry.versions(name), registry.aliases(name)),
                              registry=True)
    else:
        @app.get("/models")
        def no_models() -> RedirectResponse:
            return RedirectResponse("/")

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a port in use raises `LaunchError` naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise LaunchError(f"UI port {port} on {host} is in use; choose another with --port (0 picks a free "
                              f"port)") from None
        raise LaunchError(f"cannot bind the UI to {host}:{port}: {err.strerror or err}") from None
    sock.listen(128)
    return sock


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token."""
    if host not in LOOPBACK and not token:
        raise LaunchError(f"--host {host} exposes the UI beyond this machine: give --token TOKEN (or HFLEET_UI_TOKEN)",
                          hint="pass --token TOKEN (or set HFLEET_UI_TOKEN), or keep --host 127.0.0.1")
