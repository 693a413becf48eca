"""The collective smoke test: two real processes all-reduce one value on this machine.

torch joins with ``torch.distributed`` (env:// rendezvous on 127.0.0.1); paddle
with ``paddle.distributed.init_parallel_env`` driven by the PADDLE_* variables
that ``paddle.distributed.launch`` would set (PADDLE_DISTRI_BACKEND=gloo on CPU).
Both are bounded by one deadline; past it every rank is killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from hybridfleet.env.collective_worker import MARKER
from hybridfleet.env.probe import child_env, known_framework, last_lines
from hybridfleet.errors import CollectiveSmokeError
from hybridfleet.launch.preflight import free_port
from hybridfleet.obs.log import get_logger

log = get_logger("env.smoke")

WORLD_SIZE = 2
SMOKE_TIMEOUT_S = 60.0


def choose_backend(facts: dict[str, Any]) -> str:
    """NCCL when the framework has it and sees a GPU per rank; gloo otherwise."""
    if facts.get("backends", {}).get("nccl") and len(facts.get("devices", [])) >= WORLD_SIZE:
        return "nccl"
    return "gloo"


def _rank_env(framework: str, backend: str, rank: int, ports: list[int], timeout_s: float) -> dict[str, str]:
    env = child_env()
    env["HFLEET_SMOKE_TIMEOUT_S"] = str(timeout_s)
    if framework == "torch":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    else:
        endpoints = [f"127.0.0.1:{p}" for p in ports]
        env.update(
            PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
            PADDLE_CURRENT_ENDPOINT=endpoints[rank],
            PADDLE_MASTER=endpoints[0],
            PADDLE_TRAINER_ID=str(rank),
            PADDLE_TRAINERS_NUM=str(WORLD_SIZE),
            PADDLE_DISTRI_BACKEND=backend,
        )
        if backend == "nccl":
            env["FLAGS_selected_gpus"] = str(rank)
    return env


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_smoke(framework: str, backend: str = "gloo", timeout_s: float = SMOKE_TIMEOUT_S) -> dict[str, Any]:
    """Run the 2-process all-reduce; return ``{"backend", "world_size", "value", "duration_s"}``.

    Each rank contributes rank + 1, so every rank must see 3.0. Raises
    CollectiveSmokeError naming the framework, backend and cause (a rank's exit
    code and last stderr lines, a wrong value, or the timeout).
    """
    known_framework(framework)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
    what = f"{framework} all-reduce smoke test ({backend}, {WORLD_SIZE} processes)"
    ports = [free_port() for _ in range(WORLD_SIZE)]
    start = time.monotonic()
    deadline = start + timeout_s
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hybridfleet.env.collective_worker", framework, backend],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_rank_env(framework, backend, rank, ports, timeout_s),
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 0.001)))
    except subprocess.TimeoutExpired:
        _kill_all(procs)
        log.error("smoke_timeout", framework=framework, backend=backend, timeout_s=timeout_s)
        raise CollectiveSmokeError(f"{what} timed out after {timeout_s:g} s; every rank was killed") from None
    finally:
        _kill_all(procs)
    expected = float(sum(range(1, WORLD_SIZE + 1)))
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise CollectiveSmokeError(f"{what}: rank {rank} exited {proc.returncode}: {last_lines(err)}")
        results = [json.loads(line[len(MARKER):]) for line in out.splitlines() if line.startswith(MARKER)]
        if not results or results[0]["value"] != expected:
            got = results[0]["value"] if results else "no result"
            raise CollectiveSmokeError(f"{what}: rank {rank} reduced to {got}, expected {expected}")
    duration_s = round(time.monotonic() - start, 3)
    log.info("smoke_passed", framework=framework, backend=backend, duration_s=duration_s)
    return {"backend": backend, "world_size": WORLD_SIZE, "value": expected, "duration_s": duration_s}
