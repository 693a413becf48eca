"""Prometheus metrics of one process, all under the ``hybridfleet_`` namespace.

Process model: every long-lived process (shard, worker, site leader, the `hfleet run`
supervisor, a `hfleet launch` rank that reports) serves its own ``/metrics`` on the
port in ``HFLEET_METRICS_PORT``; `hfleet run` hands out those ports and writes a
Prometheus file-based service-discovery file naming each target with its identity
labels (job, site, role, rank, process). Identity lives in target labels, never in
metric labels, so the only metric labels are small closed sets (phase, direction,
codec, kind, reason, outcome, process_role, metric name capped at
`MAX_REPORTED_NAMES`). No multiprocess mode: nothing is written per pid, so
restarts leave nothing behind (docs/OBSERVABILITY.md says why).

Counters a hot path touches are plain `prometheus_client` counters (one locked add);
state that already exists elsewhere (shard versions, byte counters, membership) is
read only when Prometheus scrapes, by a collector (`add_collector`).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Callable, Iterable, TypeVar

import prometheus_client as pc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hybridfleet.errors import LaunchError
from hybridfleet.portfile import read_port_file, write_port_file
from hybridfleet.obs.log import get_logger

pc.disable_created_metrics()  # `_created` series would double the series count (client_python #438)

__all__ = ["ProcessMetrics", "process_metrics", "serve_metrics", "serve_from_env", "counter", "gauge",
           "ENV_PORT", "ENV_HOST", "ENV_PORT_FILE", "MAX_REPORTED_NAMES", "WorkerMetrics",
           "ShardMetrics", "CheckpointMetrics", "SupervisorMetrics", "StepTimer", "count_rejected_push",
           "observe_snapshot", "observe_checkpoint"]

ENV_PORT = "HFLEET_METRICS_PORT"
ENV_HOST = "HFLEET_METRICS_HOST"
ENV_PORT_FILE = "HFLEET_METRICS_PORT_FILE"  # where the bound port goes (how `hfleet run` learns a port 0 bind)
# At most this many distinct names of script-reported values become series; more are dropped (logged once).
MAX_REPORTED_NAMES = 32
PHASES = ("compute", "encode", "transfer", "wait")

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SAVE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_log = get_logger("obs.metrics")
T = TypeVar("T")


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    """A counter family with one sample, for collectors (``name`` without ``_total``)."""
    family = CounterMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    """A gauge family with one sample, for collectors."""
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable]):
        self._fn = fn

    def collect(self):
        try:
            yield from self._fn()
        except Exception as err:  # a broken collector must not fail the whole scrape
            _log.warning("collector_failed", error=repr(err))


class ProcessMetrics:
    """The metrics one process exports, in its own registry.

    Components update the counters below where they already do the work; collectors
    added with `add_collector` read existing state at scrape time.
    """

    def __init__(self) -> None:
        r = self.registry = pc.CollectorRegistry(auto_describe=True)
        self.build_info = pc.Gauge("hybridfleet_build_info", "hybridfleet version of this process (always 1)",
                                   ["version"], registry=r)
        from hybridfleet import __version__

        self.build_info.labels(__version__).set(1)
        self.restart_count = pc.Gauge("hybridfleet_process_restarts", "Times this process was restarted before "
                                      "the current attempt", registry=r)
        self.restart_count.set(int(os.environ.get("HFLEET_RESTART_COUNT", "0") or 0))
        # values reported by the training script
        self.reported = pc.Gauge("hybridfleet_reported_value", "Latest value the script reported "
                                 "(loss, test_accuracy, ...)", ["metric"], registry=r)
        self.reported_step = pc.Gauge("hybridfleet_reported_step", "Step of the latest report", registry=r)
        self._reported_names: set[str] = set()
        self._lock = threading.Lock()
        self._groups: dict[type, Any] = {}

    def group(self, kind: type[T]) -> T:
        """The metrics of one role (`WorkerMetrics`, `ShardMetrics`, ...), registered on first use, so a
        process exports only the families of what it does."""
        found = self._groups.get(kind)
        if found is None:
            with self._lock:
                found = self._groups.get(kind)
                if found is None:
                    found = self._groups[kind] = kind(self.registry)
        return found

    def add_collector(self, fn: Callable[[], Iterable]) -> Collector:
        """Register ``fn`` (yielding metric families) to run at each scrape; returns it for `remove_collector`."""
        collector = _FnCollector(fn)
        self.registry.register(collector)
        return collector

    def remove_collector(self, collector: Collector) -> None:
        self.registry.unregister(collector)

    def report(self, step: int | None, values: dict[str, Any]) -> None:
        """Set ``hybridfleet_reported_value{metric=NAME}`` for each finite number in ``values``."""
        if step is not None:
            self.reported_step.set(step)
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if name not in self._reported_names:
                with self._lock:
                    if len(self._reported_names) >= MAX_REPORTED_NAMES:
                        if len(self._reported_names) == MAX_REPORTED_NAMES:
                            _log.warning("reported_names_capped", limit=MAX_REPORTED_NAMES, dropped=name)
                            self._reported_names.add("")  # log once
                        continue
                    self._reported_names.add(name)
            self.reported.labels(name).set(float(value))

    def exposition(self) -> bytes:
        """The text exposition format of everything registered (what ``/metrics`` returns)."""
        return pc.generate_latest(self.registry)


class WorkerMetrics:
    """A worker's steps and where their time goes."""

    def __init__(self, r: pc.CollectorRegistry):
        self.steps = pc.Counter("hybridfleet_worker_steps", "Training steps this worker completed", registry=r)
        phase_seconds = pc.Counter("hybridfleet_worker_step_phase_seconds",
                                   "Time spent per phase of a step: compute (the script), encode (codec), "
                                   "transfer (push), wait (pull, incl. waiting for the round to close)",
                                   ["phase"], registry=r)
        self.phase = {p: phase_seconds.labels(p) for p in PHASES}
        self.step_seconds = pc.Histogram("hybridfleet_worker_step_duration_seconds",
                                         "Wall time of one whole step, compute included", registry=r,
                                         buckets=_STEP_BUCKETS_S)
        # float32 gradient bytes before the codec; exported with the pushed bytes by `watch_worker`
        self.gradient_raw_bytes = 0
        self.phase_totals = dict.fromkeys(PHASES, 0.0)  # the same seconds, for the JSON-lines records

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phase[phase].inc(seconds)
        self.phase_totals[phase] += seconds


class ShardMetrics:
    """What a shard refuses and how long its snapshots take (the rest is read from its state at scrape)."""

    def __init__(self, r: pc.CollectorRegistry):
        self.rejected_pushes = pc.Counter("hybridfleet_shard_rejected_pushes", "Pushes refused, by reason "
                                          "(the gRPC status name)", ["reason"], registry=r)
        self.snapshot_seconds = pc.Histogram("hybridfleet_snapshot_duration_seconds", "Time to write one shard "
                                             "snapshot", registry=r, buckets=_SAVE_BUCKETS_S)
        self.snapshot_bytes = pc.Counter("hybridfleet_snapshot_written_bytes", "Bytes of shard snapshots written",
                                         registry=r)


class CheckpointMetrics:
    """Checkpoints written by a training script through the launch helpers."""

    def __init__(self, r: pc.CollectorRegistry):
        self.seconds = pc.Histogram("hybridfleet_checkpoint_duration_seconds", "Time to write one checkpoint",
                                    registry=r, buckets=_SAVE_BUCKETS_S)
        self.bytes = pc.Counter("hybridfleet_checkpoint_written_bytes", "Bytes of checkpoints written", registry=r)


class SupervisorMetrics:
    """The `hfleet run` supervisor's view of its children."""

    def __init__(self, r: pc.CollectorRegistry):
        self.restarts = pc.Counter("hybridfleet_supervisor_restarts", "Processes restarted after a failure",
                                   ["process_role"], registry=r)
        self.exits = pc.Counter("hybridfleet_supervisor_exits", "Process exits (outcome ok or failed)",
                                ["process_role", "outcome"], registry=r)
        self.live = pc.Gauge("hybridfleet_supervisor_live_processes", "Processes running now", ["process_role"],
                             registry=r)


_process: ProcessMetrics | None = None
_process_lock = threading.Lock()


def process_metrics() -> ProcessMetrics:
    """This process's metrics (created on first use; exported only once `serve_metrics` runs)."""
    global _process
    if _process is None:
        with _process_lock:
            if _process is None:
                _process = ProcessMetrics()
    return _process


def serve_metrics(port: int, host: str = "127.0.0.1", metrics: ProcessMetrics | None = None):
    """Serve ``metrics`` (default: this process's) on ``http://host:port/metrics`` from a daemon thread;
    returns the HTTP server (``.server_port`` is the bound port; ``.shutdown()`` stops it).

    Port 0 takes a free port. A port in use raises `LaunchError` naming it.
    """
    metrics = metrics or process_metrics()
    try:
        server, _thread = pc.start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise LaunchError(f"metrics port {port} on {host} is in use; choose another with {ENV_PORT}=PORT "
                              f"(0 picks a free port)") from None
        raise LaunchError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from None
    return server


def serve_from_env(metrics: ProcessMetrics | None = None) -> int | None:
    """Serve metrics when ``HFLEET_METRICS_PORT`` is set (``HFLEET_METRICS_HOST``, default 127.0.0.1);
    returns the bound port, or None when unset. Safe to call more than once: the first call serves.

    With ``HFLEET_METRICS_PORT_FILE`` the bound port is written to that file (atomically), which is
    how a launcher learns the port of a process it started with port 0: the process binds a free
    port itself, so no port is picked and released for another process to take in between. Port 0
    and a file that already names a port (the process was restarted) try that port first, so the
    process keeps its Prometheus target; when another process holds it now, any free port is taken.
    """
    global _served_port
    value = os.environ.get(ENV_PORT, "").strip()
    if not value:
        return None
    with _serve_lock:
        if _served_port is not None:
            return _served_port
        try:
            port = int(value)
        except ValueError:
            raise LaunchError(f"{ENV_PORT} must be a port number (got {value!r})") from None
        host = os.environ.get(ENV_HOST, "127.0.0.1")
        port_file = os.environ.get(ENV_PORT_FILE, "").strip()
        server = None
        previous = read_port_file(port_file) if port_file and port == 0 else None
        if previous is not None:
            try:
                server = serve_metrics(previous, host, metrics)
            except LaunchError:
                _log.warning("metrics_port_taken", port=previous)
        if server is None:
            server = serve_metrics(port, host, metrics)
        _served_port = int(server.server_port)
        if port_file:
            write_port_file(port_file, _served_port)
        _log.info("metrics_serving", address=f"{host}:{_served_port}")
        return _served_port


_served_port: int | None = None
_serve_lock = threading.Lock()


class StepTimer:
    """Splits a worker's steps into compute / encode / transfer / wait for `WorkerMetrics`.

    ``begin`` at the start of a step (the time since the previous ``end`` was the
    script's compute), ``mark(phase)`` after each phase, ``end`` when the step returns.
    Each call is one clock read and one counter add.
    """

    def __init__(self, metrics: ProcessMetrics | None = None):
        self.metrics = (metrics or process_metrics()).group(WorkerMetrics)
        self._last = 0.0
        self._ended: float | None = None

    def begin(self) -> None:
        now = time.perf_counter()
        if self._ended is not None:
            self.metrics.add_phase("compute", now - self._ended)
        self._last = now

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.metrics.add_phase(phase, now - self._last)
        self._last = now

    def phase_totals(self) -> dict[str, float]:
        """Seconds per phase so far (carried by the worker's JSON-lines metrics records)."""
        return {p: round(s, 4) for p, s in self.metrics.phase_totals.items()}

    def end(self, raw_gradient_bytes: int = 0) -> None:
        now = time.perf_counter()
        m = self.metrics
        m.steps.inc()
        m.gradient_raw_bytes += raw_gradient_bytes
        if self._ended is not None:
            m.step_seconds.observe(now - self._ended)
        self._ended = now


def count_rejected_push(code: str) -> None:
    """Count one refused push under ``hybridfleet_shard_rejected_pushes_total{reason=code}`` (a gRPC status name)."""
    process_metrics().group(ShardMetrics).rejected_pushes.labels(str(code).lower()).inc()


def observe_snapshot(seconds: float, nbytes: int) -> None:
    """Record one shard snapshot written in ``seconds`` with ``nbytes`` of tensors."""
    group = process_metrics().group(ShardMetrics)
    group.snapshot_seconds.observe(seconds)
    group.snapshot_bytes.inc(nbytes)


def observe_checkpoint(seconds: float, nbytes: int) -> None:
    """Record one checkpoint written in ``seconds`` with ``nbytes`` of tensors."""
    group = process_metrics().group(CheckpointMetrics)
    group.seconds.observe(seconds)
    group.bytes.inc(nbytes)
