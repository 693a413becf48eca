"""Change a job's shard count while it trains (`hfleet ps scale RUN_DIR --shards N`).

The hand-over, at a BSP round boundary:

1. every old shard gets SIGUSR1: it stops answering, writes a snapshot of the version it holds
   and exits 0 (`hfleet ps serve`); BSP shards are then at most one round apart;
2. the old port files are removed and the snapshots re-cut for N shards at the newest version
   every old shard holds (`hybridfleet.ps.server.handover.reshard_store`; a shard one round
   ahead has that round retired, its workers push it again);
3. the new count is named in ``RUN_DIR/shards.json`` (a new plan generation,
   `hybridfleet.ps.worker.resolve.write_plan`), then N shards start from the re-cut snapshots
   and write their port files;
4. workers see the new generation at their next failing call and join the new shards
   (`hybridfleet.ps.worker.replan`): no push is lost or applied twice.

`hfleet run` owns the shard processes: the command writes ``RUN_DIR/scale-request.json`` and
the run's supervisor does the hand-over (`ScaleWatcher`), answering in
``RUN_DIR/scale-result.json``. Refusals (`ScaleError`) come before anything is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hybridfleet.errors import UsageError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.server.handover import reshard_store
from hybridfleet.ps.worker.resolve import current_plan, port_file, write_plan
from hybridfleet.spec.models import JobSpec

log = get_logger("launch.scale")

REQUEST = "scale-request.json"
RESULT = "scale-result.json"


class ScaleError(UsageError):
    """The shard count cannot be changed as asked; nothing was stopped or written."""


def live_shard_count(spec: JobSpec, run_dir: str | Path) -> int:
    """How many shards the job in ``run_dir`` runs now: the plan file's count, else ``ps.shards``."""
    _, shards = current_plan(run_dir)
    return shards or spec.ps.shards


def check_scale(spec: JobSpec, current: int, shards) -> bool:
    """Whether changing ``current`` shards to ``shards`` is to be done (False: it is the count already).
    Raises ScaleError, with what to do, when it cannot be done; nothing is changed either way."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ScaleError(f"--shards: must be an integer >= 1 (got {shards!r}); nothing changed",
                         hint="pass the new shard count, e.g. --shards 4")
    if spec.ps.sync != "bsp":
        raise ScaleError(f"the shard count of a job with ps.sync: {spec.ps.sync} cannot change while it trains: "
                         "only bsp shards share a round boundary to hand over at; nothing changed",
                         hint="stop the job and resume it with the new ps.shards (`hfleet run JOB --resume RUN`)")
    if not spec.ps.snapshot_every_steps and not spec.ps.snapshot_every_s:
        raise ScaleError("the job keeps no shard snapshots (ps.snapshot_every_steps / ps.snapshot_every_s unset), "
                         "so its shards cannot hand over; nothing changed",
                         hint="set ps.snapshot_every_steps: 1 in the job file for the next run")
    if spec.checkpoint.keep_last < 2:
        raise ScaleError(f"the job keeps {spec.checkpoint.keep_last} snapshot per shard (checkpoint.keep_last); a "
                         "hand-over needs the two newest (BSP shards may be one round apart); nothing changed",
                         hint="set checkpoint.keep_last: 2 or more in the job file for the next run")
    if spec.ps.secure_aggregation is not None:
        raise ScaleError("a job under secure aggregation cannot change its shard count while it trains (the "
                         "masks are cut for its shards); nothing changed",
                         hint="stop the job and resume it with the new ps.shards")
    return shards != current


def hand_over(run_dir: str | Path, store: str, current: int, shards: int, stop_old: Callable[[], None],
              start_new: Callable[[int], None], restart_old: Callable[[], None] | None = None) -> dict:
    """Move the job in ``run_dir`` (snapshots under ``store``) from ``current`` to ``shards`` shards as the
    module says: ``stop_old()`` hands over and waits until every old shard exited; ``start_new(n)``
    starts shards 0..n-1 for a job of n shards. Returns `reshard_store`'s answer plus ``generation``.
    When the old shards cannot all be stopped or their snapshots cannot be re-cut, ``restart_old()``
    brings back the stopped ones (their final snapshots hold the job; workers follow them) and the
    error is raised."""
    run_dir = Path(run_dir)
    generation, _ = current_plan(run_dir)
    started = time.monotonic()
    try:
        stop_old()
        for i in range(current):
            port_file(run_dir, i).unlink(missing_ok=True)
        moved = reshard_store(store, shards)
    except Exception:
        if restart_old is not None:
            restart_old()
        raise
    write_plan(run_dir, generation + 1, shards)
    start_new(shards)
    moved["generation"] = generation + 1
    moved["seconds"] = round(time.monotonic() - started, 3)
    log.info("shard_count_changed", **moved)
    return moved


def request_scale(run_dir: str | Path, shards: int, timeout_s: float = 120.0) -> dict:
    """Ask the `hfleet run` supervising ``run_dir`` to change its shard count to ``shards`` and wait
    for its answer: ``{"ok": True, ...what moved}``, ``{"ok": True, "noop": message}`` or
    ``{"ok": False, "error": message}``. ScaleError (nothing written) when ``run_dir`` is not the
    folder of a running `hfleet run` job, or one is pending."""
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file() and not (run_dir / "logs").is_dir():
        raise ScaleError(f"{run_dir} is not the folder of an `hfleet run` job; nothing changed",
                         hint="pass the RUN_DIR that `hfleet run` printed")
    if (run_dir / "summary.json").is_file() or not (run_dir / "supervisor.pid").is_file() \
            or not _alive(run_dir / "supervisor.pid"):
        raise ScaleError(f"the job in {run_dir} is not running (it finished, or its `hfleet run` is gone); "
                         "nothing changed",
                         hint="resume it with another ps.shards instead: `hfleet run JOB --resume RUN`")
    request = run_dir / REQUEST
    if request.exists():
        raise ScaleError(f"a change of the shard count is already pending in {run_dir}; nothing changed",
                         hint=f"wait for {run_dir / RESULT}")
    (run_dir / RESULT).unlink(missing_ok=True)
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    tmp = request.with_suffix(".tmp")
    tmp.write_text(json.dumps({"shards": shards, "token": token}) + "\n")
    tmp.rename(request)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = json.loads((run_dir / RESULT).read_text())
        except (OSError, ValueError):
            answer = None
        if answer is not None and answer.get("token") == token:
            return answer
        time.sleep(0.1)
    raise ScaleError(f"the job in {run_dir} did not answer within {timeout_s:.0f} s (the request stays in "
                     f"{request}, and is done when its supervisor gets to it)", hint=f"see {run_dir}/logs/")


def _alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


class ScaleWatcher:
    """In `hfleet run`: does the hand-over each ``RUN_DIR/scale-request.json`` asks for (one at a time)."""

    def __init__(self, spec: JobSpec, run_dir: Path, store: str, stop_old: Callable[[int], None],
                 start_new: Callable[[int], None], poll_s: float = 0.2,
                 restart_old: Callable[[int], None] | None = None):
        """``stop_old(n)``: hand shards 0..n-1 over and wait for their exit; ``start_new(n)``: start
        shards 0..n-1 of a job of n shards; ``restart_old(n)``: bring back those of 0..n-1 that
        exited (after a failed hand-over)."""
        self.spec, self.run_dir, self.store = spec, Path(run_dir), store
        self.stop_old, self.start_new = stop_old, start_new
        self.restart_old = restart_old or (lambda n: None)
        self.poll_s = poll_s
        self.current = live_shard_count(spec, run_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hfleet-scale")
        (self.run_dir / "supervisor.pid").write_text(f"{os.getpid()}\n")

    def start(self) -> "ScaleWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(300)
        (self.run_dir / "supervisor.pid").unlink(missing_ok=True)

    def _loop(self) -> None:
        request = self.run_dir / REQUEST
        while not self._stop.wait(self.poll_s):
            if not request.exists():
                continue
            try:
                doc = json.loads(request.read_text())
            except (OSError, ValueError):
                continue
            self._answer(self.handle(doc.get("shards")) | {"token": doc.get("token")})
            request.unlink(missing_ok=True)

    def handle(self, shards) -> dict:
        """Do one requested change; the answer as `request_scale` returns it."""
        try:
            if not check_scale(self.spec, self.current, shards):
                return {"ok": True, "noop": f"the job runs {shards} shard(s) already; nothing changed"}
        except ScaleError as err:
            return {"ok": False, "error": str(err), "hint": err.hint}
        old = self.current
        try:
            moved = hand_over(self.run_dir, self.store, old, shards, lambda: self.stop_old(old), self.start_new,
                              restart_old=lambda: self.restart_old(old))
        except Exception as err:  # the old shards are back (restart_old): the job trains on as before
            log.error("shard_count_change_failed", error=str(err))
            return {"ok": False, "error": f"the shards could not hand over ({err}); the job goes on with "
                                          f"{old} shard(s)"}
        self.current = shards
        return {"ok": True, **moved}

    def _answer(self, answer: dict) -> None:
        path = self.run_dir / RESULT
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(answer) + "\n")
        tmp.rename(path)


def supervised_watcher(spec: JobSpec, job_path: Path, layout, sup, start_all: Callable[[list], None]) -> ScaleWatcher:
    """The `ScaleWatcher` of an `hfleet run` job: old shards are the supervisor's processes (handed over
    with SIGUSR1, exiting 0, not restarted); the new ones are named ``shard-<i>.<k>`` (k-th start)."""
    from hybridfleet.launch.psjob import shard_process, snapshot_store

    names = {i: f"shard-{i}" for i in range(spec.ps.shards)}
    starts = [0]

    def stop_old(n: int) -> None:
        for i in range(n):
            if sup.pid(names[i]) is not None:
                sup.kill(names[i], signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while any(sup.returncode(names[i]) is None for i in range(n)):
            if time.monotonic() > deadline:
                raise ScaleError(f"shards {[names[i] for i in range(n) if sup.returncode(names[i]) is None]} "
                                 "did not hand over within 120 s")
            time.sleep(0.05)

    def start_new(n: int, only: list[int] | None = None) -> None:
        starts[0] += 1
        procs = []
        for i in range(n) if only is None else only:
            p = shard_process(spec, job_path, layout, i)
            p.name = f"shard-{i}.{starts[0]}"  # supervised names are unique within a run
            p.argv += ["--shards", str(n)]
            names[i] = p.name
            procs.append(p)
        start_all(procs)
        deadline = time.monotonic() + 120
        while not all(port_file(layout.run_dir, i).is_file() for i in range(n)):
            failed = [names[i] for i in range(n) if sup.returncode(names[i]) is not None]
            if failed or time.monotonic() > deadline:
                raise ScaleError(f"new shard(s) {failed or [names[i] for i in range(n)]} did not start; "
                                 f"see {layout.run_dir}/logs/")
            time.sleep(0.05)

    def restart_old(n: int) -> None:
        gone = [i for i in range(n) if sup.returncode(names[i]) is not None]
        if gone:  # each restores its final snapshot and rewrites its port file; workers follow it
            start_new(n, only=gone)

    return ScaleWatcher(spec, layout.run_dir, snapshot_store(spec, layout.resume_from or layout.run_dir),
                        stop_old, start_new, restart_old=restart_old)
