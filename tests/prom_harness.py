"""A real Prometheus for tests: Debian's `prometheus` binary on 127.0.0.1 with a temp config.

Installed by `.ci/install-prometheus.sh` (called from `.ci/run`); the tests skip with
that hint only where the binary is truly absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path


from hybridfleet.launch.preflight import free_port
from hybridfleet.obs.discovery import scrape_config, targets_glob
from tests.needs import missing

INSTALL_HINT = "Prometheus is not installed: run .ci/install-prometheus.sh (apt-get install prometheus)"


def require_prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        missing(INSTALL_HINT)
    return binary


class Prometheus:
    """One `prometheus` process scraping every run's targets file under ``run_root`` each second."""

    def __init__(self, workdir: Path, run_root: Path):
        binary = require_prometheus()
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(scrape_config(targets_glob(run_root), interval_s=1))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"prometheus did not become ready; see {workdir / 'prometheus.log'}")

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def targets_of(self, job: str, settle_s: float = 30.0) -> list[dict]:
        """The active targets labelled ``job`` once discovery has caught up with the targets files.

        File discovery re-reads on inotify events and every refresh interval; on a loaded machine
        the change lands a few seconds after the file does, so the list is read until it is empty
        or ``settle_s`` has passed, and whatever is left then is returned.
        """
        deadline = time.monotonic() + settle_s
        while True:
            found = [t for t in self.api("targets")["activeTargets"] if t["labels"].get("job") == job]
            if not found or time.monotonic() >= deadline:
                return found
            time.sleep(0.5)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}")["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
