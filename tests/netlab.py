"""Hosts in their own network namespaces, for system tests of deployments across machines.

    with NetLab() as lab:                                   # needs root and `ip netns`
        lab.segment("cloud")
        lab.segment("hospital")
        lab.link("hospital", "cloud", rate_mbit=20)         # a tbf-capped WAN link, both directions
        shard = lab.host("shard-0", "cloud", names=["shard-0.cloud.example"])
        lab.write_hosts()                                   # every host resolves every name
        subprocess.run([*shard.exec_prefix, "hostname", "-I"])

Layout: one extra namespace holds a bridge per segment; each host namespace has
an ``eth0`` (one end of a veth pair whose other end is a port of its segment's
bridge), and segments are joined by a veth pair between their bridges with a
``tc qdisc tbf`` on each end (``netem`` is not available in this kernel, so there
is no added latency). All hosts share one /16, so no routing is needed. Names
resolve through ``/etc/netns/<ns>/hosts``, which ``ip netns exec`` bind-mounts
over /etc/hosts. Nothing is created in the root namespace except the namespaces
themselves and their /etc/netns directories; every name carries a per-run tag,
and `close` removes all of it (also registered with ``atexit``).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
SUBNET = "10.77"  # hosts are 10.77.<segment>.<n>/16


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None (root with `ip` and `tc`)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    """One machine: a network namespace with one address and the names it answers to."""

    name: str
    namespace: str
    segment: str
    address: str
    names: list[str] = field(default_factory=list)

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix an argv with this to run it on the host."""
        return ["ip", "netns", "exec", self.namespace]

    def pids(self) -> list[int]:
        """Every process that lives in this host's namespace."""
        out = _run("ip", "netns", "pids", self.namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of the host (a power cut when SIGKILL); returns the pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids


class NetLab:
    """Segments (bridges), WAN links between them and hosts, all torn down by `close`."""

    def __init__(self, tag: str | None = None):
        self.tag = tag or f"hf{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-switch"
        self.segments: dict[str, int] = {}
        self.hosts: dict[str, Host] = {}
        self.extra_names: dict[str, str] = {}  # name -> address, for names that are not a host's own
        self._namespaces: list[str] = []
        self._links = 0

    def __enter__(self) -> "NetLab":
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        atexit.register(self.close)
        self._add_namespace(self.switch)
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _add_namespace(self, namespace: str) -> None:
        _run("ip", "netns", "add", namespace)
        self._namespaces.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")

    def segment(self, name: str) -> None:
        """A switched network (one bridge) that hosts join."""
        index = len(self.segments) + 1
        _run("ip", "-n", self.switch, "link", "add", f"br{index}", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", f"br{index}", "up")
        self.segments[name] = index

    def link(self, a: str, b: str, rate_mbit: float, burst_kbit: int = 32, latency_ms: int = 400) -> None:
        """Join segments ``a`` and ``b`` by a link capped at ``rate_mbit`` in each direction."""
        self._links += 1
        end_a, end_b = f"wan{self._links}a", f"wan{self._links}b"
        sw = ("ip", "-n", self.switch)
        _run(*sw, "link", "add", end_a, "type", "veth", "peer", "name", end_b)
        tbf = ("tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst_kbit}kbit", "latency", f"{latency_ms}ms")
        for end, seg in ((end_a, a), (end_b, b)):
            _run(*sw, "link", "set", end, "master", f"br{self.segments[seg]}")
            _run(*sw, "link", "set", end, "up")
            _run("tc", "-n", self.switch, "qdisc", "add", "dev", end, "root", *tbf)

    def link_counters(self) -> dict[str, tuple[str, int]]:
        """Each WAN link end's tbf rate and the bytes it has sent, e.g. ``{"wan1a": ("20Mbit", 1234)}``."""
        out = {}
        for n in range(1, self._links + 1):
            for end in (f"wan{n}a", f"wan{n}b"):
                text = _run("tc", "-s", "-n", self.switch, "qdisc", "show", "dev", end).stdout
                rate = re.search(r"\btbf\b.*?\brate (\S+)", text)
                sent = re.search(r"Sent (\d+) bytes", text)
                out[end] = (rate.group(1) if rate else "", int(sent.group(1)) if sent else 0)
        return out

    def host(self, name: str, segment: str, names: list[str] | tuple[str, ...] = ()) -> Host:
        """A new machine on ``segment``; it answers to ``name`` and every entry of ``names``."""
        index = self.segments[segment]
        number = 1 + sum(1 for h in self.hosts.values() if h.segment == segment)
        namespace = f"{self.tag}-{name}"
        self._add_namespace(namespace)
        port = f"p{len(self.hosts) + 1}"
        address = f"{SUBNET}.{index}.{number}"
        _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
             "netns", namespace)
        _run("ip", "-n", self.switch, "link", "set", port, "master", f"br{index}")
        _run("ip", "-n", self.switch, "link", "set", port, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/16", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        host = Host(name, namespace, segment, address, [name, *names])
        self.hosts[name] = host
        return host

    def alias(self, name: str, address: str) -> None:
        """Make ``name`` resolve to ``address`` on every host (e.g. a Service name)."""
        self.extra_names[name] = address

    def write_hosts(self) -> None:
        """Write each host's /etc/netns/<ns>/hosts: localhost, then every host's names and every alias."""
        table = [(h.address, h.names) for h in self.hosts.values()]
        table += [(addr, [name]) for name, addr in self.extra_names.items()]
        for host in self.hosts.values():
            self.hosts_file(host, table)

    def hosts_file(self, host: Host, table: list[tuple[str, list[str]]]) -> Path:
        """Write ``host``'s hosts file from (address, names) rows (after localhost); returns its path."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{addr}\t{' '.join(names)}" for addr, names in table if names]
        directory = NETNS_ETC / host.namespace
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")
        (directory / "hostname").write_text(host.name + "\n")
        return directory / "hosts"

    def close(self) -> None:
        """Kill what still runs in the hosts, delete every namespace and /etc/netns entry (idempotent)."""
        for host in self.hosts.values():
            host.kill_all()
        for namespace in reversed(self._namespaces):
            _run("ip", "netns", "del", namespace, check=False)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        self._namespaces.clear()
