"""What the runs pages of `hfleet ui` show of a run: plain strings and numbers from a `RunData`.

Like `pages`, every function here turns whatever a run directory holds into values of the
expected type, so a malformed file renders as escaped text, never as markup or a 500.

Units: a run's progress is counted in *worker steps* (each worker trains ``train.steps``
steps; in ``bsp`` one step of every worker makes one round of the shards), and a site's
figure is the sum over its workers' steps. The pages say which.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from hybridfleet.obs.live import SiteState, human_bytes
from hybridfleet.obs.metric_plots import DEFAULT_METRICS, final_values, metric_label, reported_sections
from hybridfleet.obs.runinfo import RunData
from hybridfleet.ui.pages import latest_step, number, status_of, when

LOG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.log")


def _summary(run: RunData) -> dict[str, Any]:
    return run.summary if isinstance(run.summary, dict) else {}


def _worker_records(run: RunData) -> list[dict[str, Any]]:
    return [r for r in run.metrics if str(r.get("process", "")).startswith("worker-")]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def started_s(run: RunData) -> float:
    """When the run started (run.json), else when its folder last changed; 0 when neither is known."""
    started = run.info.get("started")
    if isinstance(started, (int, float)) and not isinstance(started, bool):
        return float(started)
    try:
        return run.path.stat().st_mtime
    except OSError:
        return 0.0


def duration_s(run: RunData) -> float | None:
    """Seconds the run took (summary's wall time), has run so far (live), or ran until its last record."""
    wall = _summary(run).get("wall_s")
    if isinstance(wall, (int, float)) and not isinstance(wall, bool):
        return float(wall)
    started = run.info.get("started")
    if not isinstance(started, (int, float)):
        return None
    if run.live:
        return max(0.0, time.time() - started)
    stamps = [r["ts"] for r in run.events + run.metrics
              if isinstance(r.get("ts"), (int, float)) and not isinstance(r.get("ts"), bool)]  # fmt: skip
    return max(0.0, max(stamps) - started) if stamps else None


def duration_text(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``1h02m``; ``-`` when unknown."""
    if seconds is None or seconds != seconds:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def trained_nothing(run: RunData) -> str | None:
    """Why a finished run did not really train (no worker step reported, or no byte sent), else None.

    A live run is never flagged: it may still be starting."""
    if run.live:
        return None
    steps = [r["step"] for r in _worker_records(run) if _count(r.get("step")) > 0]
    if not steps:
        return "trained nothing: no worker reported a step"
    sent = _summary(run).get("bytes_sent_by_site")
    if isinstance(sent, dict) and sum(_count(v) for v in sent.values()) == 0:
        return "trained nothing: no site sent a byte"
    return None


def bytes_by_site(run: RunData) -> list[dict[str, Any]]:
    """Per site: bytes sent and received (the summary's, else the workers' latest reports) and sent by kind."""
    summary = _summary(run)
    sent, received = summary.get("bytes_sent_by_site"), summary.get("bytes_received_by_site")
    kinds = summary.get("bytes_sent_by_kind")
    if not isinstance(sent, dict):  # no summary yet: each worker's latest report
        last: dict[str, dict[str, Any]] = {}
        for r in _worker_records(run):
            last[str(r.get("process"))] = r
        sent, received, kinds = {}, {}, {}
        for r in last.values():
            site = str(r.get("site", "?"))
            sent[site] = sent.get(site, 0) + _count(r.get("sent"))
            received[site] = received.get(site, 0) + _count(r.get("received"))
            mine = kinds.setdefault(site, {})
            for key, n in r.items():
                if isinstance(key, str) and key.startswith("sent_"):
                    mine[key[5:]] = mine.get(key[5:], 0) + _count(n)
    received = received if isinstance(received, dict) else {}
    kinds = kinds if isinstance(kinds, dict) else {}
    rows = []
    for site in sorted(str(s) for s in sent):
        by_kind = kinds.get(site) if isinstance(kinds.get(site), dict) else {}
        rows.append({"site": site, "sent": human_bytes(_count(sent.get(site))), "sent_bytes": _count(sent.get(site)),
                     "received": human_bytes(_count(received.get(site))),
                     "kinds": [(str(k), human_bytes(_count(v))) for k, v in sorted(by_kind.items())]})  # fmt: skip
    return rows


def framework(run: RunData) -> str:
    value = _summary(run).get("framework") or run.info.get("framework")
    return str(value) if value else "-"


def run_row(run_id: str, run: RunData) -> dict[str, Any]:
    """One line of the runs list: status, start, duration, joint metric with its source, bytes, framework."""
    status, total, step = status_of(run), run.info.get("steps"), latest_step(run)
    empty = trained_nothing(run)
    done = total if status in ("completed", "degraded") and not empty else (step or 0)
    summary = _summary(run)
    source = summary.get("test_accuracy_source")
    return {"id": run_id, "job": run.job, "started": when(run.info.get("started")), "status": status,
            "duration": duration_text(duration_s(run)), "framework": framework(run),
            "total": total or None, "done": min(done, total) if total else None,
            "accuracy": number(summary.get("test_accuracy")), "accuracy_source": str(source) if source else "",
            "bytes": [(b["site"], b["sent"]) for b in bytes_by_site(run)], "empty": empty,
            "problems": list(run.problems)}  # fmt: skip


def _site(name: str, st: SiteState) -> dict[str, Any]:
    return {"name": name, "workers_up": st.workers_up, "workers": st.workers, "workers_text": st.workers_text(),
            "final": st.final, "steps": f"{st.steps:g}",
            "uplink": human_bytes(st.uplink_bytes), "downlink": human_bytes(st.downlink_bytes),
            "metric": "-" if st.metric is None else f"{st.metric:.3f}"}  # fmt: skip


def model_view(run: RunData) -> dict[str, Any] | None:
    """The model the run saved (summary.json ``model``) and the registry version it produced, if any."""
    model = _summary(run).get("model")
    if not isinstance(model, dict):
        return None
    reg = model.get("registered") if isinstance(model.get("registered"), dict) else {}
    name, version = reg.get("name"), reg.get("version")
    published = reg.get("published") is True and isinstance(name, str) and _count(version) > 0
    return {"url": str(model.get("url", "-")), "final_step": number(model.get("final_step")),
            "best_step": number(model.get("best_step")), "published": published,
            "name": str(name) if published else "", "version": f"v{version}" if published else "",
            "alias": str(reg.get("alias") or "") if published else "",
            "message": str(reg.get("message") or ("not published: the job has no registry block" if not reg else ""))}


def log_names(run: RunData) -> list[str]:
    """The process logs under the run's ``logs/`` (plain files with a log name), sorted."""
    logs = run.path / "logs"
    if not logs.is_dir():
        return []
    return sorted(p.name for p in logs.iterdir() if LOG_NAME.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def log_file(run_path: Path, name: str) -> Path | None:
    """The log ``name`` under ``run_path/logs`` when it is a plain file there (no link, no other folder)."""
    if not LOG_NAME.fullmatch(name):
        return None
    logs = (run_path / "logs").resolve()
    path = run_path / "logs" / name
    if path.is_symlink() or not path.is_file() or path.resolve().parent != logs:
        return None
    return path


def progress_text(step: Any, total: Any) -> str:
    """A live run's progress line, on its page and in its server-sent events."""
    return (f"furthest worker: worker step {step} of {total} (each worker trains {total} steps; "
            "in bsp one step of every worker is one round)")


def run_view(run_id: str, run: RunData, sites: dict[str, SiteState] | None, plots: list[tuple[str, str]],
             metric_key: str | None = None) -> dict:
    """One run: status, problems, live progress per site (``metric_key``: the metric its column shows),
    summary rows, model, bytes, logs, plots, what is missing."""
    summary = _summary(run)
    rows: list[tuple[str, str]] = []
    if run.summary is not None:
        source = summary.get("test_accuracy_source")
        rows = [("joint test accuracy", number(summary.get("test_accuracy")) + (f" ({source})" if source else "")),
                ("restarts", number(summary.get("restarts"))), ("duration", duration_text(duration_s(run)))]
        alone = summary.get("site_alone_accuracy")
        if isinstance(alone, dict):
            rows += [(f"{k} alone", number(v)) for k, v in alone.items()]
        for key in reported_sections(run):
            if key in DEFAULT_METRICS:
                continue  # the training loss is per batch; the accuracy is the summary's own row above
            joint, alone_by_site = final_values(run, key)
            rows.append((f"joint {metric_label(key)}", number(joint)))
            rows += [(f"{site} alone: {key}", number(v)) for site, v in alone_by_site.items()]
    step, total = latest_step(run), run.info.get("steps")
    missing = [m for m in run.missing if not (run.live and m == "summary.json")]  # written at the end
    return {"id": run_id, "status": status_of(run), "path": str(run.path), "problems": list(run.problems),
            "live": run.live, "step": "-" if step is None else step, "total": total or "-",
            "progress": progress_text("-" if step is None else step, total or "-"),
            "framework": framework(run), "duration": duration_text(duration_s(run)), "empty": trained_nothing(run),
            "sites": [_site(name, st) for name, st in sorted((sites or {}).items())],
            "metric_key": metric_key or "metric",
            "summary": rows, "missing": missing, "model": model_view(run), "bytes": bytes_by_site(run),
            "logs": log_names(run), "plots": plots}  # fmt: skip
