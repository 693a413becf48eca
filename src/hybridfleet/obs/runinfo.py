"""Reading a run directory: what it holds, whether it is live, finished or crashed.

`hfleet run` writes ``run.json`` first, then ``events.jsonl`` and ``metrics.jsonl`` as
the run goes, and ``summary.json`` last. A directory with none of these is not a run.
Half-written lines (a crash mid-write) are skipped and counted, never fatal.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridfleet.errors import ReportError

RUN_FILES = ("run.json", "events.jsonl", "metrics.jsonl", "summary.json")


@dataclass
class RunData:
    """The parsed contents of one run directory."""

    path: Path
    info: dict[str, Any] = field(default_factory=dict)       # run.json
    summary: dict[str, Any] | None = None                    # summary.json (absent while live or after a crash)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)          # what a complete run has and this one lacks
    bad_lines: int = 0
    status: str = "unknown"  # completed | degraded | failed | live | crashed

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


def _read_json(path: Path, run: RunData) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        run.missing.append(f"{path.name} (unreadable: half-written?)")
        return None
    return value if isinstance(value, dict) else None


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
        run.info = _read_json(root / "run.json", run) or {}
    if (root / "summary.json").is_file():
        run.summary = _read_json(root / "summary.json", run)
    for name, attr in (("metrics.jsonl", "metrics"), ("events.jsonl", "events")):
        if (root / name).is_file():
            records, bad = _read_jsonl(root / name)
            setattr(run, attr, records)
            run.bad_lines += bad
    if run.summary is not None:
        run.status = str(run.summary.get("status", "unknown"))
    elif _pid_alive(run.info.get("pid")):
        run.status = "live"
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
