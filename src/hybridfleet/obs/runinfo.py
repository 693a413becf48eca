"""Reading a run directory: what it holds, whether it is live, finished or crashed.

`hfleet run` writes ``run.json`` first, then ``events.jsonl`` and ``metrics.jsonl`` as
the run goes, and ``summary.json`` last. A directory with none of these is not a run.
A run without summary.json whose supervisor is gone was ``stopped`` when the supervisor
recorded stopping a worker, or stopping the shards before any worker started (Ctrl-C or
SIGTERM: it exits 130 / 143 without a summary; a run that ends normally stops only its
shards, after every worker exited), else ``crashed``.
Half-written lines (a crash mid-write) are skipped and counted, never fatal. A ``run.json``
that is not a JSON object, or whose known fields have the wrong type, makes the run
``broken``: its problems are listed and the offending fields dropped, so no reader ever
acts on a value of the wrong type.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridfleet.errors import ReportError

RUN_FILES = ("run.json", "events.jsonl", "metrics.jsonl", "summary.json")
JOB_COPY = "job.json"  # the resolved job (hybridfleet.spec.resolved); runs made before it existed lack it


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The fields of run.json its readers use, and the type each must have.
_RUN_FIELDS = {
    "job": ("a string", lambda v: isinstance(v, str)),
    "framework": ("a string", lambda v: isinstance(v, str)),
    "sync": ("a string", lambda v: isinstance(v, str)),
    "pid": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "started": ("a UNIX time in seconds", lambda v: _is_number(v) and 0 <= v < 1e11),
    "steps": ("an integer >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "sites": ("a list of site names", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _per_site(check):
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


# The fields of summary.json its readers use.
_SUMMARY_FIELDS = {
    "job": _RUN_FIELDS["job"], "framework": _RUN_FIELDS["framework"], "sync": _RUN_FIELDS["sync"],
    "status": ("a string", lambda v: isinstance(v, str)),
    "test_accuracy": ("a number or null", lambda v: v is None or _is_number(v)),
    "restarts": ("an integer >= 0", _RUN_FIELDS["steps"][1]),
    "wall_s": ("a number", _is_number),
    "site_alone_accuracy": ("an object of site: number", _per_site(lambda x: x is None or _is_number(x))),
    "bytes_sent_by_site": ("an object of site: bytes", _per_site(_is_count)),
    "bytes_received_by_site": ("an object of site: bytes", _per_site(_is_count)),
    "bytes_sent_by_kind": ("an object of site: {kind: bytes}", _per_site(_per_site(_is_count))),
    "test_accuracy_source": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "model": ("an object or null", lambda v: v is None or isinstance(v, dict)),
}  # fmt: skip


@dataclass
class RunData:
    """The parsed contents of one run directory."""

    path: Path
    info: dict[str, Any] = field(default_factory=dict)       # run.json
    summary: dict[str, Any] | None = None                    # summary.json (absent while live or after a crash)
    job_spec: dict[str, Any] | None = None                   # job.json: the resolved job as it ran (secrets redacted)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)          # what a complete run has and this one lacks
    problems: list[str] = field(default_factory=list)         # why the run is broken (malformed run.json)
    bad_lines: int = 0
    status: str = "unknown"  # completed | degraded | failed | live | stopped | crashed | broken

    @property
    def job(self) -> str:
        return str((self.summary or {}).get("job") or self.info.get("job") or self.path.parent.name)

    @property
    def live(self) -> bool:
        return self.status == "live"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    records, bad = [], 0
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(rec, dict):
                records.append(rec)
            else:
                bad += 1
    return records, bad


def _checked(path: Path, run: RunData, fields: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """The file's JSON object with every known field of the right type; each problem recorded on ``run``."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        run.problems.append(f"{path.name} is not readable JSON ({type(err).__name__})")
        return {}
    if not isinstance(value, dict):
        run.problems.append(f"{path.name} holds a JSON {type(value).__name__}, not an object")
        return {}
    out = {}
    for key, item in value.items():
        check = fields.get(key)
        if check is not None and not check[1](item):
            run.problems.append(f"{path.name}: {key!r} must be {check[0]}")
            continue
        out[key] = item
    return out


def _stopped_by_signal(events: list[dict[str, Any]]) -> bool:
    stopped = [str(e.get("process", "")) for e in events if e.get("event") == "stop"]
    workers_started = any(e.get("event") == "start" and not str(e.get("process", "")).startswith("shard-")
                          for e in events)  # fmt: skip
    return bool(stopped) and (any(not p.startswith("shard-") for p in stopped) or not workers_started)


def load_run(path: str | os.PathLike[str]) -> RunData:
    """Parse a run directory; raises `ReportError` when it does not exist or is not a run."""
    root = Path(path)
    if not root.exists():
        raise ReportError(f"run directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise ReportError(f"{str(root)!r} is not a directory; give a run directory (runs/<job>/<timestamp>)")
    present = [name for name in RUN_FILES if (root / name).is_file()]
    if not present:
        raise ReportError(f"{str(root)!r} is not a hybridfleet run directory: it has none of "
                          f"{', '.join(RUN_FILES)}")
    run = RunData(path=root)
    run.missing = [name for name in RUN_FILES if name not in present]
    if (root / "run.json").is_file():
        run.info = _checked(root / "run.json", run, _RUN_FIELDS)
    if (root / JOB_COPY).is_file():
        run.job_spec = _checked(root / JOB_COPY, run, {}) or None
    if (root / "summary.json").is_file():
        run.summary = _checked(root / "summary.json", run, _SUMMARY_FIELDS) or None
    for name, attr in (("metrics.jsonl", "metrics"), ("events.jsonl", "events")):
        if (root / name).is_file():
            records, bad = _read_jsonl(root / name)
            setattr(run, attr, records)
            run.bad_lines += bad
    if run.problems:
        run.status = "broken"
    elif run.summary is not None:
        run.status = str(run.summary.get("status", "unknown"))
    elif _pid_alive(run.info.get("pid")):
        run.status = "live"
    elif _stopped_by_signal(run.events):
        run.status = "stopped"
    else:
        run.status = "crashed"
    return run


def list_runs(root: str | os.PathLike[str]) -> list[Path]:
    """Run directories under ``root`` (``<root>/<job>/<timestamp>``), newest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [d for d in base.glob("*/*") if d.is_dir() and any((d / n).is_file() for n in RUN_FILES)]
    return sorted(found, key=lambda d: d.stat().st_mtime, reverse=True)
