"""The live view's phases and final figures, without a run: the pieces `hfleet run` drives."""

from __future__ import annotations

import io
import time

from hybridfleet.obs.live import LiveDisplay, Phases, RunView, Snapshot, apply_summary, phase_text, plain_line


def test_phases_keep_their_order_and_each_its_own_time():
    phases = Phases()
    phases.start("starting 2 shards")
    time.sleep(0.02)
    phases.start("workers joining", "0/4")
    phases.set_detail("3/4")
    current, detail, elapsed, done = phases.read()
    assert (current, detail) == ("workers joining", "3/4") and elapsed >= 0
    assert [name for name, _ in done] == ["starting 2 shards"] and done[0][1] >= 0.02
    phases.finish()
    assert phases.read()[0] is None and [n for n, _ in phases.read()[3]] == ["starting 2 shards", "workers joining"]


def test_plain_line_names_the_phase_rounds_and_worker_steps_apart():
    snap = Snapshot(phase="training", phase_elapsed_s=5, rounds_done=3, rounds_total=10)
    line = plain_line("job", snap)
    assert line.startswith("job: training (0m05s) | round 3/10 (30%)")
    assert phase_text(Snapshot()) == ""


def test_the_last_view_shows_the_summarys_bytes_not_a_late_scrape():
    stream = io.StringIO()
    view = RunView("job", [], lambda: (10.0, 10.0), lambda: 0, Phases())
    summary = {"bytes_sent_by_site": {"a": 23_300_000}, "bytes_received_by_site": {"a": 1_000}, "restarts": 1}
    with LiveDisplay(view, stream=stream, terminal=False) as display:
        display.show_final(summary)
    last = stream.getvalue().splitlines()[-1]
    assert "a 0.0 worker steps/s up 23.3 MB down 1.0 kB" in last and "restarts 1" in last
    assert apply_summary(Snapshot(), summary).sites["a"].uplink_bytes == 23_300_000
