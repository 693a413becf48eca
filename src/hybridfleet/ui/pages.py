"""Server-rendered pages of `hfleet ui`: plain HTML, no scripts, no build chain."""

from __future__ import annotations

import html
import time
from typing import Any

from hybridfleet.obs.live import SiteState, human_bytes
from hybridfleet.obs.runinfo import RunData

_CSS = """body{font-family:sans-serif;max-width:1000px;margin:1.5em auto;color:#222}
nav a{margin-right:1em}table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;
border-bottom:1px solid #eee}.status{padding:1px 8px;border-radius:4px;color:#fff;font-weight:bold;font-size:.9em}
.completed{background:#2a7}.degraded{background:#c80}.failed,.crashed{background:#c33}.live{background:#27c}
.unknown{background:#888}progress{width:200px}"""

esc = html.escape


def page(title: str, body: str, refresh_s: int | None = None, registry: bool = False) -> str:
    """A whole page with the navigation bar."""
    meta = f"<meta http-equiv='refresh' content='{refresh_s}'>" if refresh_s else ""
    nav = "<nav><a href='/'>Runs</a>" + ("<a href='/models'>Models</a>" if registry else "") + "</nav>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>{meta}"
            f"<style>{_CSS}</style></head><body>{nav}<h1>{esc(title)}</h1>{body}</body></html>")


def badge(status: str) -> str:
    return f"<span class='status {esc(status)}'>{esc(status.upper())}</span>"


def latest_step(run: RunData) -> int | None:
    steps = [r["step"] for r in run.metrics if isinstance(r.get("step"), int)
             and str(r.get("process", "")).startswith("worker-")]
    return max(steps) if steps else None


def runs_table(runs: list[tuple[str, RunData]]) -> str:
    """The runs list: job, start, status, progress, link."""
    if not runs:
        return "<p>No runs yet. Start one with <code>hfleet run JOB</code>.</p>"
    rows = []
    for run_id, run in runs:
        started = run.info.get("started")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) if started else "-"
        total = run.info.get("steps")
        step = latest_step(run)
        progress = "-"
        if total:
            done = total if run.status in ("completed", "degraded") else (step or 0)
            progress = f"<progress max='{int(total)}' value='{int(done)}'></progress> {done}/{total}"
        acc = (run.summary or {}).get("test_accuracy")
        rows.append(f"<tr><td><a href='/runs/{esc(run_id)}'>{esc(run.job)}</a></td><td>{esc(run_id)}</td>"
                    f"<td>{when}</td><td>{badge(run.status)}</td><td>{progress}</td>"
                    f"<td>{'-' if acc is None else esc(str(acc))}</td></tr>")
    return ("<table id='runs'><tr><th>job</th><th>run</th><th>started (UTC)</th><th>status</th><th>progress</th>"
            "<th>joint accuracy</th></tr>" + "".join(rows) + "</table>")


def sites_table(sites: dict[str, SiteState]) -> str:
    """Live per-site progress from the run's metrics endpoints."""
    rows = "".join(f"<tr><td>{esc(site)}</td><td>{st.workers_up}/{st.workers}</td><td>{st.steps:g}</td>"
                   f"<td>{human_bytes(st.uplink_bytes)}</td><td>{human_bytes(st.downlink_bytes)}</td>"
                   f"<td>{'-' if st.accuracy is None else f'{st.accuracy:.3f}'}</td></tr>"
                   for site, st in sorted(sites.items()))
    return ("<table id='sites'><tr><th>site</th><th>workers up</th><th>steps</th><th>uplink</th><th>downlink</th>"
            "<th>accuracy</th></tr>" + rows + "</table>")


def run_detail(run_id: str, run: RunData, sites: dict[str, SiteState] | None) -> str:
    """One run: status, summary or live progress, links to its report and logs."""
    parts = [f"<p>{badge(run.status)} <code>{esc(str(run.path))}</code></p>"]
    total, step = run.info.get("steps"), latest_step(run)
    if run.live:
        parts.append(f"<h2>Live progress</h2><p id='progress'>latest reported step {step if step is not None else '-'}"
                     f" of {total or '-'}</p>")
        parts.append(sites_table(sites or {}))
    if run.summary:
        s = run.summary
        rows = [("joint test accuracy", s.get("test_accuracy")), ("restarts", s.get("restarts")),
                ("wall time (s)", s.get("wall_s"))]
        rows += [(f"{k} alone", v) for k, v in (s.get("site_alone_accuracy") or {}).items()]
        shown = [(k, f"{v:.4f}" if isinstance(v, float) and ("accuracy" in k or k.endswith("alone")) else str(v))
                 for k, v in rows]
        parts.append("<h2>Summary</h2><table id='summary'>" +
                     "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in shown) + "</table>")
    if run.missing:
        parts.append(f"<p>Missing: {esc(', '.join(run.missing))}</p>")
    parts.append(f"<h2>Report</h2><p><a id='report-link' href='/runs/{esc(run_id)}/report'>Open the report</a></p>")
    return "".join(parts)


def models_page(models: list[dict[str, Any]]) -> str:
    if not models:
        return "<p>The registry holds no models yet.</p>"
    rows = "".join(f"<tr><td><a href='/models/{esc(str(m.get('name', '')))}'>{esc(str(m.get('name', '')))}</a></td>"
                   f"<td>{esc(str(m.get('description', '')))}</td></tr>" for m in models)
    return "<table id='models'><tr><th>model</th><th>description</th></tr>" + rows + "</table>"


def _cells(rows: list[dict[str, Any]], keys: list[str]) -> str:
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(r.get(k, '')))}</td>" for k in keys) + "</tr>" for r in rows)
    return f"<tr>{head}</tr>{body}"


def model_page(versions: list[dict[str, Any]], aliases: list[dict[str, Any]]) -> str:
    vkeys = sorted({k for v in versions for k in v if k in ("version", "created", "step", "metrics", "tags")}) or ["version"]
    shown = ("alias", "action", "version", "from_version", "to_version", "at", "actor", "reason", "revision")
    akeys = sorted({k for a in aliases for k in a if k in shown}) or ["alias"]
    return (f"<h2>Versions</h2><table id='versions'>{_cells(versions, vkeys)}</table>"
            f"<h2>Aliases</h2><table id='aliases'>{_cells(aliases, akeys)}</table>")
