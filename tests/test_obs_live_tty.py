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
import yaml

from hybridfleet.obs.live import human_bytes
from hybridfleet.spec import load_spec
from hybridfleet.spec.resolved import resolved_job
from tests.obs_fixtures import demo_job
from tests.needs import missing

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # runs the torch demo
REPO = Path(__file__).resolve().parents[1]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=20, check=True).stdout


def _job(tmp_path: Path, steps: int, workers_per_site: int = 2, eval_every_steps: int = 50) -> Path:
    """The torch demo job with ``steps`` rounds, ``workers_per_site`` workers at each site and an evaluation every
    ``eval_every_steps``."""
    job = demo_job(tmp_path, "torch", steps=steps)
    data = yaml.safe_load(job.read_text())
    for site in data["sites"].values():
        site["workers"] = workers_per_site
    data["train"]["eval_every_steps"] = eval_every_steps
    job.write_text(yaml.safe_dump(data))
    return job


def _run_in_tmux(tmp_path: Path, job: Path) -> tuple[str, Path]:
    """`hfleet run` of ``job`` in a 130x45 tmux pane (a real pty and terminal emulator); returns the session and
    the file its exit code goes to. The shell survives Ctrl-C (a trap, reset to the default in hfleet) and the
    pane stays after it ends, so the screen can be read back."""
    if shutil.which("tmux") is None:
        missing("tmux is not installed (apt-get install tmux)")
    session = f"hf-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "done"
    cmd = (f"trap true INT; cd {REPO} && PYTHONPATH={REPO / 'src'} {sys.executable} -m hybridfleet run {job} "
           f"--no-baselines --run-root {tmp_path / 'runs'}; echo $? > {done}; "
           "for _ in $(seq 60); do sleep 1; done")  # a late Ctrl-C ends one sleep, not the shell and its tty
    _tmux("new-session", "-d", "-s", session, "-x", "130", "-y", "45", cmd)
    _tmux("set-option", "-t", session, "remain-on-exit", "on")
    return session, done


def test_live_panel_on_a_tty_shows_rounds_sites_and_the_report_path(tmp_path):
    # Prepare: two workers a site, a test accuracy from round 20 on, so the panel shows each figure while training
    session, done = _run_in_tmux(tmp_path, _job(tmp_path, steps=60, eval_every_steps=20))
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
    assert "hospital" in panel and "cloud" in panel and "uplink" in panel, panel
    # the last panel keeps each site's figures once its workers exited, its metric included (on a fast
    # host the evaluations can all fall after the last training panel: the workers' logged records
    # give it), and says they did
    assert final.count("(2 exited, code 0)") == 2 and " 0 B " not in final, final
    assert "test_accuracy" in final and "test_accuracy -" not in final, final
    assert '"component"' not in final  # no JSON log flood on the terminal
    assert "report: " in final and "report.html" in final


def test_ctrl_c_leaves_one_panel_on_the_screen(tmp_path):
    # Prepare: a long run in a real terminal (one worker a site: the panel, not the site figures, is under test)
    session, done = _run_in_tmux(tmp_path, _job(tmp_path, steps=5000, workers_per_site=1))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "phase: training" not in _tmux("capture-pane", "-p", "-t", session):
            time.sleep(0.5)
        time.sleep(2)  # a few redraws while training
        tty = _tmux("display-message", "-p", "-t", session, "#{pane_tty}").strip()
        flags_live = subprocess.run(["stty", "-F", tty, "-a"], capture_output=True, text=True, timeout=20).stdout
        # Execute: Ctrl-C as typed (the terminal sends SIGINT to its foreground process group, and echoes it),
        # pressed again while the run stops, so some press lands while the panel is being redrawn
        for _ in range(12):
            if done.exists():
                break
            subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], capture_output=True, timeout=20)
            time.sleep(0.15)
        while time.monotonic() < deadline and not done.exists():
            time.sleep(0.5)
        final = _tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", session)
        flags_after = subprocess.run(["stty", "-F", tty, "-a"], capture_output=True, text=True, timeout=20).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=20)
    # Assert: one panel, top and bottom border once each, then the one-line error
    assert done.read_text().strip() == "130", final
    assert final.count("hfleet run digits-hybrid") == 1 and final.count("╭") == 1 and final.count("╰") == 1, final
    assert "error: interrupted by Ctrl-C" in final and "Traceback" not in final
    assert "phase: stopped" in final and "phase: done" not in final  # the panel says the run was stopped
    # while the panel is drawn, the terminal does not echo ^C (it would wrap the panel's full-width last line and
    # shift every later redraw one line down); the terminal's setting is back afterwards
    assert "-echoctl" in flags_live.split() and "echoctl" in flags_after.split(), (flags_live, flags_after)


def test_off_a_tty_progress_is_plain_lines_not_a_log_flood(tmp_path):
    # Prepare
    job = demo_job(tmp_path, "torch", steps=40)  # training may end between two plain lines: the last one still counts it
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
    assert progress[-1].startswith("digits-hybrid: done in ") and "round 40/40 (100%)" in progress[-1], progress[-1]
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
