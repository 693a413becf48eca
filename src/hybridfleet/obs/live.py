"""The live view of `hfleet run`: the run's phase, rounds with ETA and, per site, worker step
rate, bytes and the job's own metric (``test_accuracy``, ``test_bpc``, ...: `pick_metric`).

From the first second it names what the run is doing (`Phases`: starting shards, workers
joining n/N, training, saving the model, publishing, writing the report), each phase with its
own elapsed time. The shards' rounds and the workers' own steps are kept apart: the head counts
rounds, the table worker steps per second. Its numbers come from the processes' own
``/metrics`` endpoints (the same series Prometheus scrapes) and from the supervisor's events;
the last panel shows the summary's figures. On a terminal it is a rich `Live` panel redrawn
about once a second; anywhere else (CI, a log file) one plain line every ``plain_interval_s``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from hybridfleet.obs.discovery import Target
from hybridfleet.obs.log import get_logger
from hybridfleet.obs.metric_direction import lower_is_better
from hybridfleet.obs.metric_plots import is_metric_key
from hybridfleet.obs.scrape import Scraped, scrape_all

_log = get_logger("obs.live")

ACCURACY_KEYS = ("test_accuracy", "val_accuracy", "accuracy")


def pick_metric(keys: set[str] | list[str]) -> str | None:
    """The metric the live table shows among the reported ``keys``: ``test_accuracy``, else the first ``test_*``
    metric (by name) whose name says which way is better (``test_bpc``), else an accuracy; None when none."""
    keys = set(keys)
    if "test_accuracy" in keys:
        return "test_accuracy"
    tests = sorted(k for k in keys if k.startswith("test_") and lower_is_better(k) is not None)
    if tests:
        return tests[0]
    return next((k for k in ACCURACY_KEYS if k in keys), None)


@dataclass
class WorkerFigures:
    """One worker's latest totals: its steps, bytes and the metrics it reported (name -> value)."""

    steps: float = 0.0
    uplink_bytes: float = 0.0
    downlink_bytes: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SiteState:
    """What the view shows for one site; a worker that exited keeps its last figures in the sums."""

    workers: int = 0
    workers_up: int = 0
    steps: float = 0.0
    steps_per_s: float = 0.0
    uplink_bytes: float = 0.0
    downlink_bytes: float = 0.0
    metric: float | None = None  # the view's metric (Snapshot.metric_key), the site's worst worker
    exited: dict[str, int] = field(default_factory=dict)  # worker process -> exit code, for workers gone for good

    def workers_text(self) -> str:
        """``2/2``, or with exited workers ``0/2 (2 exited, code 0)`` / ``0/2 (2 exited, codes 0,1)``."""
        text = f"{self.workers_up}/{self.workers}"
        if not self.exited:
            return text
        codes = sorted(set(self.exited.values()))
        word = "code" if len(codes) == 1 else "codes"
        return f"{text} ({len(self.exited)} exited, {word} {','.join(str(c) for c in codes)})"

    @property
    def final(self) -> bool:
        """Whether every worker of the site exited: its figures are final."""
        return self.workers > 0 and len(self.exited) >= self.workers


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def reported_figures(metrics: list[dict]) -> dict[str, WorkerFigures]:
    """Worker process -> its last logged figures (step, bytes sent and received, every metric it reported),
    from a run's metrics.jsonl records: what the live view shows for a worker that no longer answers."""
    out: dict[str, WorkerFigures] = {}
    for r in metrics:
        if not str(r.get("process", "")).startswith("worker-"):
            continue
        fig = out.setdefault(str(r.get("process")), WorkerFigures())
        fig.steps = float(max(fig.steps, _count(r.get("step"))))
        fig.uplink_bytes = float(max(fig.uplink_bytes, _count(r.get("sent"))))
        fig.downlink_bytes = float(max(fig.downlink_bytes, _count(r.get("received"))))
        for key, value in r.items():
            if is_metric_key(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                fig.metrics[key] = float(value)
    return out


def final_exits(events: list[dict]) -> dict[str, int]:
    """Process name -> exit code for each process of the supervisor's ``events`` that finished for good: it
    exited 0, gave up, or exited after a stop (an exit with another code may still be restarted)."""
    state: dict[str, tuple[str, int | None, bool]] = {}  # process -> (last event, last code, stop asked)
    for e in events:
        name, event, code = str(e.get("process", "")), e.get("event"), e.get("returncode")
        last, last_code, stopped = state.get(name, ("", None, False))
        if event == "start":
            state[name] = ("start", None, False)
        elif event == "stop":
            state[name] = (last, last_code, True)
        elif event in ("exit", "gave_up", "restart"):
            state[name] = (event, code if isinstance(code, int) else last_code, stopped)
    out = {}
    for name, (event, code, stopped) in state.items():
        if code is None:
            continue
        if event == "gave_up" or (event == "exit" and (code == 0 or stopped)):
            out[name] = code
    return out


class Phases:
    """The run's named phases in order, each with its own elapsed time (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done: list[tuple[str, float]] = []
        self.current: str | None = None
        self.detail = ""
        self.outcome = "done"  # how the phases ended: done, stopped (Ctrl-C / SIGTERM) or failed
        self._since = time.monotonic()

    def start(self, name: str, detail: str = "") -> None:
        """End the current phase (its time is kept) and begin ``name``."""
        with self._lock:
            now = time.monotonic()
            if self.current is not None:
                self.done.append((self.current, now - self._since))
            self.current, self.detail, self._since = name, detail, now

    def set_detail(self, detail: str) -> None:
        with self._lock:
            self.detail = detail

    def finish(self, outcome: str = "done") -> None:
        """End the current phase; ``outcome`` says how the run ended (``done``, ``stopped``, ``failed``)."""
        with self._lock:
            self.outcome = outcome
            if self.current is not None:
                self.done.append((self.current, time.monotonic() - self._since))
            self.current, self.detail = None, ""

    def read(self) -> tuple[str | None, str, float, list[tuple[str, float]]]:
        """(current phase, its detail, seconds in it, the finished phases with their seconds)."""
        with self._lock:
            return self.current, self.detail, time.monotonic() - self._since, list(self.done)


@dataclass
class Snapshot:
    """One refresh of the view's numbers."""

    phase: str | None = None
    phase_detail: str = ""
    phase_elapsed_s: float = 0.0
    phases_done: list[tuple[str, float]] = field(default_factory=list)
    rounds_done: float = 0.0
    rounds_total: float = 0.0
    rounds_per_s: float = 0.0
    sites: dict[str, SiteState] = field(default_factory=dict)
    metric_key: str | None = None  # the metric the sites' column shows (`pick_metric`)
    outcome: str = "done"  # once the phases are over: how they ended
    restarts: int = 0
    elapsed_s: float = 0.0

    @property
    def eta_s(self) -> float | None:
        if self.rounds_per_s <= 0 or self.rounds_total <= 0:
            return None
        return max(0.0, self.rounds_total - self.rounds_done) / self.rounds_per_s


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _figures(scraped: Scraped) -> WorkerFigures:
    metrics = {}
    for sample in scraped.samples:
        key = sample.labels.get("metric")
        if sample.name == "hybridfleet_reported_value" and key and sample.value == sample.value:  # not NaN
            metrics[key] = sample.value
    return WorkerFigures(scraped.value("hybridfleet_worker_steps_total"),
                         scraped.value("hybridfleet_worker_bytes_total", direction="uplink"),
                         scraped.value("hybridfleet_worker_bytes_total", direction="downlink"), metrics)


def _latest(seen: WorkerFigures | None, reported: WorkerFigures) -> WorkerFigures:
    """A worker's figures from its last scrape and its last logged record: the larger totals, the logged metrics
    over the scraped ones."""
    if seen is None:
        return reported
    return WorkerFigures(max(seen.steps, reported.steps), max(seen.uplink_bytes, reported.uplink_bytes),
                         max(seen.downlink_bytes, reported.downlink_bytes), {**seen.metrics, **reported.metrics})


class RunView:
    """Collects a `Snapshot` from the run's worker targets, the round counter and the restart count.

    A worker that stops answering keeps the last figures this view scraped from it, else those
    ``read_reported()`` gives for its process (the last record it logged), so a site's sums never
    drop to 0 when its workers exit; ``read_exits()`` (process -> exit code of a process gone for good,
    `final_exits`) marks them as exited.
    """

    def __init__(self, job: str, targets: list[Target], read_rounds: Callable[[], tuple[float, float]],
                 read_restarts: Callable[[], int], phases: Phases | None = None,
                 read_exits: Callable[[], dict[str, int]] | None = None,
                 read_reported: Callable[[], dict[str, WorkerFigures]] | None = None):
        self.job = job
        self._targets = targets  # read at each snapshot: a run adds its workers' targets as they start
        self.phases = phases
        self._read_rounds = read_rounds
        self._read_restarts = read_restarts
        self._read_exits = read_exits or dict
        self._read_reported = read_reported or dict
        self._started = time.monotonic()
        self._last: tuple[float, dict[str, float], float] | None = None  # (time, site -> steps, rounds)
        self._failure_logged = False
        self._seen: dict[str, WorkerFigures] = {}  # address -> last figures, so a finished worker keeps its totals
        self._settled: set[str] = set()  # addresses of exited workers whose logged figures were taken
        self.metric_key: str | None = None  # chosen once a metric is reported, then kept

    @property
    def targets(self) -> list[Target]:
        return [t for t in list(self._targets) if t.labels.get("role") == "worker"]

    def snapshot(self) -> Snapshot:
        """Read everything now; a source that fails leaves its numbers at their defaults."""
        now = time.monotonic()
        snap = Snapshot(elapsed_s=now - self._started)
        try:  # before the phase: reading the rounds may move the run into training
            snap.rounds_done, snap.rounds_total = self._read_rounds()
        except Exception as err:  # a shard restarting must not break the view
            if not self._failure_logged:
                _log.warning("rounds_unavailable", error=repr(err))
                self._failure_logged = True
        if self.phases is not None:
            snap.phase, snap.phase_detail, snap.phase_elapsed_s, snap.phases_done = self.phases.read()
            snap.outcome = self.phases.outcome
        snap.restarts = self._read_restarts()
        exits, reported = self._read_exits(), None
        workers: list[tuple[str, WorkerFigures | None, SiteState]] = []
        for scraped in scrape_all(self.targets):
            labels = scraped.target.labels
            st = snap.sites.setdefault(labels.get("site", "?"), SiteState())
            st.workers += 1
            process = labels.get("process", "")
            if process in exits:
                st.exited[process] = exits[process]
            if scraped.up:
                st.workers_up += 1
                self._seen[scraped.target.address] = _figures(scraped)
            elif scraped.target.address not in self._settled:
                # not answering: its last logged record may hold more than the last scrape did (a short
                # run's evaluation can fall between two scrapes); read until it has exited for good
                reported = self._read_reported() if reported is None else reported
                if process in reported:
                    self._seen[scraped.target.address] = _latest(self._seen.get(scraped.target.address),
                                                                 reported[process])
                if process in exits:
                    self._settled.add(scraped.target.address)
            workers.append((process, self._seen.get(scraped.target.address), st))
        if self.metric_key is None:
            self.metric_key = pick_metric({k for _, fig, _ in workers if fig for k in fig.metrics})
        snap.metric_key = self.metric_key
        worst = max if self.metric_key and lower_is_better(self.metric_key) else min
        for _, fig, st in workers:
            if fig is None:
                continue
            st.steps += fig.steps
            st.uplink_bytes += fig.uplink_bytes
            st.downlink_bytes += fig.downlink_bytes
            value = fig.metrics.get(self.metric_key) if self.metric_key else None
            if value is not None:
                st.metric = value if st.metric is None else worst(st.metric, value)
        if self._last is not None:
            then, steps_then, rounds_then = self._last
            dt = max(now - then, 1e-6)
            snap.rounds_per_s = max(0.0, (snap.rounds_done - rounds_then) / dt)
            for site, st in snap.sites.items():
                st.steps_per_s = 0.0 if st.final else max(0.0, (st.steps - steps_then.get(site, st.steps)) / dt)
        self._last = (now, {s: st.steps for s, st in snap.sites.items()}, snap.rounds_done)
        return snap


def phase_text(snap: Snapshot) -> str:
    """``training (0m12s)`` or ``workers joining 2/4 (0m03s)``; empty without phases."""
    if snap.phase is None:
        return ""
    detail = f" {snap.phase_detail}" if snap.phase_detail else ""
    return f"{snap.phase}{detail} ({_duration(snap.phase_elapsed_s)})"


TRAINING = "training"  # the one phase whose lines count rounds and per-site figures


def metric_text(snap: Snapshot, st: SiteState) -> str:
    """``test_bpc 2.310`` (the view's metric of the site), ``metric -`` before any is reported."""
    value = "-" if st.metric is None else f"{st.metric:.3f}"
    return f"{snap.metric_key or 'metric'} {value}"


def _site_part(snap: Snapshot, site: str, st: SiteState) -> str:
    exited = f" workers {st.workers_text()}" if st.exited else ""
    return (f"{site} {st.steps_per_s:.1f} worker steps/s up {human_bytes(st.uplink_bytes)} "
            f"down {human_bytes(st.downlink_bytes)} {metric_text(snap, st)}{exited}")


def plain_line(job: str, snap: Snapshot) -> str:
    """One line for logs, naming one phase and only the counters that belong to it.

    Training: ``digits: training (0m05s) | round 120/300 (40%) eta 0m12s | hospital 31.0 worker steps/s up
    ... test_accuracy 0.912 | restarts 0``; any other phase: its name, detail and time (``workers joining 2/4
    (0m03s) | restarts 0``); once the phases are over: ``done`` with the final rounds and per-site figures.
    """
    phase = phase_text(snap)
    if snap.phase is not None and snap.phase != TRAINING:
        return f"{job}: {phase} | restarts {snap.restarts}"
    if snap.phase is None and snap.phases_done:
        phase = f"{snap.outcome} in {_duration(sum(s for _, s in snap.phases_done))}"
    pct = f" ({100 * snap.rounds_done / snap.rounds_total:.0f}%)" if snap.rounds_total else ""
    eta = f" eta {_duration(snap.eta_s)}" if snap.phase == TRAINING else ""
    parts = [f"{job}: {phase + ' | ' if phase else ''}round {snap.rounds_done:g}/{snap.rounds_total:g}{pct}{eta}"]
    parts += [_site_part(snap, site, st) for site, st in sorted(snap.sites.items())]
    parts.append(f"restarts {snap.restarts}")
    return " | ".join(parts)


def render(job: str, snap: Snapshot):
    """The rich renderable of the terminal panel."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    lines = []
    if snap.phase is not None or snap.phases_done:
        done = "   ".join(f"{name} {_duration(s)}" for name, s in snap.phases_done)
        lines.append(Text(f"phase: {phase_text(snap) or snap.outcome}" + (f"   (done: {done})" if done else "")))
    lines.append(Text(f"round {snap.rounds_done:g}/{snap.rounds_total:g}   elapsed {_duration(snap.elapsed_s)}   "
                      f"ETA {_duration(snap.eta_s)}   restarts {snap.restarts}"))
    bar = ProgressBar(total=snap.rounds_total or None, completed=snap.rounds_done)
    lower = lower_is_better(snap.metric_key) if snap.metric_key else None
    caption = None if lower is None else f"{snap.metric_key}: {'lower' if lower else 'higher'} is better"
    table = Table(expand=True, caption=caption)
    for col, justify in (("site", "left"), ("workers", "right"), ("worker steps/s", "right"), ("uplink", "right"),
                         ("downlink", "right"), (snap.metric_key or "metric", "right")):
        table.add_column(col, justify=justify, no_wrap=col == "workers")
    for site, st in sorted(snap.sites.items()):
        table.add_row(site, st.workers_text(), f"{st.steps_per_s:.1f}", human_bytes(st.uplink_bytes),
                      human_bytes(st.downlink_bytes), "-" if st.metric is None else f"{st.metric:.3f}")
    return Panel(Group(*lines, bar, table), title=f"hfleet run {job}")


def apply_summary(snap: Snapshot, summary: dict) -> Snapshot:
    """``snap`` with the run's final figures taken from its summary (bytes, restarts), so the last panel
    says what summary.json says."""
    for site in summary.get("bytes_sent_by_site", {}):
        st = snap.sites.setdefault(site, SiteState())
        st.uplink_bytes = float(summary["bytes_sent_by_site"][site])
        st.downlink_bytes = float(summary.get("bytes_received_by_site", {}).get(site, 0))
        st.steps_per_s = 0.0
    snap.restarts = int(summary.get("restarts", snap.restarts))
    return snap


def hide_control_echo(stream) -> Callable[[], None]:
    """Stop ``stream``'s terminal from echoing control characters (``^C``) and return the undo (a no-op when
    ``stream`` is no terminal).

    A Ctrl-C echoed as ``^C`` after the panel's full-width last line wraps it and scrolls the screen one
    line: the next redraw then starts one line low and leaves the old top border behind.
    """
    try:
        import termios

        fd = stream.fileno()
        saved = termios.tcgetattr(fd)
        quiet = list(saved)
        quiet[3] = saved[3] & ~termios.ECHOCTL
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except Exception:  # no fileno, not a tty, no termios: nothing to hide
        return lambda: None

    def undo() -> None:
        with contextlib.suppress(Exception):
            termios.tcsetattr(fd, termios.TCSANOW, saved)

    return undo


class LiveDisplay:
    """Shows a `RunView` on ``stream``: a rich live panel on a terminal, plain lines elsewhere.

    With ``background`` a thread refreshes it about once a second, so the view keeps moving
    while the caller is busy (starting processes, saving the model, writing the report).
    """

    def __init__(self, view: RunView, stream: IO[str] | None = None, terminal: bool | None = None,
                 plain_interval_s: float = 5.0, background: bool = False):
        self.view = view
        self._stream = stream if stream is not None else sys.stderr
        if terminal is None:
            isatty = getattr(self._stream, "isatty", None)
            terminal = bool(isatty and isatty())
        self.terminal = terminal
        self._plain_interval_s = plain_interval_s
        self._last_plain = 0.0
        self._live = None
        self._restore_echo: Callable[[], None] = lambda: None
        self._final: dict | None = None  # the summary the last view shows
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, daemon=True) if background else None

    def __enter__(self) -> "LiveDisplay":
        if self.terminal:
            from rich.console import Console
            from rich.live import Live

            self._restore_echo = hide_control_echo(self._stream)
            console = Console(file=self._stream, force_terminal=True)
            self._live = Live(render(self.view.job, self.view.snapshot()), console=console, auto_refresh=False,
                              transient=False)
            self._live.start(refresh=True)
        else:
            self._last_plain = time.monotonic()
        if self._thread is not None:
            self._thread.start()
        return self

    def _refresh_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.refresh()

    def refresh(self) -> None:
        """Redraw the panel, or write a plain line when one is due."""
        with self._lock:
            if self._live is not None:
                self._live.update(render(self.view.job, self.view.snapshot()), refresh=True)
            elif self._stream is not None and time.monotonic() - self._last_plain >= self._plain_interval_s:
                self._write_plain(self.view.snapshot())

    def show_final(self, summary: dict) -> None:
        """The last view shows ``summary``'s figures."""
        with self._lock:
            self._final = summary

    def _write_plain(self, snap: Snapshot) -> None:
        self._last_plain = time.monotonic()
        self._stream.write(plain_line(self.view.job, snap) + "\n")
        self._stream.flush()

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5)
        with self._lock:
            snap = self.view.snapshot()  # after the phases ended: the last line or panel says "done"
            if self._final is not None:
                snap = apply_summary(snap, self._final)
            if self._live is not None:
                self._live.update(render(self.view.job, snap), refresh=True)
                self._live.stop()
                self._live = None
                self._restore_echo()
            else:
                self._write_plain(snap)
