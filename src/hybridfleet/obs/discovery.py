"""Prometheus file-based service discovery for a run's processes.

`hfleet run` gives every process a metrics port and writes
``<run_dir>/prometheus/targets.json`` (the ``file_sd_configs`` format: targets with
their labels job, site, role, rank, process) plus ``prometheus.yml``, a scrape
config that reads every run's targets file under the run root. A Prometheus that
already runs only needs that ``file_sd_configs`` entry; it picks up new runs by
itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridfleet.store.file import FileStore

TARGETS_FILE = "prometheus/targets.json"
CONFIG_FILE = "prometheus/prometheus.yml"
SCRAPE_INTERVAL_S = 2


@dataclass
class Target:
    """One process's ``/metrics`` endpoint and the labels that identify it."""

    address: str  # host:port
    labels: dict[str, str] = field(default_factory=dict)


def write_targets(run_dir: Path, targets: list[Target]) -> Path:
    """Write ``run_dir/prometheus/targets.json`` atomically (Prometheus re-reads it on change)."""
    groups = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
    FileStore(run_dir).put_bytes(TARGETS_FILE, (json.dumps(groups, indent=1) + "\n").encode())
    return run_dir / TARGETS_FILE


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


def write_scrape_config(run_dir: Path, run_root: Path) -> Path:
    """``run_dir/prometheus/prometheus.yml``: scrapes the targets of every run under ``run_root``."""
    text = scrape_config(str(Path(run_root).resolve() / "*" / "*" / TARGETS_FILE))
    FileStore(run_dir).put_bytes(CONFIG_FILE, text.encode())
    return run_dir / CONFIG_FILE
