"""Facts about this host that need no framework: Python, OS, CPU, memory, GPUs.

Everything here is read from the standard library, /proc and `nvidia-smi`;
a fact that cannot be read is None rather than an error.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

NVIDIA_SMI_TIMEOUT_S = 10.0


def python_facts() -> dict:
    """The running interpreter: full version, minor version, implementation, executable."""
    info = sys.version_info
    return {
        "version": f"{info.major}.{info.minor}.{info.micro}",
        "minor": f"{info.major}.{info.minor}",
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def platform_facts() -> dict:
    """The OS: system, kernel release, machine architecture and glibc version (None off glibc)."""
    libc, libc_version = platform.libc_ver()
    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "glibc": libc_version if libc == "glibc" and libc_version else None,
    }


def _cpuinfo() -> list[dict[str, str]]:
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return []
    blocks: list[dict[str, str]] = [{}]
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            blocks.append({})
            continue
        key, _, value = line.partition(":")
        blocks[-1][key.strip()] = value.strip()
    return [b for b in blocks if b]


def cpu_facts() -> dict:
    """CPU model name, logical cores, physical cores (None when unknown) and usable cores."""
    blocks = _cpuinfo()
    model = next((b["model name"] for b in blocks if "model name" in b), None) or platform.processor() or None
    cores = {(b.get("physical id"), b.get("core id")) for b in blocks if "core id" in b}
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model,
        "logical_cores": os.cpu_count(),
        "physical_cores": len(cores) or None,
        "usable_cores": usable,
    }


def memory_facts() -> dict:
    """Total and available memory in bytes (available is None where /proc/meminfo is absent)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        values = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024  # /proc/meminfo counts kB
        return {"total_bytes": values.get("MemTotal"), "available_bytes": values.get("MemAvailable")}
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    return {"total_bytes": total, "available_bytes": None}


def hostname() -> str:
    """This host's name."""
    return socket.gethostname()


def nvidia_gpus() -> dict:
    """GPUs as `nvidia-smi` lists them: ``{"count", "names", "driver"}``; count 0 without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    empty = {"count": 0, "names": [], "driver": None, "source": "nvidia-smi not found"}
    if exe is None:
        return empty
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return {**empty, "source": f"nvidia-smi failed: {err}"}
    if out.returncode != 0:
        return {**empty, "source": f"nvidia-smi exited {out.returncode}"}
    rows = [line.split(",") for line in out.stdout.splitlines() if line.strip()]
    names = [r[0].strip() for r in rows]
    driver = rows[0][1].strip() if rows and len(rows[0]) > 1 else None
    return {"count": len(names), "names": names, "driver": driver, "source": "nvidia-smi"}
