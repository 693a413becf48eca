"""`hfleet report RUN_DIR`: one self-contained HTML page (and PNGs) for a run.

Plots, each from the run's own files: every metric the scripts reported (training loss,
accuracy, bits per character, ...; `hybridfleet.obs.metric_plots`) against step, the
joint model beside each site and each site alone, bytes per site and direction, where a step's
time goes (compute, encode, transfer, wait), stragglers (steps against time per
worker) and restarts and other events on the time axis. The PNGs are embedded as
data URIs, so ``report.html`` can be mailed or attached to a ticket as one file. A
run still in progress is reported as live; a crashed or half-written one gives a
partial report that lists what is missing.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Callable

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from hybridfleet.errors import ReportError
from hybridfleet.obs.metric_plots import (
    ACCURACY_SECTION, DEFAULT_METRICS, draw_metric, final_values, joint_series, metric_label, reported_sections, section_title,
)
from hybridfleet.obs.runinfo import RunData, load_run
from hybridfleet.store.file import FileStore

REPORT_FILE = "report.html"
PLOTS_DIR = "report"
PHASES = ("compute", "encode", "transfer", "wait")
_EVENT_STYLE = {"start": ("tab:green", "^"), "exit": ("tab:gray", "v"), "restart": ("tab:orange", "o"),
                "gave_up": ("tab:red", "X"), "stop": ("black", "s")}


def _workers(run: RunData) -> list[dict]:
    return [r for r in run.metrics if str(r.get("process", "")).startswith("worker-")]


def _last_per_process(records: list[dict]) -> dict[str, dict]:
    last: dict[str, dict] = {}
    for r in records:
        last[str(r.get("process"))] = r
    return last


def joint_accuracy(run: RunData) -> list[tuple[int, float]]:
    """The joint model's test accuracy against worker step: at each step, the mean over the workers that
    reported one (one model, all sites); empty when no worker reported an accuracy."""
    return joint_series(run, ACCURACY_SECTION)


# ---------------------------------------------------------------------------------- plots
# Each returns False when the run has no data for it (the section then says so).

def _plot_bytes(ax, run: RunData) -> bool:
    sent: dict[str, float] = defaultdict(float)
    received: dict[str, float] = defaultdict(float)
    for r in _last_per_process(_workers(run)).values():
        sent[str(r.get("site", "?"))] += float(r.get("sent", 0))
        received[str(r.get("site", "?"))] += float(r.get("received", 0))
    sites = sorted(set(sent) | set(received))
    if not sites or not any(sent.values()) and not any(received.values()):
        return False
    xs = range(len(sites))
    ax.bar([x - 0.2 for x in xs], [sent[s] / 1e6 for s in sites], width=0.4, label="uplink (sent)")
    ax.bar([x + 0.2 for x in xs], [received[s] / 1e6 for s in sites], width=0.4, label="downlink (received)")
    ax.set_xticks(list(xs), sites)
    ax.set(ylabel="MB over the WAN")
    return True


def _plot_phases(ax, run: RunData) -> bool:
    last = {p: r for p, r in _last_per_process(_workers(run)).items() if isinstance(r.get("phase_s"), dict)}
    if not last:
        return False
    names = sorted(last)
    bottom = [0.0] * len(names)
    for phase in PHASES:
        vals = [float(last[n]["phase_s"].get(phase, 0.0)) for n in names]
        ax.bar(names, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="seconds (cumulative)")
    ax.tick_params(axis="x", labelrotation=20)
    return True


def _plot_stragglers(ax, run: RunData) -> bool:
    per: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in _workers(run):
        if isinstance(r.get("elapsed_s"), (int, float)) and isinstance(r.get("step"), int):
            per[str(r["process"])].append((float(r["elapsed_s"]), r["step"]))
    for name, points in sorted(per.items()):
        ax.plot(*zip(*sorted(points)), marker=".", label=name)
    ax.set(xlabel="seconds since the worker started", ylabel="worker step")
    return bool(per)


def _plot_events(ax, run: RunData) -> bool:
    events = [e for e in run.events if isinstance(e.get("ts"), (int, float)) and e.get("process")]
    if not events:
        return False
    t0 = min(e["ts"] for e in events)
    procs = sorted({e["process"] for e in events})
    row = {p: i for i, p in enumerate(procs)}
    for kind, (colour, marker) in _EVENT_STYLE.items():
        pts = [(e["ts"] - t0, row[e["process"]]) for e in events if e.get("event") == kind]
        if pts:
            ax.scatter(*zip(*pts), c=colour, marker=marker, label=kind, s=40, zorder=3)
    ax.set_yticks(range(len(procs)), procs)
    ax.set(xlabel="seconds since the run started")
    ax.grid(axis="x", alpha=0.3)
    return True


RUN_SECTIONS: list[tuple[str, str, Callable]] = [
    ("bytes", "Bytes per site and direction", _plot_bytes),
    ("phases", "Round time breakdown", _plot_phases),
    ("stragglers", "Stragglers: progress per worker", _plot_stragglers),
    ("events", "Restarts and events", _plot_events),
]


def metric_section(key: str) -> tuple[str, str, Callable]:
    """The section of metric ``key`` (see `hybridfleet.obs.metric_plots`): key, title, draw."""
    return key, section_title(key), draw_metric(key)


# The sections of a run that reports a training loss and an accuracy, as the digits examples do.
SECTIONS: list[tuple[str, str, Callable]] = [*(metric_section(k) for k in DEFAULT_METRICS), *RUN_SECTIONS]


def sections_for(run: RunData) -> list[tuple[str, str, Callable]]:
    """The report's sections for ``run``: one plot per metric it reports (loss, accuracy, bits per character, ...),
    then bytes, round time, stragglers and events."""
    metrics = reported_sections(run) or list(DEFAULT_METRICS)
    return [*(metric_section(k) for k in metrics), *RUN_SECTIONS]


def render_plot(draw: Callable, run: RunData) -> bytes | None:
    """``draw(ax, run)`` on a fresh figure as PNG bytes; None when ``draw`` found no data (returned False)."""
    return _render_png(draw, run)


def _render_png(draw: Callable, run: RunData) -> bytes | None:
    try:
        import matplotlib
    except ImportError:
        raise ReportError("hfleet report draws with matplotlib, which is not installed: "
                          "pip install 'hybridfleet[report]'") from None

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    if not draw(ax, run):
        return None
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _summary_rows(run: RunData) -> list[tuple[str, str]]:
    s = run.summary or {}
    rows = [("job", run.job), ("status", run.status), ("framework", str(s.get("framework") or run.info.get("framework", "-"))),
            ("sync", str(s.get("sync") or run.info.get("sync", "-")))]
    if run.info.get("started"):
        rows.append(("started", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.info["started"]))))
    if s:
        rows.append(("joint test accuracy", str(s.get("test_accuracy"))))
        for site, acc in (s.get("site_alone_accuracy") or {}).items():
            rows.append((f"{site} alone", "-" if acc is None else f"{acc:.4f}"))
        for key in reported_sections(run):
            if key in DEFAULT_METRICS:
                continue  # the training loss is per batch; the accuracy is the summary's own row above
            joint, alone = final_values(run, key)
            rows.append((f"joint {metric_label(key)}", "-" if joint is None else f"{joint:.4f}"))
            rows += [(f"{site} alone: {key}", f"{v:.4f}") for site, v in alone.items()]
        for site, n in (s.get("bytes_sent_by_site") or {}).items():
            rows.append((f"bytes sent by {site}", f"{n:,}"))
        rows.append(("restarts", str(s.get("restarts"))))
        rows.append(("wall time (s)", str(s.get("wall_s"))))
    else:
        restarts = sum(1 for e in run.events if e.get("event") == "restart")
        rows.append(("restarts so far", str(restarts)))
        steps = [r["step"] for r in _workers(run) if isinstance(r.get("step"), int)]
        rows.append(("latest reported step", str(max(steps)) if steps else "-"))
    return rows


_ENV = Environment(loader=PackageLoader("hybridfleet.obs", "templates"), autoescape=select_autoescape(["html"]),
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)  # fmt: skip
STYLE = (resources.files("hybridfleet.obs") / "templates" / "report.css").read_text(encoding="utf-8")
# The report is one self-contained file, so its style is inline; a page serving it allows exactly this style.
STYLE_CSP_SOURCE = "'sha256-" + base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode() + "'"


def render_html(run: RunData, plots: dict[str, bytes | None]) -> str:
    """The report page for ``run`` with ``plots`` (section key -> PNG bytes, None when no data), in the order of
    `sections_for`; every value escaped."""
    notes = []
    if run.live:
        notes.append("This run is still in progress: the figures show the data written so far.")
    elif run.status == "stopped":
        notes.append("This run was stopped (Ctrl-C or SIGTERM) before it finished: a partial report.")
    elif run.status == "crashed":
        notes.append("This run stopped without writing summary.json (its supervisor is gone): a partial report.")
    elif run.status == "broken":
        notes.append("This run is broken: " + "; ".join(run.problems) + ".")
    if run.missing:
        notes.append("Missing: " + ", ".join(run.missing) + ".")
    if run.bad_lines:
        notes.append(f"{run.bad_lines} unreadable line(s) skipped (half-written?).")
    sections = [{"key": key, "title": title,
                 "png": None if plots.get(key) is None else base64.b64encode(plots[key]).decode()}
                for key, title, _ in sections_for(run)]  # fmt: skip
    return _ENV.get_template("report.html").render(
        style=Markup(STYLE), job=run.job, status=run.status, path=str(run.path), notes=notes,
        summary=_summary_rows(run), sections=sections,
        written=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))  # fmt: skip


def build_report(run_dir: str | Path) -> tuple[RunData, str, dict[str, bytes | None]]:
    """Load the run and draw every plot; returns (run, html, plots)."""
    run = load_run(run_dir)
    plots = {key: _render_png(draw, run) for key, _, draw in sections_for(run)}
    return run, render_html(run, plots), plots


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html`` (default: in the run directory) and ``report/<plot>.png`` next to it; returns the
    HTML path. Raises `ReportError` when ``run_dir`` is missing or not a run."""
    run, page, plots = build_report(run_dir)
    target = Path(out) if out is not None else run.path / REPORT_FILE
    store = FileStore(target.parent)
    for key, png in plots.items():
        if png is not None:
            store.put_bytes(f"{PLOTS_DIR}/{key}.png", png)
    store.put_bytes(target.name, page.encode("utf-8"))
    return target
