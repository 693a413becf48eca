"""Checks run before a collective launch, so failures are named before any process starts.

Each check either returns a resolved value or raises an error that names the problem
(the port, the host, the framework) and changes nothing.
"""

from __future__ import annotations

import collections
import errno
import importlib.util
import os
import sys
import shutil
import socket
import subprocess
import time

from hybridfleet.errors import FrameworkMissingError, GpuRequiredError, LaunchError, PortInUseError
from hybridfleet.obs.log import get_logger

log = get_logger("launch.preflight")

FRAMEWORK_MODULES = {"torch": "torch", "paddle": "paddle"}
INSTALL_HINTS = {"torch": "pip install 'hybridfleet[torch]'", "paddle": "pip install 'hybridfleet[paddle]'"}


def check_framework(framework: str) -> None:
    """Raise `FrameworkMissingError` (with the install command) unless ``framework`` is importable.

    Looks the module up without importing it, so the launcher stays light.
    """
    if framework not in FRAMEWORK_MODULES:
        raise LaunchError(f"--framework must be one of {sorted(FRAMEWORK_MODULES)} (got {framework!r})",
                          hint="pass --framework torch or --framework paddle")
    if importlib.util.find_spec(FRAMEWORK_MODULES[framework]) is None:
        raise FrameworkMissingError(
            f"framework {framework!r} is not installed in {sys.executable}; {INSTALL_HINTS[framework]}"
        )


def parse_master(master: str) -> tuple[str, int]:
    """Split ``host:port`` into its parts; raise `LaunchError` naming the bad value."""
    host, sep, port_text = master.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise LaunchError(f"--master must be host:port with a port in 1..65535 (got {master!r})",
                          hint="write --master as host:port, e.g. --master 127.0.0.1:29500")
    return host.strip("[]"), int(port_text)


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX); raise `LaunchError` on anything else."""
    parts = nnodes.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise LaunchError(f"--nnodes must be N or MIN:MAX (got {nnodes!r})", hint="e.g. --nnodes 2, or --nnodes 1:4 (elastic)")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise LaunchError(f"--nnodes needs 1 <= MIN <= MAX (got {nnodes!r})", hint="e.g. --nnodes 2, or --nnodes 1:4 (elastic)")
    return low, high


def port_in_use(host: str, port: int) -> bool:
    """True when ``port`` cannot be bound on ``host`` (someone is listening or holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host if _is_local(host) else "", port))
        except OSError:
            return True
    return False


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=512)  # handed out by free_port, newest last


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` right now, and not one this process handed out lately.

    The OS can give the same free port to two binds in a row (the first socket closed at once), so
    ports picked for the ranks of one rendezvous would collide; the last 512 returned are never
    returned again. A picked port is free only when picked: whatever binds port 0 in between may
    take it. Where the process can bind port 0 itself and say which port it got, it does (the
    metrics ports, shards and site hubs of `hfleet run`: `hybridfleet.portfile`); a framework's
    rendezvous needs its ports up front."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host if _is_local(host) else "", 0))
            port = sock.getsockname()[1]
        if port not in _RECENT_PORTS:
            break
    _RECENT_PORTS.append(port)
    return port


def listen(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket on ``host:port`` for ``what`` (e.g. "the registry"), bound before any
    server starts; a port in use is a `PortInUseError` naming it (exit code ``port_in_use``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use: {what} cannot serve there",
                                 hint="choose another with --port (0 picks a free port), or stop the process "
                                      "holding it") from None
        raise LaunchError(f"cannot bind {what} to {host}:{port}: {err.strerror or err}",
                          hint="bind an address of this machine (127.0.0.1 for this machine only)") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted connections inherit it
    sock.listen(128)
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    """``scheme://host:port`` of a listening socket (a wildcard address shown as 127.0.0.1)."""
    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
    return f"{scheme}://{shown}:{port}"


def _is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise `LaunchError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while True:
        remaining_s = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, remaining_s))):
                return
        except OSError as err:
            last_error = str(err) or type(err).__name__
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"master {host}:{port} is unreachable after {timeout_s:g}s ({last_error}); "
                f"start node rank 0 first and check the address and firewall",
                hint="start `hfleet launch --node-rank 0` on the master first; check --master and that its port is open",
            )
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def resolve_master(master: str, nnodes: str, node_rank: int, connect_timeout_s: float) -> str:
    """The ``host:port`` the group will rendezvous on.

    Single node: a busy port is replaced by a free one (logged). Multi-node rank 0: a busy
    port is an error naming it. Multi-node rank > 0: the master must accept connections
    within ``connect_timeout_s``.
    """
    host, port = parse_master(master)
    low, high = parse_nnodes(nnodes)
    if high == 1:
        if port_in_use(host, port):
            new_port = free_port(host)
            log.info("master_port_busy", port=port, picked=new_port)
            port = new_port
        return f"{host}:{port}"
    if node_rank == 0:
        if _is_local(host) or _is_this_host(host):
            if port_in_use(host, port):
                raise LaunchError(
                    f"master port {port} on {host} is already in use; free it or choose another with --master",
                    hint="stop the process holding the port, or pass --master host:OTHER_PORT on every node",
                )
        return f"{host}:{port}"
    wait_reachable(host, port, connect_timeout_s)
    return f"{host}:{port}"


def _is_this_host(host: str) -> bool:
    try:
        return socket.gethostbyname(host) in {"127.0.0.1", socket.gethostbyname(socket.gethostname())}
    except OSError:
        return False


def count_visible_gpus() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L`` (0 without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def check_devices(device: str, nproc_per_node: int, visible_gpus: int) -> None:
    """On ``device == "gpu"`` there must be one visible GPU per process; cpu and auto need nothing."""
    if device not in ("auto", "cpu", "gpu"):
        raise LaunchError(f"--device must be auto, cpu or gpu (got {device!r})", hint="pass --device auto, cpu or gpu")
    if device != "gpu":
        return
    if visible_gpus == 0:
        raise GpuRequiredError("--device gpu was requested but no GPU is visible on this machine")
    if nproc_per_node > visible_gpus:
        raise LaunchError(
            f"--nproc-per-node {nproc_per_node} is more than the {visible_gpus} visible GPU(s); "
            f"use --nproc-per-node {visible_gpus} or fewer",
            hint=f"pass --nproc-per-node {visible_gpus} or fewer (one process per GPU)",
        )
