"""The live view's per-site figures, read from real ``/metrics`` endpoints (prometheus_client servers like the
workers'): a worker that exits keeps its last figures, marked with its exit code; the table shows the job's own
``test_*`` metric with its direction; each plain line names one phase and only its counters."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import httpx

from hybridfleet.obs.discovery import Target, write_targets
from hybridfleet.obs.live import (
    LiveDisplay, Phases, RunView, Snapshot, WorkerFigures, final_exits, pick_metric, plain_line, render, reported_figures,
)
from hybridfleet.obs.metrics import ProcessMetrics, WorkerMetrics, counter, serve_metrics
from hybridfleet.obs.runinfo import load_run
from tests.test_ui import in_process_ui


@contextmanager
def worker_endpoint(steps: int, sent: int, received: int, **reported: float):
    """A worker's metrics endpoint on 127.0.0.1 (steps, bytes by direction, reported values); yields
    ``(address, close)``: ``close()`` stops it as the worker's exit would."""
    metrics = ProcessMetrics()
    metrics.group(WorkerMetrics).steps.inc(steps)
    metrics.add_collector(lambda: [counter("hybridfleet_worker_bytes", "bytes", sent, {"direction": "uplink"}),
                                   counter("hybridfleet_worker_bytes", "bytes", received, {"direction": "downlink"})])
    metrics.report(steps, reported)
    server = serve_metrics(0, metrics=metrics)
    closed = []

    def close():
        if not closed:
            server.shutdown()
            server.server_close()
            closed.append(True)

    try:
        yield f"127.0.0.1:{server.server_port}", close
    finally:
        close()


def _target(address: str, site: str, worker: int) -> Target:
    return Target(address, {"job": "j", "role": "worker", "site": site, "process": f"worker-{site}-{worker}"})


def _training() -> Phases:
    phases = Phases()
    phases.start("training")
    return phases


def test_a_site_whose_workers_exited_keeps_their_last_figures_marked_exited():
    # Prepare: hospital has one worker, cloud one; hospital's exits with 0 before the run ends
    events = [{"process": "worker-hospital-0", "event": "start"}, {"process": "worker-cloud-0", "event": "start"}]
    with worker_endpoint(40, 4000, 3900, test_accuracy=0.91) as (hosp, close_hosp), \
            worker_endpoint(30, 8000, 7900, test_accuracy=0.88) as (cloud, _):
        view = RunView("j", [_target(hosp, "hospital", 0), _target(cloud, "cloud", 0)], lambda: (5.0, 10.0),
                       lambda: 0, _training(), read_exits=lambda: final_exits(events))
        before = view.snapshot()
        # Execute
        close_hosp()
        events.append({"process": "worker-hospital-0", "event": "exit", "returncode": 0})
        after = view.snapshot()
    # Assert
    assert before.sites["hospital"].steps == 40 and not before.sites["hospital"].exited
    hospital = after.sites["hospital"]
    assert (hospital.steps, hospital.uplink_bytes, hospital.downlink_bytes, hospital.metric) == (40, 4000, 3900, 0.91)
    assert hospital.workers_up == 0 and hospital.exited == {"worker-hospital-0": 0} and hospital.final
    assert hospital.workers_text() == "0/1 (1 exited, code 0)" and hospital.steps_per_s == 0.0
    assert after.sites["cloud"].workers_text() == "1/1" and not after.sites["cloud"].final
    line = plain_line("j", after)
    assert "hospital 0.0 worker steps/s up 4.0 kB down 3.9 kB test_accuracy 0.910 workers 0/1 (1 exited, code 0)" in line


def test_a_worker_the_view_never_scraped_shows_its_last_logged_figures(tmp_path):
    # Prepare: a live run dir (this pid) whose hospital worker already exited 1 and gave up
    run = tmp_path / "runs" / "j" / "r1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"job": "j", "pid": os.getpid(), "started": 1.7e9, "steps": 40,
                                              "sites": ["hospital", "cloud"], "framework": "torch", "sync": "bsp"}))
    records = [{"process": "worker-hospital-0", "site": "hospital", "step": s, "sent": 100 * s, "received": 90 * s,
                "test_bpc": 2.5 - s / 100} for s in (10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    events = [{"process": "worker-hospital-0", "event": "start"},
              {"process": "worker-hospital-0", "event": "exit", "returncode": 1},
              {"process": "worker-hospital-0", "event": "gave_up", "returncode": 1}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    with worker_endpoint(25, 5000, 4000, test_bpc=2.1) as (cloud, _):
        write_targets(run, [_target("127.0.0.1:1", "hospital", 0), _target(cloud, "cloud", 0)])
        before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        # Execute
        with in_process_ui(tmp_path / "runs") as url:
            page = httpx.get(f"{url}/runs/j/r1", timeout=30)
        loaded = load_run(run)
    # Assert
    assert page.status_code == 200
    assert reported_figures(loaded.metrics)["worker-hospital-0"] == WorkerFigures(20, 2000, 1800, {"test_bpc": 2.3})
    assert "<th>test_bpc</th>" in page.text
    assert '<tr class="final"><td>hospital</td><td>0/1 (1 exited, code 1) · final</td><td>20</td>' in page.text
    assert "<td>2.0 kB</td><td>1.8 kB</td><td>2.300</td>" in page.text
    assert "<td>cloud</td><td>1/1</td><td>25</td>" in page.text and "<td>2.100</td>" in page.text
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # the UI wrote nothing


def test_the_table_shows_the_jobs_own_metric_with_its_direction_and_the_worst_worker():
    # Prepare: a character model's two workers at one site
    with worker_endpoint(10, 1, 1, test_bpc=2.4, loss=1.7) as (a, _), \
            worker_endpoint(10, 1, 1, test_bpc=2.6, loss=1.8) as (b, _):
        view = RunView("charlm", [_target(a, "stdlib", 0), _target(b, "stdlib", 1)], lambda: (1.0, 2.0),
                       lambda: 0, _training())
        # Execute
        snap = view.snapshot()
    from rich.console import Console

    console = Console(width=140, record=True, file=open(os.devnull, "w"))
    console.print(render("charlm", snap))
    panel = console.export_text()
    # Assert: lower is better, so the site's worst worker is the higher bpc
    assert snap.metric_key == "test_bpc" and snap.sites["stdlib"].metric == 2.6
    assert "test_bpc: lower is better" in panel and "2.600" in panel and "accuracy" not in panel
    assert "stdlib 0.0 worker steps/s up 2 B down 2 B test_bpc 2.600" in plain_line("charlm", snap)
    assert pick_metric({"loss", "test_f1", "test_bpc"}) == "test_bpc"
    assert pick_metric({"loss", "test_accuracy", "test_bpc"}) == "test_accuracy"
    assert pick_metric({"loss", "elapsed_s"}) is None


def test_each_plain_line_names_one_phase_and_only_its_counters():
    # Prepare
    joining = Snapshot(phase="workers joining", phase_detail="2/4", phase_elapsed_s=3, rounds_done=152,
                       rounds_total=300)
    saving = Snapshot(phase="saving the model", phase_elapsed_s=4, rounds_done=0, rounds_total=300, restarts=1)
    training = Snapshot(phase="training", phase_elapsed_s=5, rounds_done=152, rounds_total=300)
    done = Snapshot(phases_done=[("training", 30.0), ("writing the report", 2.0)], rounds_done=300, rounds_total=300)
    # Execute
    lines = [plain_line("j", s) for s in (joining, saving, training, done)]
    # Assert
    assert lines[0] == "j: workers joining 2/4 (0m03s) | restarts 0"
    assert lines[1] == "j: saving the model (0m04s) | restarts 1"
    assert lines[2].startswith("j: training (0m05s) | round 152/300 (51%) eta")
    assert lines[3].startswith("j: done in 0m32s | round 300/300 (100%) | restarts 0")
    assert plain_line("j", Snapshot(phases_done=[("training", 3.0)], outcome="stopped")).startswith("j: stopped in 0m03s")


def test_final_exits_count_only_workers_gone_for_good():
    events = [{"process": "a", "event": "start"}, {"process": "a", "event": "exit", "returncode": 1},  # restarting
              {"process": "b", "event": "start"}, {"process": "b", "event": "exit", "returncode": 0},
              {"process": "c", "event": "exit", "returncode": 1}, {"process": "c", "event": "gave_up", "returncode": 1},
              {"process": "d", "event": "stop"}, {"process": "d", "event": "exit", "returncode": -15},
              {"process": "e", "event": "exit", "returncode": 0}, {"process": "e", "event": "restart"},
              {"process": "e", "event": "start"}]
    assert final_exits(events) == {"b": 0, "c": 1, "d": -15}


def test_off_a_terminal_the_display_writes_one_line_per_phase_then_the_final_figures(tmp_path):
    # Prepare: 7 of 10 rounds done, then the run moves on to saving the model
    phases = _training()
    stream = open(tmp_path / "out.txt", "w+")
    view = RunView("j", [], lambda: (7.0, 10.0), lambda: 0, phases)
    # Execute
    with LiveDisplay(view, stream=stream, terminal=False, plain_interval_s=0.001) as display:
        time.sleep(0.01)
        display.refresh()
        phases.start("saving the model")
        time.sleep(0.01)
        display.refresh()
        phases.finish()
    stream.seek(0)
    lines = stream.read().splitlines()
    # Assert
    assert lines[0].startswith("j: training") and "round 7/10" in lines[0]
    assert any(line.startswith("j: saving the model") and "round" not in line for line in lines)
    assert lines[-1].startswith("j: done in") and "round 7/10" in lines[-1]


def test_on_a_terminal_the_panel_hides_the_echo_of_control_characters_and_restores_it():
    # Prepare: a real pseudo-terminal as the display's stream
    import pty
    import termios

    controller, terminal = pty.openpty()
    stream = os.fdopen(terminal, "w")
    view = RunView("j", [], lambda: (1.0, 2.0), lambda: 0, _training())
    before = termios.tcgetattr(terminal)[3] & termios.ECHOCTL
    try:
        # Execute
        with LiveDisplay(view, stream=stream, terminal=True):
            during = termios.tcgetattr(terminal)[3] & termios.ECHOCTL
        after = termios.tcgetattr(terminal)[3] & termios.ECHOCTL
    finally:
        stream.close()
        os.close(controller)
    # Assert
    assert before and not during and after
