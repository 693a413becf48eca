"""The Prometheus targets of a run's processes, each learnt from the port the process bound itself.

`hfleet run` starts every process with ``HFLEET_METRICS_PORT=0`` and its own
``HFLEET_METRICS_PORT_FILE`` (``run_dir/metrics-ports/<process>.port``): the process binds a
free port and writes it there (`hybridfleet.obs.metrics.serve_from_env`). No port is picked
here and released for the process to take later, so no other process (a shard's gRPC port, a
connection's local port) can take it in between and stop the process from starting. A
restarted process binds the port its file names when that port is still free, so its target
stays; otherwise its new port replaces the old one in the targets.

`RunTargets` reads the port files while the run is live and rewrites ``targets.json`` (and its
live copy, `hybridfleet.obs.discovery`) whenever one appears or changes. The list it keeps is
the one the live view reads, changed in place.
"""

from __future__ import annotations

import threading
from pathlib import Path

from hybridfleet.launch.supervisor import ProcessSpec
from hybridfleet.obs.discovery import Target, write_targets
from hybridfleet.obs.metrics import ENV_PORT, ENV_PORT_FILE
from hybridfleet.portfile import read_port_file

PORTS_DIR = "metrics-ports"
POLL_S = 0.25


def process_labels(job: str, p: ProcessSpec) -> dict[str, str]:
    """The labels of a process's target: job, role, process, and site and rank where they apply."""
    env = p.env or {}
    labels = {"job": job, "role": p.role, "process": p.name}
    if "HFLEET_SITE" in env:
        labels["site"] = env["HFLEET_SITE"]
    if p.role == "shard":
        labels["rank"] = p.name.rsplit("-", 1)[-1]
    elif "HFLEET_RANK" in env and p.role == "worker":
        labels["rank"] = env["HFLEET_RANK"]
    return labels


class RunTargets:
    """The targets of one run: ``fixed`` ones known up front (the run's own exporter) and one per
    attached process once it has written its port file.

    ``targets`` is the list given (shared with the live view); `refresh` changes it in place and
    writes the targets files when it changed. `start` refreshes from a thread every `POLL_S`;
    `stop` ends that thread after a last refresh.
    """

    def __init__(self, job: str, run_dir: Path, targets: list[Target], host: str = "127.0.0.1"):
        self.job = job
        self.run_dir = Path(run_dir)
        self.host = host
        self.targets = targets
        self._fixed = list(targets)
        self._procs: dict[str, tuple[Path, dict[str, str]]] = {}  # process -> (port file, labels), in start order
        self._written: list[tuple[str, tuple]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def port_file(self, process: str) -> Path:
        return self.run_dir / PORTS_DIR / f"{process}.port"

    def attach(self, procs: list[ProcessSpec]) -> None:
        """Have each process bind its own metrics port and write it where `refresh` reads it."""
        with self._lock:
            for p in procs:
                path = self.port_file(p.name)
                p.env = {**(p.env or {}), ENV_PORT: "0", ENV_PORT_FILE: str(path)}
                self._procs[p.name] = (path, process_labels(self.job, p))

    def refresh(self) -> bool:
        """Read every port file; rewrite the targets (list and files) when they changed. True when they did."""
        with self._lock:
            found = list(self._fixed)
            for path, labels in self._procs.values():
                port = read_port_file(path)
                if port is not None:
                    found.append(Target(f"{self.host}:{port}", dict(labels)))
            key = [(t.address, tuple(sorted(t.labels.items()))) for t in found]
            if key == self._written:
                return False
            self.targets[:] = found
            write_targets(self.run_dir, found)
            self._written = key
            return True

    def start(self) -> "RunTargets":
        self.refresh()
        self._thread = threading.Thread(target=self._poll, name="metrics-targets", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.refresh()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self.refresh()
