"""`hfleet run` as a person sees it in a terminal (tmux): the live panel with rounds, ETA and per-site
rates, no log flood, the report path at the end; off a terminal, plain progress lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hybridfleet.obs.live import human_bytes
from hybridfleet.spec import load_spec
from hybridfleet.spec.resolved import resolved_job
from tests.obs_fixtures import demo_job
from tests.needs import missing

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # runs the torch demo
REPO = Path(__file__).resolve().parents[1]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=20, check=True).stdout


def test_live_panel_on_a_tty_shows_rounds_sites_and_the_report_path(tmp_path):
    # Prepare
    if shutil.which("tmux") is None:
        missing("tmux is not installed (apt-get install tmux)")
    job = demo_job(tmp_path, "torch", steps=150)
    session = f"hf-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "done"
    cmd = (f"cd {REPO} && PYTHONPATH={REPO / 'src'} {sys.executable} -m hybridfleet run {job} --no-baselines "
           f"--run-root {tmp_path / 'runs'}; echo $? > {done}; sleep 60")
    _tmux("new-session", "-d", "-s", session, "-x", "130", "-y", "45", cmd)
    try:
        # Execute
        panel, deadline = "", time.monotonic() + 240
        while time.monotonic() < deadline and not done.exists():
            screen = _tmux("capture-pane", "-p", "-t", session)
            if "steps/s" in screen and "hospital" in screen and "phase: training" in screen \
                    and "round " in screen and "round 0/" not in screen:
                panel = screen
            time.sleep(0.5)
        while time.monotonic() < deadline and not done.exists():
            time.sleep(0.5)
        final = _tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=20)
    # Assert
    assert done.read_text().strip() == "0", final
    assert "hfleet run digits-hybrid" in panel and "ETA" in panel, panel
    assert "phase: training" in panel and "(done: starting 2 shards" in panel, panel
    assert "hospital" in panel and "cloud" in panel and "uplink" in panel and "test_accuracy" in panel
    # the last panel keeps each site's figures once its workers exited, and says they did
    assert final.count("(2 exited, code 0)") == 2 and " 0 B " not in final, final
    assert '"component"' not in final  # no JSON log flood on the terminal
    assert "report: " in final and "report.html" in final


def test_off_a_tty_progress_is_plain_lines_not_a_log_flood(tmp_path):
    # Prepare
    job = demo_job(tmp_path, "torch", steps=100)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    # Execute
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "run", str(job), "--no-baselines",
                             "--run-root", str(tmp_path / "runs")], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=180)
    # Assert
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    progress = [line for line in lines if line.startswith("digits-hybrid: ") and " round " in line]
    assert progress and "hospital" in progress[-1] and "worker steps/s" in progress[-1]
    # every line names the phase the run is in, with its own elapsed time; the last one the summary's bytes
    assert all(line.split(": ", 1)[1].split(" | ")[0].endswith("s)") for line in progress[:-1]), progress
    summary = json.loads(next((tmp_path / "runs").glob("*/*/summary.json")).read_text())
    sent = summary["bytes_sent_by_site"]["hospital"]
    assert f"hospital 0.0 worker steps/s up {human_bytes(sent)}" in progress[-1], (progress[-1], sent)
    # one phase per line: rounds and site figures only while training and in the final line, all rounds counted
    mixed = [line for line in lines if line.startswith("digits-hybrid: ") and " round " in line
             and not line.split(": ", 1)[1].startswith(("training", "done in"))]
    assert not mixed, mixed
    assert progress[-1].startswith("digits-hybrid: done in ") and "round 100/100 (100%)" in progress[-1], progress[-1]
    wall_s = time.monotonic() - started
    assert len(lines) <= 12 + wall_s / 5, lines  # one plain line every 5 s and a few more, not one per log record
    # the run keeps the job as it ran, defaults filled in
    run_dir = next((tmp_path / "runs").glob("*/*"))
    assert json.loads((run_dir / "job.json").read_text()) == resolved_job(load_spec(job))
    assert "report: " in result.stdout


def test_a_failing_worker_shows_its_last_log_lines_without_verbose(tmp_path):
    # Prepare: a script that dies at once
    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('loading site data', flush=True)\nsys.exit('cannot open site data: /nope')\n")
    job = demo_job(tmp_path, "torch", steps=10)
    text = job.read_text().replace(str(REPO / "examples" / "digits" / "train_torch.py"), str(script))
    job.write_text(text.replace("max_restarts: 2", "max_restarts: 0"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    # Execute
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "run", str(job), "--no-baselines",
                             "--run-root", str(tmp_path / "runs")], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=180)
    # Assert
    assert result.returncode == 8
    assert "worker-hospital-0 exited 1" in result.stderr
    assert "cannot open site data: /nope" in result.stderr
    assert "Traceback" not in result.stderr.split("cannot open site data")[0].splitlines()[-1]


def test_an_unknown_scalars_choice_is_refused_before_anything_starts(tmp_path):
    # Prepare
    job = demo_job(tmp_path, "torch", steps=10)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    # Execute
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "run", str(job), "--scalars", "wandb",
                             "--run-root", str(tmp_path / "runs")], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=60)
    # Assert
    assert result.returncode == 8 and "must be one of auto, tensorboard, visualdl, off" in result.stderr
    assert not (tmp_path / "runs").exists()
