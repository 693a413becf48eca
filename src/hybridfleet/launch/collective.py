"""Collective (AllReduce) data-parallel launch, delegated to the frameworks' own launchers.

``launch(config)`` runs preflight checks, then starts ``python -m torch.distributed.run``
or ``python -m paddle.distributed.launch`` with the same meaning for the same flags. The
frameworks are never imported in this process: it only builds a command line, watches the
process group, and on failure names the failing rank, its exit code and its last log lines.
Restarts are done here, not by the frameworks, so both behave alike: attempt ``k`` runs
with ``HFLEET_RESTART_COUNT=k`` and ``HFLEET_CKPT_DIR`` so the script can resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hybridfleet.errors import InterruptedByUserError, LaunchError
from hybridfleet.launch import preflight
from hybridfleet.launch.failure import RankFailure, diagnose
from hybridfleet.obs.log import get_logger

log = get_logger("launch.collective")

DEFAULT_MASTER = "127.0.0.1:29500"
STOP_GRACE_S = 10.0
DEVICE_BACKENDS = {"cpu": "gloo", "gpu": "nccl"}


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Everything one ``hfleet launch`` needs; validated by `launch` before anything starts."""

    framework: str
    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: str = "1"
    master: str | None = None
    node_rank: int | None = None  # None: 0 on one node; paddle's master assigns it on several
    max_restarts: int = 0
    log_dir: Path = Path("runs/launch")
    ckpt_dir: str | None = None  # a directory or a store URL (s3://...)
    device: str = "auto"
    connect_timeout_s: float = 60.0
    python: str = sys.executable


@dataclass
class LaunchResult:
    """How a launch ended: the attempts it took and the failures along the way."""

    attempts: int
    master: str
    log_dir: Path
    failures: list[RankFailure] = field(default_factory=list)


def build_command(config: LaunchConfig, master: str, attempt_dir: Path) -> list[str]:
    """The framework launcher's command line for one attempt (no restarts inside it)."""
    host, port = preflight.parse_master(master)
    low, high = preflight.parse_nnodes(config.nnodes)
    if config.framework == "torch":
        cmd = [config.python, "-m", "torch.distributed.run",
               f"--nproc-per-node={config.nproc_per_node}", f"--nnodes={config.nnodes}",
               "--max-restarts=0", f"--log-dir={attempt_dir}", "--redirects=3", "--tee=3"]
        if low == high:
            cmd += [f"--node-rank={config.node_rank or 0}", f"--master-addr={host}", f"--master-port={port}"]
        else:
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id=hfleet-{host}-{port}"]
    else:
        cmd = [config.python, "-m", "paddle.distributed.launch",
               f"--nproc_per_node={config.nproc_per_node}", f"--nnodes={config.nnodes}",
               f"--master={master}", f"--log_dir={attempt_dir}", "--max_restart=0", "--job_id=hfleet"]
        if low == high and config.node_rank is not None:
            cmd.append(f"--rank={config.node_rank}")
        if config.device == "gpu":
            cmd.append("--devices=" + ",".join(str(i) for i in range(config.nproc_per_node)))
    return cmd + [config.script, *config.script_args]


def child_env(config: LaunchConfig, attempt: int, ckpt_dir: str | Path, launch_id: str) -> dict[str, str]:
    """The environment of the framework launcher and, through it, of every rank."""
    env = dict(os.environ)
    env.update({
        "HFLEET_RESTART_COUNT": str(attempt),
        "HFLEET_CKPT_DIR": str(ckpt_dir),
        "HFLEET_MODEL_DIR": str(Path(config.log_dir).resolve() / "model"),
        "HFLEET_LOG_DIR": str(config.log_dir),
        "HFLEET_FRAMEWORK": config.framework,
        "HFLEET_LAUNCH_ID": launch_id,
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("OMP_NUM_THREADS", "1")
    if config.device in DEVICE_BACKENDS:
        env["HFLEET_DIST_BACKEND"] = DEVICE_BACKENDS[config.device]
    if config.device == "cpu" and config.framework == "torch":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif config.device == "cpu":
        # paddle's launcher reads any CUDA_VISIBLE_DEVICES (even empty) as "GPUs wanted";
        # without it a CPU build runs its ranks on gloo.
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _validate(config: LaunchConfig) -> None:
    preflight.check_framework(config.framework)
    if config.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1 (got {config.nproc_per_node})", hint="pass --nproc-per-node 1 or more")
    if config.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0 (got {config.max_restarts})", hint="pass --max-restarts 0 or more")
    low, high = preflight.parse_nnodes(config.nnodes)
    if config.node_rank is not None and not 0 <= config.node_rank < high:
        raise LaunchError(f"--node-rank must be in 0..{high - 1} for --nnodes {config.nnodes} (got {config.node_rank})",
                          hint=f"pass --node-rank 0..{high - 1}: 0 on the master node, one distinct rank per node")
    if config.framework == "torch" and low == high > 1 and config.node_rank is None:
        raise LaunchError("torch with --nnodes > 1 needs --node-rank (0 on the master node)",
                          hint="pass --node-rank 0 on the master node and 1, 2, ... on the others")
    if config.framework == "paddle" and low != high and not (config.master or "").startswith("etcd://"):
        raise LaunchError("paddle elastic --nnodes MIN:MAX needs an etcd master: --master etcd://host:port",
                          hint="pass --master etcd://host:port, or a fixed --nnodes N")
    if not Path(config.script).is_file():
        raise LaunchError(f"training script {config.script!r} does not exist",
                          hint=f"check the script path (relative paths start at {Path.cwd()})")
    if high > 1 and config.master is None:
        raise LaunchError("--nnodes > 1 needs --master host:port (the address of node rank 0)",
                          hint="pass --master host:port of node rank 0 on every node")
    visible = preflight.count_visible_gpus() if config.device == "gpu" else 0
    preflight.check_devices(config.device, config.nproc_per_node, visible)


def _resolve_master(config: LaunchConfig) -> str:
    master = config.master or DEFAULT_MASTER
    if master.startswith("etcd://"):
        return master
    if config.node_rank is None and preflight.parse_nnodes(config.nnodes)[1] > 1:
        return master  # paddle assigns node ranks itself: this node may or may not be the master
    return preflight.resolve_master(master, config.nnodes, config.node_rank, config.connect_timeout_s)


def launch(config: LaunchConfig, echo: Callable[[str], None] | None = None) -> LaunchResult:
    """Run the script on ``nproc_per_node`` processes, restarting up to ``max_restarts`` times.

    Returns when an attempt succeeds; raises `LaunchError` naming the failing rank, its
    exit code and last log lines when the last attempt fails. Every process of a failed
    attempt is gone before the next starts or the error is raised. ``echo`` receives the
    launcher's output line by line (the CLI passes the terminal).
    """
    _validate(config)
    master = _resolve_master(config)
    log_dir = Path(config.log_dir)
    ckpt_dir = config.ckpt_dir or str(log_dir / "ckpt")
    log_dir.mkdir(parents=True, exist_ok=True)
    failures: list[RankFailure] = []
    for attempt in range(config.max_restarts + 1):
        if attempt:  # a single node may find its port taken meanwhile; workers wait for the master again
            master = _resolve_master(config)
        attempt_dir = log_dir / f"attempt_{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        launch_id = uuid.uuid4().hex
        cmd = build_command(config, master, attempt_dir)
        log.info("attempt_start", attempt=attempt, master=master, framework=config.framework,
                 nproc_per_node=config.nproc_per_node, log_dir=str(attempt_dir))
        code, output = run_group(cmd, child_env(config, attempt, ckpt_dir, launch_id), attempt_dir, launch_id, echo)
        if code == 0:
            log.info("attempt_ok", attempt=attempt)
            return LaunchResult(attempts=attempt + 1, master=master, log_dir=log_dir, failures=failures)
        failure = diagnose(config.framework, output, attempt_dir, config.node_rank or 0, config.nproc_per_node)
        failures.append(failure)
        log.error("attempt_failed", attempt=attempt, launcher_exit_code=code, rank=failure.rank,
                  exit_code=failure.exit_code, logs=[str(p) for p in failure.log_files])
    raise LaunchError(
        f"process group failed after {config.max_restarts + 1} attempt(s); {failures[-1].describe()}"
    )


def run_group(
    cmd: list[str], env: dict[str, str], attempt_dir: Path, launch_id: str, echo: Callable[[str], None] | None
) -> tuple[int, str]:
    """Run one launcher process group to the end; return (exit code, its output).

    The output is also kept in ``attempt_dir/launcher.log``. Whatever the outcome, no
    process of the group (tagged by ``HFLEET_LAUNCH_ID``) outlives this call.
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    muted = threading.Event()
    reader = threading.Thread(target=_pump, args=(proc.stdout, attempt_dir / "launcher.log", lines, echo, muted),
                              daemon=True)
    reader.start()
    restore = _terminate_raises()
    try:
        code = proc.wait()
    except (KeyboardInterrupt, _Terminated) as stop:
        # The launchers answer our SIGTERM with a traceback per process; they go to the log, not the terminal.
        muted.set()
        _stop_group(proc.pid, launch_id)
        proc.wait()
        reader.join(timeout=STOP_GRACE_S)
        how = "terminated" if isinstance(stop, _Terminated) else "interrupted"
        raise InterruptedByUserError(f"{how}; every rank was stopped (logs in {attempt_dir})") from None
    finally:  # the group must not outlive us, whatever happened
        restore()
        _stop_group(proc.pid, launch_id)
        code = proc.wait()
        reader.join(timeout=STOP_GRACE_S)
    return code, "".join(lines)


class _Terminated(BaseException):
    """SIGTERM arrived while a process group ran (raised on the main thread, like KeyboardInterrupt)."""


def _raise_terminated(signum: int, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the stop short
    raise _Terminated()


def _terminate_raises() -> Callable[[], None]:
    """On the main thread, make SIGTERM raise `_Terminated` (so the group is stopped before this process
    ends, as on Ctrl-C); returns what puts the previous handler back (a no-op off the main thread, where
    Python delivers no signal)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _pump(stream, log_path: Path, lines: list[str], echo: Callable[[str], None] | None,
          muted: threading.Event) -> None:
    with open(log_path, "a", encoding="utf-8") as sink:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            lines.append(line)
            sink.write(line)
            sink.flush()
            if echo is not None and not muted.is_set():
                echo(line)
    stream.close()


def group_pids(launch_id: str) -> list[int]:
    """Pids of live processes carrying ``HFLEET_LAUNCH_ID=launch_id`` (Linux /proc; [] elsewhere)."""
    needle = f"HFLEET_LAUNCH_ID={launch_id}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and not _is_zombie(entry):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _is_zombie(proc_dir: Path) -> bool:
    stat = (proc_dir / "stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"


def _stop_group(pgid: int, launch_id: str) -> None:
    """SIGTERM the launcher's process group and every tagged process, then SIGKILL what is left.

    Both torch's and paddle's launchers start each rank in a new session, so signalling the
    launcher's process group alone would miss ranks; the ``HFLEET_LAUNCH_ID`` tag finds them.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in group_pids(launch_id):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (STOP_GRACE_S if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline and (_group_alive(pgid) or group_pids(launch_id)):
            time.sleep(0.05)
        if not (_group_alive(pgid) or group_pids(launch_id)):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # A group whose only members are zombies awaiting their parent counts as gone.
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False
