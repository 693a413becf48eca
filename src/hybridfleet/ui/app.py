"""`hfleet ui`: a read-only web app over the runs under one directory and, when configured, the registry.

Bound to 127.0.0.1 by default. Bound anywhere else it requires a UI token, sent as
``Authorization: Bearer TOKEN`` or through the sign-in form, which sets an HttpOnly,
SameSite=Strict cookie; a token is never read from a URL. Registry pages act for a
registry principal: the token the UI was given (``--registry-token``), else the
viewer's own, entered in the same form; never the database's owner.

Every page is a Jinja2 template with autoescape, served with a strict
Content-Security-Policy (scripts, styles and connections to the UI itself only, no inline
script, no framing). A live run's page updates its figures from server-sent events
(``/runs/JOB/STAMP/events``, read by ``/static/live.js``); without script it reloads itself
every few seconds (a meta refresh inside <noscript>). Its plots are PNGs the UI draws
from the run's files on each request. Process logs are served as text/plain, only files
directly under the run's ``logs/``.
Nothing here writes: a run's report is rendered in memory, its directory and the
registry are only read, and no database is created.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import socket
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridfleet.errors import (
    AuthError,
    HfleetError,
    LaunchError,
    PermissionDeniedError,
    RegistryNotFoundError,
    ReportError,
)
from hybridfleet.obs.discovery import read_targets
from hybridfleet.obs.live import RunView, Snapshot, final_exits, reported_figures
from hybridfleet.obs.metric_plots import is_metric_key
from hybridfleet.obs.report import (
    RUN_SECTIONS, STYLE_CSP_SOURCE, build_report, metric_section, render_plot, sections_for,
)
from hybridfleet.obs.runinfo import list_runs, load_run
from hybridfleet.ui import compare, live_events, pages, runs_view
from hybridfleet.ui.registry_view import RegistryAccess

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
UI_COOKIE = "hfleet_ui_token"
REGISTRY_COOKIE = "hfleet_registry_token"
_FORM_LIMIT_BYTES = 8192
LIVE_REFRESH_S = 5
LOG_LIMIT_BYTES = 2 * 1024 * 1024  # a longer log is served from its last bytes
_RUN_PLOTS = {key: draw for key, _, draw in RUN_SECTIONS}  # metric plots: any metric key (obs.metric_plots)
_OPEN_PATHS = ("/login", "/static/ui.css")
CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; img-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")  # fmt: skip
REPORT_CSP = f"default-src 'none'; style-src {STYLE_CSP_SOURCE}; img-src data:; frame-ancestors 'none'; base-uri 'none'"
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-store"}  # fmt: skip
_STATUS = [(AuthError, 401), (PermissionDeniedError, 403), (RegistryNotFoundError, 404), (HfleetError, 400)]


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status)


def create_app(runs_root: Path, token: str | None = None, registry: RegistryAccess | None = None,
               no_registry_reason: str = "no registry configured", max_streams: int = live_events.MAX_STREAMS,
               poll_s: float = live_events.POLL_S) -> FastAPI:  # fmt: skip
    """The app over ``runs_root``; with ``token`` every request must carry it; ``registry``: the models pages' source;
    at most ``max_streams`` live event streams open at once, each polling its run every ``poll_s`` seconds."""
    app = FastAPI(title="hybridfleet", docs_url=None, redoc_url=None, openapi_url=None)
    root = Path(runs_root).resolve()
    static = resources.files("hybridfleet.ui") / "static"
    css, live_js = (static / "ui.css").read_bytes(), (static / "live.js").read_bytes()
    slots = live_events.StreamSlots(max_streams)

    def ui_token_ok(request: Request) -> bool:
        if token is None:
            return True
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.cookies.get(UI_COOKIE, "")
        return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode())

    def login_page(request: Request, error: str = "", status: int = 401) -> HTMLResponse:
        return _html(pages.render("login.html", title="Sign in", error=error, ask_ui_token=not ui_token_ok(request),
                                  ask_registry_token=registry is not None and registry.viewer_signs_in,
                                  registry=registry is not None), status)  # fmt: skip

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if ui_token_ok(request) or request.url.path in _OPEN_PATHS:
            response = await call_next(request)
        elif "text/html" in request.headers.get("accept", ""):
            response = login_page(request, "this UI needs its token")
        else:
            response = Response("token required: send Authorization: Bearer TOKEN or sign in at /login\n",
                                status_code=401, media_type="text/plain")  # fmt: skip
        response.headers.setdefault("Content-Security-Policy", CSP)
        for key, value in SECURITY_HEADERS.items():
            response.headers[key] = value
        return response

    def signed_in(request: Request) -> bool:
        return bool(request.cookies.get(UI_COOKIE) or request.cookies.get(REGISTRY_COOKIE))

    def page(request: Request, template: str, status: int = 200, **values) -> HTMLResponse:
        return _html(pages.render(template, registry=registry is not None, signed_in=signed_in(request), **values),
                     status)  # fmt: skip

    def run_dir(job: str, stamp: str) -> Path:
        if not (_PART.fullmatch(job) and _PART.fullmatch(stamp)):
            raise HTTPException(404, "no such run")
        path = root / job / stamp
        if not path.is_dir():
            raise HTTPException(404, "no such run")
        return path

    def run_served(job: str, stamp: str) -> bool:
        """True when this UI serves the run folder ``job/stamp`` (a version's lineage names it)."""
        return bool(_PART.fullmatch(job) and _PART.fullmatch(stamp)) and (root / job / stamp).is_dir()

    def runs() -> list[tuple[str, object]]:
        out = []
        for path in list_runs(root):
            try:
                out.append((f"{path.parent.name}/{path.name}", load_run(path)))
            except ReportError:
                continue  # removed meanwhile
        return sorted(out, key=lambda item: runs_view.started_s(item[1]), reverse=True)  # newest first

    @app.get("/static/ui.css")
    def stylesheet() -> Response:
        return Response(css, media_type="text/css")

    @app.get("/static/live.js")
    def live_script() -> Response:
        return Response(live_js, media_type="text/javascript")

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request) -> HTMLResponse:
        return login_page(request, status=200)

    @app.post("/login")
    async def login(request: Request) -> Response:
        body = await request.body()
        if len(body) > _FORM_LIMIT_BYTES:
            return login_page(request, "the form is too large", 413)
        form = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
        cookies = {}
        if token is not None and not ui_token_ok(request):
            given = form.get("ui_token", "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), token.encode()):
                return login_page(request, "that is not this UI's token")
            cookies[UI_COOKIE] = given
        registry_token = form.get("registry_token", "").strip()
        if registry_token and registry is not None and registry.viewer_signs_in:
            try:
                registry.view(registry_token).whoami()
            except HfleetError as err:
                return login_page(request, f"registry: {err}")
            cookies[REGISTRY_COOKIE] = registry_token
        response = RedirectResponse("/models" if REGISTRY_COOKIE in cookies else "/", status_code=303)
        for name, value in cookies.items():
            response.set_cookie(name, value, httponly=True, samesite="strict", secure=request.url.scheme == "https")
        return response

    @app.post("/logout")
    def logout() -> Response:
        response = RedirectResponse("/", status_code=303)
        for name in (UI_COOKIE, REGISTRY_COOKIE):
            response.delete_cookie(name, httponly=True, samesite="strict")
        return response

    def loaded(job: str, stamp: str):
        try:
            return load_run(run_dir(job, stamp))
        except ReportError as err:
            raise HTTPException(404, str(err)) from None

    @app.get("/", response_class=HTMLResponse)
    def runs_page(request: Request) -> HTMLResponse:
        rows = [runs_view.run_row(run_id, run) for run_id, run in runs()]
        refresh = LIVE_REFRESH_S if any(r["status"] == "live" for r in rows) else None
        return page(request, "runs.html", title="Runs", runs=rows, refresh_s=refresh)

    @app.get("/runs/{job}/{stamp}", response_class=HTMLResponse)
    def run_page(request: Request, job: str, stamp: str) -> HTMLResponse:
        run = loaded(job, stamp)
        sites, metric_key = None, None
        if run.live:
            snap = live_snapshot(run)
            sites, metric_key = snap.sites, snap.metric_key
        plots = [(key, title) for key, title, _ in sections_for(run)]
        return page(request, "run.html", title=f"Run {run.job} {stamp}",
                    run=runs_view.run_view(f"{job}/{stamp}", run, sites, plots, metric_key),
                    refresh_s=LIVE_REFRESH_S if run.live else None, live_events=run.live)  # fmt: skip

    @app.get("/runs/{job}/{stamp}/events")
    async def run_events(job: str, stamp: str) -> Response:
        path = run_dir(job, stamp)
        if not slots.take():
            reason = f"too many live streams open (at most {slots.limit}): reload the page later for new figures\n"
            return Response(reason, status_code=503, media_type="text/plain", headers={"Retry-After": "5"})

        async def events():
            try:
                async for chunk in live_events.stream(path, live_snapshot, asyncio.sleep, poll_s):
                    yield chunk
            finally:
                slots.release()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})

    @app.get("/runs/{job}/{stamp}/plots/{key}.png")
    def run_plot(job: str, stamp: str, key: str) -> Response:
        if key not in _RUN_PLOTS and not is_metric_key(key):
            raise HTTPException(404, "no such plot")
        run = loaded(job, stamp)
        png = render_plot(_RUN_PLOTS.get(key) or metric_section(key)[2], run)
        if png is None:
            png = render_plot(_no_data, run)
        return Response(png, media_type="image/png")

    @app.get("/runs/{job}/{stamp}/logs/{name}")
    def run_log(job: str, stamp: str, name: str) -> Response:
        path = runs_view.log_file(run_dir(job, stamp), name)
        if path is None:
            raise HTTPException(404, "no such log")
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - LOG_LIMIT_BYTES))
            data = f.read(LOG_LIMIT_BYTES)
        head = f"[the last {LOG_LIMIT_BYTES} of {size} bytes]\n" if size > LOG_LIMIT_BYTES else ""
        return Response(head + data.decode("utf-8", "replace"), media_type="text/plain; charset=utf-8")

    def picked(request: Request) -> list[tuple[str, object]]:
        ids = request.query_params.getlist("run")
        if len(ids) < 2:
            raise HTTPException(400, "pick at least 2 runs to compare (tick them on the runs list)")
        if len(ids) > compare.MAX_RUNS:
            raise HTTPException(400, f"pick at most {compare.MAX_RUNS} runs to compare (got {len(ids)})")
        out = []
        for run_id in ids:
            job, _, stamp = run_id.partition("/")
            out.append((f"{job}/{stamp}", loaded(job, stamp)))
        return out

    @app.get("/compare", response_class=HTMLResponse)
    def compare_page(request: Request) -> HTMLResponse:
        chosen = picked(request)
        rows = [runs_view.run_row(run_id, run) for run_id, run in chosen]
        return page(request, "compare.html", title=f"Compare {len(chosen)} runs", runs=rows,
                    query=urlencode([("run", run_id) for run_id, _ in chosen]), diff=compare.spec_diff([run for _, run in chosen]))  # fmt: skip

    @app.get("/compare.png")
    def compare_plot(request: Request) -> Response:
        return Response(compare.accuracy_png(picked(request)), media_type="image/png")

    @app.get("/runs/{job}/{stamp}/report", response_class=HTMLResponse)
    def report_page(job: str, stamp: str) -> HTMLResponse:
        try:
            _, body, _ = build_report(run_dir(job, stamp))
        except ReportError as err:
            raise HTTPException(404, str(err)) from None
        return HTMLResponse(body, headers={"Content-Security-Policy": REPORT_CSP})

    @app.get("/api/runs")
    def runs_api() -> JSONResponse:
        return JSONResponse([{"run": run_id, "job": run.job, "status": pages.status_of(run),
                              "latest_step": pages.latest_step(run), "steps": run.info.get("steps"),
                              "problems": run.problems} for run_id, run in runs()])  # fmt: skip

    def registry_page(request: Request, render) -> HTMLResponse:
        if registry is None:
            return page(request, "message.html", title="Models", message=no_registry_reason)
        try:
            return render(registry.view(request.cookies.get(REGISTRY_COOKIE)))
        except AuthError as err:
            return login_page(request, str(err))
        except HfleetError as err:
            status = next(code for cls, code in _STATUS if isinstance(err, cls))
            return page(request, "message.html", status, title="Models", message=str(err))

    @app.get("/models", response_class=HTMLResponse)
    def models(request: Request) -> HTMLResponse:
        return registry_page(request, lambda view: page(
            request, "models.html", title="Models", principal=view.whoami().get("name", "-"), models=view.models()))

    @app.get("/models/{name:path}", response_class=HTMLResponse)  # names are namespace/model
    def model(request: Request, name: str) -> HTMLResponse:
        def render(view) -> HTMLResponse:
            versions = [pages.version_view(v, run_served) for v in reversed(view.versions(name))]
            current, history = pages.history_view(view.history(name))
            return page(request, "model.html", title=f"Model {name}", versions=versions, aliases=current,
                        history=history)  # fmt: skip

        return registry_page(request, render)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> HTMLResponse:
        return page(request, "message.html", err.status_code, title="Not found" if err.status_code == 404 else "Error",
                    message=str(err.detail))  # fmt: skip

    return app


def live_snapshot(run) -> Snapshot:
    """The live view of ``run`` now: its workers scraped, those that exited with their last logged figures."""
    view = RunView(run.job, read_targets(run.path), lambda: (0.0, 0.0), lambda: 0,
                   read_exits=lambda: final_exits(run.events), read_reported=lambda: reported_figures(run.metrics))
    return view.snapshot()


def _no_data(ax, run) -> bool:
    ax.text(0.5, 0.5, "no data for this plot yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return True


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a port in use raises `PortInUseError` naming it."""
    from hybridfleet.launch.preflight import listen

    return listen(host, port, "the UI")


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token."""
    if host not in LOOPBACK and not token:
        raise LaunchError(f"--host {host} exposes the UI beyond this machine: give --token TOKEN (or HFLEET_UI_TOKEN)",
                          hint="pass --token TOKEN (or set HFLEET_UI_TOKEN), or keep --host 127.0.0.1")
