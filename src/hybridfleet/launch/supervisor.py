"""The local process supervisor: runs a job's shards and workers as subprocesses.

`Supervisor` starts plain subprocesses (framework-agnostic), pumps their merged
stdout/stderr into ``run_dir/logs/<name>.log`` and, optionally, onto stderr with
a ``[name] `` prefix, restarts failures up to ``max_restarts`` and records every
start/exit/restart/gave_up/stop in ``events`` and ``run_dir/events.jsonl``.

No orphan is left behind, by three mechanisms:

* each child runs in its own session and process group (``start_new_session``),
  so `Supervisor.stop` signals the whole tree a child has spawned, and a child
  started from a terminal does not see the terminal's Ctrl-C directly;
* each child gets ``PR_SET_PDEATHSIG(SIGKILL)`` (Linux), so it is killed even
  when the supervisor itself dies by SIGKILL. This covers the direct child only:
  grandchildren are reached through the process group by `stop`, not by this;
* when a child exits, whatever it left running in its process group is killed,
  so a restarted process never runs next to a stale grandchild.

`stop_on_signals` / `run_supervised` turn SIGINT and SIGTERM into an orderly
stop followed by exit code 130 / 143.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

from hybridfleet.errors import LaunchError
from hybridfleet.launch.progress import ProgressFn, ProgressReporter
from hybridfleet.obs.log import get_logger
from hybridfleet.obs.metrics import SupervisorMetrics, process_metrics

__all__ = ["ProcessSpec", "Supervisor", "stop_on_signals", "run_supervised"]

_log = get_logger("supervisor")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_COLOURS = ["36", "35", "33", "32", "34", "31", "96", "95", "93", "92", "94", "91"]
_READ_CHUNK_BYTES = 65536
# A child that never writes a newline must not grow the buffer without bound.
_MAX_LINE_BYTES = 1 << 20
_PUMP_DRAIN_S = 2.0
_KILL_CONFIRM_S = 10.0
_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


@dataclass
class ProcessSpec:
    """What to run: argv/env/cwd of one process and how often to restart it."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    max_restarts: int = 0
    restart_delay_s: float = 0.5
    role: str = "worker"
    final_exit_codes: tuple[int, ...] = ()  # exits a restart cannot mend (e.g. the port is taken): never restarted

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(
                f"ProcessSpec.name: must be 1-128 letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit (got {self.name!r})"
            )
        if not isinstance(self.argv, (list, tuple)) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"ProcessSpec.argv of {self.name!r}: must be a non-empty list of strings (got {self.argv!r})")
        self.argv = list(self.argv)
        if self.env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"ProcessSpec.env of {self.name!r}: keys and values must be strings")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"ProcessSpec.max_restarts of {self.name!r}: must be an integer >= 0 (got {self.max_restarts!r})")
        if not isinstance(self.restart_delay_s, (int, float)) or self.restart_delay_s < 0:
            raise ValueError(f"ProcessSpec.restart_delay_s of {self.name!r}: must be >= 0 (got {self.restart_delay_s!r})")


@dataclass
class _Managed:
    """Supervisor-side state of one named process (across its restarts)."""

    spec: ProcessSpec
    colour: str
    log_path: Path
    log_file: IO[bytes] | None = None
    log_lock: threading.Lock = field(default_factory=threading.Lock)
    popen: subprocess.Popen | None = None  # None while not running (before start, in restart delay, finished)
    attempt: int = 0  # 1 for the first run, N + 1 after N restarts
    final_rc: int | None = None
    on_line_failed: bool = False


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A preexec_fn setting PR_SET_PDEATHSIG(SIGKILL) in the child, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
            os._exit(137)

    return preexec


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _SpawnThread:
    """Runs every fork of a supervisor on one long-lived thread.

    PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, not the
    process; forking from a short-lived thread (such as the one that restarts a
    failed process) would kill the child as soon as that thread ended.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="supervisor-spawn", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)

    def call(self, fn: Callable[[], T]) -> T:
        future: Future = Future()
        with self._close_lock:
            if self._closed:
                raise RuntimeError("this supervisor is closed; create a new one")
            self._jobs.put((fn, future))
        return future.result()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._thread.join()


class Supervisor:
    """Starts, watches, restarts and stops the processes of one local run.

    ``run_dir/logs/<name>.log`` receives each process's raw output lines (kept
    across restarts, with a ``--- restart N ---`` marker); ``run_dir/events.jsonl``
    one JSON object per event. With ``echo`` every line also goes to ``stream``
    (default: stderr at the time of writing) as ``[name] line``, coloured per
    process on a terminal. ``on_line(name, line)`` is called for every line,
    without its line ending, from a reader thread.

    A child's environment is ``os.environ``, then ``PYTHONUNBUFFERED=1`` (unless
    already set), ``HFLEET_PROCESS_NAME`` and ``HFLEET_RESTART_COUNT`` (restarts
    before this attempt), then ``spec.env``.
    """

    def __init__(
        self,
        run_dir: Path,
        echo: bool = True,
        on_line: Callable[[str, str], None] | None = None,
        stream: IO[str] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.events: list[dict[str, Any]] = []
        self._echo = echo
        self._on_line = on_line
        self._stream = stream
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._echo_lock = threading.Lock()
        self._procs: dict[str, _Managed] = {}
        self._stopping = False
        self._closed = False
        self._stop_requested = threading.Event()
        self._kill_now = threading.Event()
        self._events_file: IO[str] | None = None
        self._spawner: _SpawnThread | None = None
        self._metrics = process_metrics().group(SupervisorMetrics)

    # ---- public interface -------------------------------------------------

    def start(self, spec: ProcessSpec) -> None:
        """Start ``spec`` now; raises `LaunchError` (and records nothing) when it cannot be started."""
        if not isinstance(spec, ProcessSpec):
            raise TypeError(f"start() takes a ProcessSpec (got {type(spec).__name__})")
        with self._lock:
            self._check_open()
            if spec.cwd is not None and not Path(spec.cwd).is_dir():
                raise LaunchError(f"cannot start {spec.name!r}: working directory {spec.cwd!r} does not exist")
            managed = _Managed(
                spec=spec,
                colour=_COLOURS[len(self._procs) % len(_COLOURS)],
                log_path=self.run_dir / "logs" / f"{spec.name}.log",
            )
            if self._spawner is None:
                self._spawner = _SpawnThread()
            spawner = self._spawner
        spawner.call(lambda: self._launch(managed, first=True))

    def wait(
        self,
        names: list[str] | None = None,
        timeout_s: float | None = None,
        progress: ProgressFn | None = None,
    ) -> dict[str, int]:
        """Block until each named process (default: all) finished for good; return name -> final code.

        "For good" means exit 0, or a failure after its restarts ran out (or a
        stop). A negative code is the signal that killed it. ``progress`` is
        shown while waiting (see `ProgressReporter`). Raises `TimeoutError`
        naming the processes still running after ``timeout_s``; they keep running.
        """
        with self._lock:
            wanted = list(self._procs) if names is None else list(names)
            unknown = [n for n in wanted if n not in self._procs]
            if unknown:
                raise ValueError(f"unknown process name(s) {unknown}; started: {sorted(self._procs)}")
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        reporter = ProgressReporter(progress, stream=self._stream) if progress is not None else contextlib.nullcontext()
        with reporter:
            while True:
                with self._lock:
                    pending = [n for n in wanted if self._procs[n].final_rc is None]
                    if not pending:
                        return {n: self._procs[n].final_rc for n in wanted}
                    if deadline_s is not None and time.monotonic() >= deadline_s:
                        raise TimeoutError(f"processes still running after {timeout_s} s: {pending}")
                    wait_s = 0.5 if deadline_s is None else max(0.0, min(0.5, deadline_s - time.monotonic()))
                    self._changed.wait(wait_s)
                if progress is not None:
                    reporter.refresh()

    def stop(self, grace_s: float = 5.0) -> dict[str, int]:
        """SIGTERM every live process group, SIGKILL what is left after ``grace_s``; return all final codes.

        Pending restarts are cancelled and no process can be started afterwards.
        """
        if grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0 (got {grace_s})")
        with self._lock:
            self._stopping = True
            self._stop_requested.set()
            live = [m for m in self._procs.values() if m.popen is not None]
            for managed in live:
                self._record(managed, "stop")
                _signal_group(managed.popen.pid, signal.SIGTERM)
        self._wait_until(lambda: all(m.popen is None for m in live), grace_s, self._kill_now)
        with self._lock:
            for managed in live:
                if managed.popen is not None:
                    _signal_group(managed.popen.pid, signal.SIGKILL)
        if not self._wait_until(lambda: all(m.final_rc is not None for m in self._procs.values()), _KILL_CONFIRM_S):
            _log.error("stop_incomplete", processes=[n for n, m in self._procs.items() if m.final_rc is None])
        with self._lock:
            return {n: m.final_rc for n, m in self._procs.items()}

    def skip_grace(self) -> None:
        """Make a `stop` in progress (or the next one) send SIGKILL now instead of waiting out its grace."""
        self._kill_now.set()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the named process itself (not its group), as a crash would; restarts apply."""
        try:
            sig = signal.Signals(sig)
        except ValueError:
            raise ValueError(f"kill(): {sig!r} is not a signal number") from None
        with self._lock:
            managed = self._get(name)
            if managed.popen is None:
                raise ValueError(f"process {name!r} is not running (final code {managed.final_rc})")
            os.kill(managed.popen.pid, sig)

    def pid(self, name: str) -> int | None:
        """The current pid of the named process, or None while it is not running."""
        with self._lock:
            popen = self._get(name).popen
            return None if popen is None else popen.pid

    def returncode(self, name: str) -> int | None:
        """The final code of the named process, or None until it finished for good."""
        with self._lock:
            return self._get(name).final_rc

    def close(self) -> None:
        """Stop anything still running and release threads and files; the supervisor cannot be reused."""
        with self._lock:
            if self._closed:
                return
            running = any(m.final_rc is None for m in self._procs.values())
        if running:
            self.stop()
        with self._lock:
            self._closed = True
            spawner, self._spawner = self._spawner, None
        if spawner is not None:
            spawner.close()
        with self._lock:
            for managed in self._procs.values():
                with managed.log_lock:
                    if managed.log_file is not None:
                        managed.log_file.close()
                        managed.log_file = None
            if self._events_file is not None:
                self._events_file.close()
                self._events_file = None

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this supervisor is closed; create a new one")
        if self._stopping:
            raise RuntimeError("this supervisor was stopped; create a new one")

    def _get(self, name: str) -> _Managed:
        try:
            return self._procs[name]
        except KeyError:
            raise ValueError(f"unknown process name {name!r}; started: {sorted(self._procs)}") from None

    def _wait_until(self, done: Callable[[], bool], timeout_s: float, cut_short: threading.Event | None = None) -> bool:
        deadline_s = time.monotonic() + timeout_s
        with self._lock:
            while not done():
                left_s = deadline_s - time.monotonic()
                if left_s <= 0 or (cut_short is not None and cut_short.is_set()):
                    return False
                self._changed.wait(min(0.1, left_s))
            return True

    def _child_env(self, spec: ProcessSpec, attempt: int) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # Python children: lines arrive as they are printed
        env["HFLEET_PROCESS_NAME"] = spec.name
        env["HFLEET_RESTART_COUNT"] = str(attempt - 1)  # read by launch.helpers.restart_count()
        env.update(spec.env or {})
        return env

    def _launch(self, managed: _Managed, first: bool) -> None:
        """Fork one attempt of ``managed`` (on the spawn thread) and start its reader and watcher."""
        spec = managed.spec
        attempt = managed.attempt + 1
        with self._lock:
            if first:
                self._check_open()
                if spec.name in self._procs:
                    raise ValueError(f"a process named {spec.name!r} was already started; names must be unique within a run")
            elif self._stopping:
                raise RuntimeError("stopped")
            try:
                popen = subprocess.Popen(
                    spec.argv,
                    env=self._child_env(spec, attempt),
                    cwd=spec.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_pdeathsig_preexec(),
                )
            except OSError as err:
                raise LaunchError(f"cannot start {spec.name!r}: {spec.argv[0]!r}: {err.strerror}") from err
            if first:
                try:
                    managed.log_path.parent.mkdir(parents=True, exist_ok=True)
                    managed.log_file = open(managed.log_path, "ab")
                    self._open_events_file()
                except OSError as err:
                    _signal_group(popen.pid, signal.SIGKILL)
                    popen.wait()
                    popen.stdout.close()
                    raise LaunchError(f"cannot start {spec.name!r}: cannot write under {self.run_dir}: {err}") from err
                self._procs[spec.name] = managed
            managed.popen = popen
            managed.attempt = attempt
            self._record(managed, "start")
            reader = threading.Thread(target=self._pump, args=(managed, popen), name=f"pump-{spec.name}", daemon=True)
            reader.start()
            threading.Thread(
                target=self._watch, args=(managed, popen, reader), name=f"watch-{spec.name}", daemon=True
            ).start()

    def _pump(self, managed: _Managed, popen: subprocess.Popen) -> None:
        """Drain the child's merged output without ever blocking it; one call per line."""
        fd = popen.stdout.fileno()
        pending = b""
        try:
            while chunk := os.read(fd, _READ_CHUNK_BYTES):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > _MAX_LINE_BYTES:
                    lines.append(pending)
                    pending = b""
                for raw in lines:
                    self._emit(managed, raw)
            if pending:
                self._emit(managed, pending)
        finally:
            popen.stdout.close()

    def _emit(self, managed: _Managed, raw: bytes) -> None:
        name = managed.spec.name
        with managed.log_lock:
            if managed.log_file is not None:
                managed.log_file.write(raw + b"\n")
                managed.log_file.flush()
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if self._echo:
            out = self._stream if self._stream is not None else sys.stderr
            isatty = getattr(out, "isatty", None)
            prefix = f"\x1b[{managed.colour}m[{name}]\x1b[0m " if isatty and isatty() else f"[{name}] "
            with self._echo_lock:
                out.write(prefix + line + "\n")
                out.flush()
        if self._on_line is not None:
            try:
                self._on_line(name, line)
            except Exception as err:  # a broken parser must not stall the child's pipe
                if not managed.on_line_failed:
                    managed.on_line_failed = True
                    _log.error("on_line_failed", process=name, error=repr(err))

    def _watch(self, managed: _Managed, popen: subprocess.Popen, reader: threading.Thread) -> None:
        """Reap one attempt, then finish the process or restart it."""
        # Wait without reaping: while the exited child is a zombie its pid (the
        # group id) cannot be reused, so killing the group hits only its leftovers.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOWAIT)
        _signal_group(popen.pid, signal.SIGKILL)
        rc = popen.wait()
        reader.join(_PUMP_DRAIN_S)
        spec = managed.spec
        with self._lock:
            managed.popen = None
            self._record(managed, "exit", rc)
            restart = (rc != 0 and rc not in spec.final_exit_codes and not self._stopping
                       and managed.attempt <= spec.max_restarts)
            if not restart:
                if rc != 0 and not self._stopping:
                    self._record(managed, "gave_up", rc)
                managed.final_rc = rc
            self._changed.notify_all()
        if restart:
            self._restart(managed, rc)

    def _restart(self, managed: _Managed, last_rc: int) -> None:
        if self._stop_requested.wait(managed.spec.restart_delay_s):
            self._finish(managed, last_rc)
            return
        with self._lock:
            if self._stopping:
                self._finish(managed, last_rc)
                return
            self._record(managed, "restart", last_rc, attempt=managed.attempt + 1)
        with managed.log_lock:
            if managed.log_file is not None:
                managed.log_file.write(f"--- restart {managed.attempt} ---\n".encode())
                managed.log_file.flush()
        try:
            spawner = self._spawner
            if spawner is None:
                raise RuntimeError("this supervisor is closed; create a new one")
            spawner.call(lambda: self._launch(managed, first=False))
        except (LaunchError, RuntimeError) as err:
            _log.error("restart_failed", process=managed.spec.name, error=str(err))
            with self._lock:
                if not self._stopping:
                    self._record(managed, "gave_up", last_rc)
                self._finish(managed, last_rc)

    def _finish(self, managed: _Managed, rc: int) -> None:
        with self._lock:
            managed.final_rc = rc
            self._changed.notify_all()

    def _open_events_file(self) -> IO[str]:
        if self._events_file is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._events_file = open(self.run_dir / "events.jsonl", "a", encoding="utf-8")
        return self._events_file

    def _record(self, managed: _Managed, event: str, returncode: int | None = None, attempt: int | None = None) -> None:
        """Append one event to ``events``, ``run_dir/events.jsonl`` and the JSON-lines log (lock held)."""
        popen = managed.popen
        record = {
            "ts": round(time.time(), 6),
            "process": managed.spec.name,
            "role": managed.spec.role,
            "event": event,
            "returncode": returncode,
            "attempt": managed.attempt if attempt is None else attempt,
            "pid": None if popen is None else popen.pid,
        }
        self.events.append(record)
        self._count(managed.spec.role, event, returncode)
        self._open_events_file().write(json.dumps(record, separators=(",", ":")) + "\n")
        self._events_file.flush()
        level = "error" if event == "gave_up" else "warning" if event == "exit" and returncode else "info"
        fields = {k: v for k, v in record.items() if k not in ("ts", "event")}
        _log.log(level, event, **fields)


    def _count(self, role: str, event: str, returncode: int | None) -> None:
        if event == "start":
            self._metrics.live.labels(role).inc()
        elif event == "exit":
            self._metrics.live.labels(role).dec()
            self._metrics.exits.labels(role, "ok" if returncode == 0 else "failed").inc()
        elif event == "restart":
            self._metrics.restarts.labels(role).inc()


class _Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals(
    supervisor: Supervisor,
    grace_s: float = 5.0,
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
) -> Iterator[Supervisor]:
    """While active, SIGINT / SIGTERM stop every supervised process, then exit 128 + signal (130 / 143).

    The stop sends SIGTERM to each process group and SIGKILL after ``grace_s``;
    a second signal during the stop skips the rest of the grace. Must be used
    on the main thread (Python delivers signals there). Previous handlers are
    restored on the way out.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("stop_on_signals() must be used on the main thread, where Python delivers signals")
    state = {"signalled": False}

    def on_signal(signum: int, frame: Any) -> None:
        if state["signalled"]:
            supervisor.skip_grace()
            return
        state["signalled"] = True
        raise _Interrupted(signum)

    previous = {}
    try:
        for sig in signals:
            previous[sig] = signal.signal(sig, on_signal)
        yield supervisor
    except _Interrupted as interrupted:
        _log.warning("interrupted", signal=signal.Signals(interrupted.signum).name)
        supervisor.stop(grace_s)
        raise SystemExit(128 + interrupted.signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_supervised(supervisor: Supervisor, fn: Callable[[], T], grace_s: float = 5.0) -> T:
    """Call ``fn()`` under `stop_on_signals`: its result, or exit 130 / 143 after stopping everything."""
    with stop_on_signals(supervisor, grace_s):
        return fn()
