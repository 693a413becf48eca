"""One real demo run per framework, scraped by a real Prometheus while it trains.

Shared by the metrics, Grafana, report and UI tests (imported by conftest.py), so the
suite trains each demo once: the digits job with a hospital and a cloud site, 2
shards, TLS and tokens, site baselines and shard snapshots on.
"""

from __future__ import annotations

import shutil
import subprocess
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.prom_harness import Prometheus
from tests.needs import missing

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"torch": "digits-hybrid.yaml", "paddle": "digits-hybrid-paddle.yaml"}
# Long enough that every shard is scraped many times while its rounds move: Prometheus hands
# newly discovered targets to its scrapers at most every 5 s (its discovery manager's update
# interval), so the run's targets are first scraped 4-5 s after the targets file is written. At
# 200 steps the paddle demo's rounds ran for about 3 s after that on a quiet host, and on a
# loaded one they once ended before a second scrape of the shards (their rate panels empty).
DEMO_STEPS = 600


@dataclass
class DemoRun:
    framework: str
    prometheus: Prometheus
    run_dir: Path
    summary: dict
    started: float
    finished: float
    steps_rate_during_run: float = 0.0
    expositions: dict[str, str] = field(default_factory=dict)  # process -> /metrics text, taken mid-run
    active_targets: list[dict] = field(default_factory=list)    # Prometheus's targets, mid-run


def demo_job(tmp: Path, framework: str, steps: int = DEMO_STEPS) -> Path:
    data = yaml.safe_load((REPO / "examples" / EXAMPLES[framework]).read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["train"]["steps"] = steps
    data["ps"]["snapshot_every_steps"] = 50
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session", params=["torch", "paddle"])
def demo_run(request, tmp_path_factory) -> DemoRun:
    from hybridfleet.obs.discovery import read_targets
    from hybridfleet.spec import load_spec

    framework = request.param
    tmp = tmp_path_factory.mktemp(f"demo-{framework}")
    runs = tmp / "runs"
    prom = Prometheus(tmp / "prometheus", runs)
    request.addfinalizer(prom.close)
    job = demo_job(tmp, framework)
    spec = load_spec(job)
    started = time.time()
    log = (tmp / "hfleet-run.out").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "run", str(job), "--run-root", str(runs), "--quiet"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    rate, expositions, active = 0.0, {}, []
    expr = f'sum(rate(hybridfleet_worker_steps_total{{job="{spec.name}"}}[5s]))'
    while proc.poll() is None:
        time.sleep(1.0)
        found = prom.query(expr)
        rate = max(rate, float(found[0]["value"][1]) if found else 0.0)
        run_dirs = list((runs / spec.name).glob("*"))
        if run_dirs:
            # every live process's exposition, read again at each pass so the last one taken while
            # it ran is kept (independent of when Prometheus first saw the steps move: on a loaded
            # host that can be after the workers have finished)
            for target in read_targets(run_dirs[0]):
                try:
                    with urllib.request.urlopen(f"http://{target.address}/metrics", timeout=2) as resp:
                        expositions[target.labels["process"]] = resp.read().decode()
                except OSError:  # not up yet, or it stopped (a worker that finished)
                    continue
        if rate > 0 and run_dirs:
            now = [t for t in prom.api("targets")["activeTargets"] if t["labels"].get("job") == spec.name]
            if len(now) > len(active):
                active = now
    log.close()
    finished = time.time()
    out = (tmp / "hfleet-run.out").read_text(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    run_dir = next((runs / spec.name).glob("*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    return DemoRun(framework, prom, Path(summary["run_dir"]), summary, started, finished, rate, expositions, active)


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        missing("promtool is not installed: run .ci/install-prometheus.sh (apt-get install prometheus)")
    return binary


def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
