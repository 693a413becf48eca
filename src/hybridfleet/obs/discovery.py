"""Prometheus file-based service discovery for a run's processes.

`hfleet run` gives every process a metrics port and writes
``<run_dir>/prometheus/targets.json`` (the ``file_sd_configs`` format: targets with
their labels job, site, role, rank, process) plus ``prometheus.yml``, a scrape config.
Prometheus accepts a glob only in the last path element of a discovery file, so while
the run is live the same targets also sit in ``<run root>/prometheus-targets/
<job>-<timestamp>.json`` (`SD_DIR`), removed when the run ends: a Prometheus that
already runs needs one ``file_sd_configs`` entry, ``<run root>/prometheus-targets/*.json``,
and picks up every new run by itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridfleet.store.file import FileStore

TARGETS_FILE = "prometheus/targets.json"
CONFIG_FILE = "prometheus/prometheus.yml"
SD_DIR = "prometheus-targets"
SCRAPE_INTERVAL_S = 2


@dataclass
class Target:
    """One process's ``/metrics`` endpoint and the labels that identify it."""

    address: str  # host:port
    labels: dict[str, str] = field(default_factory=dict)


def live_targets_file(run_dir: Path) -> Path:
    """Where the live copy of a run's targets goes: ``<run root>/prometheus-targets/<job>-<timestamp>.json``."""
    run_dir = Path(run_dir).resolve()
    return run_dir.parent.parent / SD_DIR / f"{run_dir.parent.name}-{run_dir.name}.json"


def write_targets(run_dir: Path, targets: list[Target]) -> Path:
    """Write ``run_dir/prometheus/targets.json`` and its live copy atomically (Prometheus re-reads on change)."""
    data = (json.dumps([{"targets": [t.address], "labels": dict(t.labels)} for t in targets], indent=1) + "\n").encode()
    FileStore(run_dir).put_bytes(TARGETS_FILE, data)
    live = live_targets_file(run_dir)
    FileStore(live.parent).put_bytes(live.name, data)
    return run_dir / TARGETS_FILE


def retire_targets(run_dir: Path) -> None:
    """Remove the run's live targets file (the run ended; Prometheus stops scraping it)."""
    live_targets_file(run_dir).unlink(missing_ok=True)


def read_targets(run_dir: Path) -> list[Target]:
    """The targets of a run (empty when the run exported no metrics)."""
    path = Path(run_dir) / TARGETS_FILE
    if not path.is_file():
        return []
    return [Target(addr, dict(g.get("labels", {}))) for g in json.loads(path.read_text()) for addr in g["targets"]]


def scrape_config(targets_glob: str, interval_s: float = SCRAPE_INTERVAL_S, job_name: str = "hybridfleet") -> str:
    """A ``prometheus.yml`` scraping every targets file matching ``targets_glob``."""
    return (f"global:\n  scrape_interval: {interval_s:g}s\n  evaluation_interval: {interval_s:g}s\n"
            f"scrape_configs:\n  - job_name: {job_name}\n    file_sd_configs:\n"
            f"      - files: [{json.dumps(str(targets_glob))}]\n        refresh_interval: {interval_s:g}s\n")


def targets_glob(run_root: Path) -> str:
    """The ``file_sd_configs`` glob matching the live targets of every run under ``run_root``."""
    return str(Path(run_root).resolve() / SD_DIR / "*.json")


def write_scrape_config(run_dir: Path, run_root: Path) -> Path:
    """``run_dir/prometheus/prometheus.yml``: scrapes the live targets of every run under ``run_root``."""
    text = scrape_config(targets_glob(run_root))
    FileStore(run_dir).put_bytes(CONFIG_FILE, text.encode())
    return run_dir / CONFIG_FILE
