"""Server-rendered pages of `hfleet ui`: Jinja2 templates with autoescape, no scripts, no build chain.

Every value reaches a template through a view function here that turns whatever a run
directory or the registry holds into plain strings and numbers of the expected type, so a
malformed file renders as text (escaped by the template engine), never as markup or a 500.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from hybridfleet.obs.runinfo import RunData

STATUSES = ("completed", "degraded", "failed", "live", "stopped", "crashed", "broken", "unknown")
_ENV = Environment(loader=PackageLoader("hybridfleet.ui", "templates"), autoescape=select_autoescape(["html"]),
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)  # fmt: skip


def render(template: str, **values: Any) -> str:
    """The page ``template`` (under ui/templates) with ``values``; every value is HTML-escaped."""
    values.setdefault("refresh_s", None)
    values.setdefault("live_events", False)
    values.setdefault("registry", False)
    values.setdefault("signed_in", False)
    return _ENV.get_template(template).render(**values)


def when(seconds: Any) -> str:
    """A UNIX time as ``YYYY-MM-DD HH:MM:SS`` (UTC), ``-`` for anything else."""
    if not _number(seconds) or not 0 <= seconds < 1e11:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number(value: Any, digits: int = 4) -> str:
    """A metric for display: ints as they are, floats with ``digits`` significant digits, ``-`` for the rest."""
    if not _number(value):
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}g}"


def status_of(run: RunData) -> str:
    return run.status if run.status in STATUSES else "unknown"


def latest_step(run: RunData) -> int | None:
    steps = [r["step"] for r in run.metrics if isinstance(r.get("step"), int)
             and str(r.get("process", "")).startswith("worker-")]  # fmt: skip
    return max(steps) if steps else None


def _metric_detail(record: Any) -> str:
    if not isinstance(record, dict):
        return "no recorded source: counts as claimed"
    parts = [f"{k}={when(v) if k == 'at_s' else v}" for k, v in record.items() if k not in ("source", "replaced")]
    return ", ".join(parts)


def version_view(v: dict[str, Any], run_known: Callable[[str, str], bool] = lambda job, stamp: False) -> dict[str, Any]:
    """One version: formatted metrics with their source (checkpoint, claimed, measured), tags, who and when,
    and the run that produced it (``run``: its label, and ``href`` to its page and report when
    ``run_known(job, stamp)`` says this UI serves that run; None for a version not made by a run)."""
    sources = v.get("metric_sources") if isinstance(v.get("metric_sources"), dict) else {}
    metrics = v.get("metrics") if isinstance(v.get("metrics"), dict) else {}
    shown = []
    for name in sorted(metrics):
        record = sources.get(name)
        source = record.get("source") if isinstance(record, dict) else "claimed"
        shown.append({"name": str(name), "value": number(metrics[name]),
                      "source": source if source in ("checkpoint", "claimed", "measured") else "claimed",
                      "detail": _metric_detail(record)})  # fmt: skip
    tags = v.get("tags") if isinstance(v.get("tags"), dict) else {}
    return {"version": v.get("version"), "created": when(v.get("created_s")), "created_by": v.get("created_by", "-"),
            "framework": v.get("framework") or "-", "step": "-" if v.get("step") is None else v.get("step"),
            "metrics": shown, "tags": sorted((str(k), str(t)) for k, t in tags.items()),
            "run": _run_of(v.get("lineage"), run_known)}  # fmt: skip


def _run_of(lineage: Any, run_known: Callable[[str, str], bool]) -> dict[str, Any] | None:
    """The producing run from a version's lineage (job + run id), linked when this UI serves it."""
    if not isinstance(lineage, dict) or not isinstance(lineage.get("job"), str) or not isinstance(lineage.get("run_id"), str):
        return None
    job, stamp = lineage["job"], lineage["run_id"]
    href = f"/runs/{quote(job, safe='')}/{quote(stamp, safe='')}" if run_known(job, stamp) else None
    return {"label": f"{job} / {stamp}", "href": href, "report": f"{href}/report" if href else None}


def history_view(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(current aliases, alias history newest first) from the append-only history (oldest first)."""
    current: dict[str, dict[str, Any]] = {}
    rows = []
    for e in events:
        canary = e.get("canary_version")
        row = {"at": when(e.get("at_s")), "alias": e.get("alias"), "action": e.get("action"),
               "from_version": "-" if e.get("from_version") is None else f"v{e['from_version']}",
               "to_version": "-" if e.get("to_version") is None else f"v{e['to_version']}",
               "canary": "-" if canary is None else f"v{canary} at {number(e.get('canary_weight'))}%",
               "actor": e.get("actor", "-"), "reason": e.get("reason", "")}  # fmt: skip
        rows.append(row)
        current[str(e.get("alias"))] = {"alias": e.get("alias"), "version": e.get("to_version"),
                                        "canary": "-" if canary is None else f"v{canary}",
                                        "weight": "-" if canary is None else f"{number(e.get('canary_weight'))}%",
                                        "since": row["at"]}  # fmt: skip
    return [current[k] for k in sorted(current)], rows[::-1]
