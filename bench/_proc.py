"""What the benchmarks read about a process from /proc: its CPU-seconds and its status fields."""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU-seconds (every thread) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime (fields 14 and 15 of stat)


def status_field(name: str, pid: int | str = "self") -> int | None:
    """The number in field ``name`` of /proc/PID/status (``"VmRSS"``, ``"VmHWM"``, ``"RssAnon"`` in
    KiB, ``"Threads"``); None when the kernel does not report it."""
    prefix = f"{name}:"
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(prefix):
            return int(line.split()[1])
    return None
