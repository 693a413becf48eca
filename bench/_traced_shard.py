"""One shard as `hfleet ps serve` starts it, plus a control line on stdin for bench/shard_memory.py.

Arguments: JOB SHARD PORT_FILE CERTS EXPECTED_WORKERS TRACE_FRAMES (0: no tracemalloc). Each stdin
line ``PATH`` (or empty) is answered by one JSON line on stdout: the process's memory (/proc RSS,
smaps_rollup, glibc's mallinfo2: bytes in use and free in its heap), its threads, the shard's live
members and bulk connections, and, with tracing on, the traced Python bytes (the snapshot is
dumped to PATH when one is given).
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import tracemalloc
from pathlib import Path


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo() -> dict:
    """glibc's heap: ``in_use`` (allocated, arena + mmapped) and ``free`` (held, not returned)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"in_use": m.uordblks + m.hblkhd, "free": m.fordblks, "arena": m.arena, "mmapped": m.hblkhd}


def proc_memory() -> dict:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        out[name.strip()] = int(value.split()[0])
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "Threads:")):
            name, value = line.split(":", 1)
            out[name] = int(value.split()[0])
    return out


def main() -> None:
    job, shard, port_file, certs, expected, frames = sys.argv[1:7]
    if int(frames):
        tracemalloc.start(int(frames))
    from hybridfleet.ps.alloc import SHARD_MALLOC_ARENAS, tune_allocator
    from hybridfleet.ps.server.serve import server_security, start_shard
    from hybridfleet.spec import load_spec

    tune_allocator(arenas=SHARD_MALLOC_ARENAS)  # as `hfleet ps serve` does
    spec = load_spec(job)
    server = start_shard(spec, int(shard), "127.0.0.1", 0, server_security(spec, certs), int(expected))
    Path(port_file).write_text(f"127.0.0.1:{server.port}\n")
    for line in sys.stdin:
        gc.collect()
        out = {"proc": proc_memory(), "malloc": mallinfo(), "live": len(server.state.live_members()),
               "bulk_authenticated": getattr(server.bulk, "_authenticated", None),
               "bulk_port": server.bulk.port if server.bulk is not None else None}
        if tracemalloc.is_tracing():
            out["traced"] = tracemalloc.get_traced_memory()[0]
            if line.strip():
                tracemalloc.take_snapshot().dump(line.strip())
        print(json.dumps(out), flush=True)
    server.stop(0)


if __name__ == "__main__":
    main()
