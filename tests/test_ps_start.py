"""Shard start-up under `hfleet run`: each shard binds its own port, a restart comes back on it,
and a restart whose port is taken is not retried.

Real `hfleet ps serve` subprocesses under the real supervisor, TLS and tokens on.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hybridfleet.errors import EXIT_CODES
from hybridfleet.launch.psjob import _wait_for_ports, new_run_dir, prepare_security, shard_process
from hybridfleet.launch.supervisor import Supervisor
from hybridfleet.spec import load_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STARTS = 4  # the race this guards against lost about one start in ten with two shards


def start_shards(sup: Supervisor, job: Path, run_root: Path, max_restarts: int = 0):
    spec = load_spec(job).model_copy(update={"max_restarts": max_restarts})
    layout = prepare_security(spec, new_run_dir(spec, run_root))
    for i in range(spec.ps.shards):
        shard = shard_process(spec, job, layout, i)
        shard.restart_delay_s = 0.2
        sup.start(shard)
    return layout, _wait_for_ports(layout, spec.ps.shards, sup)


def test_shards_bind_their_own_ports_in_repeated_starts(tmp_path):
    job = REPO / "examples" / "digits-hybrid.yaml"
    for n in range(STARTS):
        with Supervisor(tmp_path / f"sup-{n}", echo=False) as sup:
            # Execute
            _, addresses = start_shards(sup, job, tmp_path / "runs")
            # Assert: every shard serves, on distinct ports, and none exited
            assert len(set(addresses)) == 2
            assert all(sup.returncode(f"shard-{i}") is None for i in range(2))
            for address in addresses:
                host, port = address.rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=5).close()
            sup.stop(grace_s=2.0)


def test_restarted_shard_returns_on_its_port_and_moves_when_its_port_is_taken(tmp_path):
    job = REPO / "examples" / "digits-hybrid.yaml"
    with Supervisor(tmp_path / "sup", echo=False) as sup:
        layout, addresses = start_shards(sup, job, tmp_path / "runs", max_restarts=3)
        port1 = int(addresses[1].rsplit(":", 1)[1])
        # Execute 1: shard 0 crashes; it comes back on the port its workers know
        old_pid = sup.pid("shard-0")
        sup.kill("shard-0")
        sup._wait_until(lambda: sup.pid("shard-0") not in (None, old_pid), 30)
        host0, port0 = addresses[0].rsplit(":", 1)
        sup._wait_until(lambda: _accepts(host0, int(port0)), 30)
        # Execute 2: shard 1 crashes and another program takes its port before the restart
        port_file = layout.run_dir / "shard-1.port"
        sup.kill("shard-1")
        sup._wait_until(lambda: not _accepts("127.0.0.1", port1), 10)
        thief = socket.create_server(("127.0.0.1", port1))
        try:
            sup._wait_until(lambda: port_file.read_text().strip() not in ("", addresses[1]), 60)
            moved = port_file.read_text().strip()
            sup._wait_until(lambda: _accepts("127.0.0.1", int(moved.rsplit(":", 1)[1])), 30)
        finally:
            thief.close()
        # Assert: shard 0 kept its address; shard 1 serves as its own replacement on a new port (the port
        # file, which workers follow), after one restart and without giving up
        assert (layout.run_dir / "shard-0.port").read_text().strip() == addresses[0]
        assert moved != addresses[1] and moved.startswith("127.0.0.1:")
        shard1 = [e for e in sup.events if e["process"] == "shard-1"]
        assert len([e for e in shard1 if e["event"] == "start"]) == 2
        assert sup.returncode("shard-1") is None and not any(e["event"] == "gave_up" for e in shard1)
        sup.stop(grace_s=2.0)


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False
