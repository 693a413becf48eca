"""A rate-capped WAN link for benchmarks: a network namespace joined to the host by a veth pair.

    with WanLink(rate_mbit=20) as link:      # needs root and `ip netns`
        link.host_addr, link.ns_addr         # 10.231.0.1 (host side), 10.231.0.2 (in the namespace)
        link.measure_mbit("up")              # raw TCP throughput namespace -> host

Each end of the pair gets a ``tc qdisc tbf`` on its egress, so both directions
are capped (``netem`` is not available in this kernel, so there is no added
latency). Only the namespace and the addresses created here are ever touched:
setup first removes leftovers of a crashed run under the same names, teardown
is idempotent and also registered with ``atexit``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
from pathlib import Path

NAMESPACE = "hf-hosp"
HOST_IF = "hf-h0"
NS_IF = "hf-h1"
HOST_ADDR = "10.231.0.1"
NS_ADDR = "10.231.0.2"
PREFIX_LEN = 30
PROBE_TIMEOUT_S = 120.0

# Runs inside the namespace for the throughput probe: `send HOST PORT NBYTES` or `recv ADDR`.
_PROBE_SCRIPT = r"""
import socket, sys, time
mode = sys.argv[1]
if mode == "send":
    host, port, total = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    chunk = b"\0" * (64 << 10)
    with socket.create_connection((host, port)) as s:
        sent = 0
        while sent < total:
            n = min(len(chunk), total - sent)
            s.sendall(chunk[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
else:
    srv = socket.socket()
    srv.bind((sys.argv[2], 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 16)
    got, first = 0, None
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if first is None:
            first = time.perf_counter()
        got += n
    print(got, time.perf_counter() - first, flush=True)
    conn.close()
"""


class WanUnavailable(RuntimeError):
    """This machine cannot build the link (not root, no `ip`/`tc`, or the kernel refuses)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise WanUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why the link cannot be built here, or None when root, `ip` and `tc` are present."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def cleanup() -> None:
    """Remove the namespace and the host end of the pair if they exist (deleting one end deletes both)."""
    if _run("ip", "link", "show", HOST_IF, check=False).returncode == 0:
        _run("ip", "link", "del", HOST_IF, check=False)
    if NAMESPACE in _run("ip", "netns", "list", check=False).stdout.split():
        _run("ip", "netns", "del", NAMESPACE, check=False)


class WanLink:
    """The namespace, the veth pair and the tbf caps; a context manager that always tears down."""

    def __init__(self, rate_mbit: float, burst_kbit: int = 32, latency_ms: int = 400):
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit: must be > 0 (got {rate_mbit})")
        self.rate_mbit = rate_mbit
        self.burst_kbit = burst_kbit
        self.latency_ms = latency_ms
        self.namespace = NAMESPACE
        self.host_addr = HOST_ADDR
        self.ns_addr = NS_ADDR

    def __enter__(self) -> "WanLink":
        self.setup()
        return self

    def __exit__(self, *exc_info) -> None:
        self.teardown()

    def setup(self) -> None:
        """Build the link; on any failure, remove what was made and raise `WanUnavailable`."""
        reason = unavailable_reason()
        if reason:
            raise WanUnavailable(reason)
        cleanup()
        atexit.register(cleanup)
        try:
            ns = ("ip", "netns", "exec", NAMESPACE)
            tbf = ("tbf", "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kbit}kbit",
                   "latency", f"{self.latency_ms}ms")
            _run("ip", "netns", "add", NAMESPACE)
            _run("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
            _run("ip", "link", "set", NS_IF, "netns", NAMESPACE)
            _run("ip", "addr", "add", f"{HOST_ADDR}/{PREFIX_LEN}", "dev", HOST_IF)
            _run(*ns, "ip", "addr", "add", f"{NS_ADDR}/{PREFIX_LEN}", "dev", NS_IF)
            _run("ip", "link", "set", HOST_IF, "up")
            _run(*ns, "ip", "link", "set", NS_IF, "up")
            _run(*ns, "ip", "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", HOST_IF, "root", *tbf)
            _run(*ns, "tc", "qdisc", "add", "dev", NS_IF, "root", *tbf)
        except BaseException:
            cleanup()
            raise

    def teardown(self) -> None:
        """Remove the link (safe to call twice)."""
        cleanup()

    def link_bytes(self) -> int:
        """Bytes that have crossed the link so far, both directions, as the host end's counters say.

        Everything counts: TLS records, gRPC framing, TCP/IP headers, heartbeats.
        """
        stats = Path("/sys/class/net") / HOST_IF / "statistics"
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def measure_mbit(self, direction: str, seconds: float = 3.0) -> float:
        """Raw TCP throughput across the link in Mbit/s: ``up`` is namespace -> host, ``down`` host -> namespace.

        About ``seconds`` worth of bytes at the set rate are sent; the clock runs
        from the first byte received to the last.
        """
        if direction not in ("up", "down"):
            raise ValueError(f"direction: must be 'up' or 'down' (got {direction!r})")
        total_bytes = int(self.rate_mbit * 1e6 / 8 * seconds)
        in_ns = ["ip", "netns", "exec", NAMESPACE]
        probe = [sys.executable, "-c", _PROBE_SCRIPT]
        # the receiver sits where the bytes go; the sender's side of the pair caps its egress
        recv_prefix, recv_addr = ([], self.host_addr) if direction == "up" else (in_ns, self.ns_addr)
        send_prefix = in_ns if direction == "up" else []
        receiver = subprocess.Popen([*recv_prefix, *probe, "recv", recv_addr], stdout=subprocess.PIPE, text=True)
        try:
            port = receiver.stdout.readline().strip()
            subprocess.run([*send_prefix, *probe, "send", recv_addr, port, str(total_bytes)], check=True,
                           timeout=PROBE_TIMEOUT_S)
            out, _ = receiver.communicate(timeout=PROBE_TIMEOUT_S)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        got_bytes, elapsed_s = int(out.split()[0]), float(out.split()[1])
        if got_bytes != total_bytes:
            raise RuntimeError(f"throughput probe ({direction}) received {got_bytes} of {total_bytes} bytes")
        return got_bytes * 8 / elapsed_s / 1e6
