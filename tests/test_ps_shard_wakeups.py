"""Waiting pulls are woken by the event that can make them ready, not by every push.

A real `ShardState` (no network needed: waking is decided behind the shard's lock) with real
threads blocked in `pull`; wake-ups are counted by the shard itself (``status()["pull_wakeups"]``),
never inferred from timing.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hybridfleet.codec import get_codec
from hybridfleet.ps.server.shard import ShardState
from tests.ps_helpers import PARAMS, initial_values, job_spec, raw

NONE = get_codec("none")
WORKERS = [f"a-{i}" for i in range(4)]


def _shard() -> ShardState:
    spec = job_spec(sites={"a": {"workers": 4}}, heartbeat_timeout_s=1e9).ps
    state = ShardState(0, spec, sites={"a": 4})
    for w in WORKERS:
        state.join(w, "a", PARAMS, 1, spec.block_size_bytes, "none")
    state.push("a-0", "a", "INIT", 0, 0, "none", raw(initial_values()))
    return state


def _grad(state: ShardState, value: float) -> dict[str, bytes]:
    return {k: NONE.encode(np.full(state.params[k].size, value, np.float32)) for k in state.keys}


class _Puller(threading.Thread):
    """One worker's pull waiting for ``version``; keeps what the shard answered."""

    def __init__(self, state: ShardState, worker: str, version: int):
        super().__init__(daemon=True)
        self.state, self.worker, self.version = state, worker, version
        self.answer: int | None = None

    def run(self) -> None:
        self.answer, _ = self.state.pull(self.worker, self.version - 1, self.version, 0, 30.0)


def _until_waiting(state: ShardState, n: int) -> None:
    """Return once ``n`` pulls are registered as waiting (polls the shard's status, no timing asserted)."""
    deadline = time.monotonic() + 20
    while state.status()["pull_waiters"] != n:
        assert time.monotonic() < deadline, f"pull_waiters stayed {state.status()['pull_waiters']}, expected {n}"
        time.sleep(0.005)


def test_pushes_that_do_not_finish_a_round_wake_no_puller_and_the_round_wakes_each_once():
    # Prepare: a 4-worker bsp shard; a-3 already waits for version 2 (not the next round)
    state = _shard()
    later = _Puller(state, "a-3", 2)
    later.start()
    _until_waiting(state, 1)
    pullers = []
    # Execute: three of four workers push round 0, each then waits for version 1
    for i, w in enumerate(WORKERS[:3]):
        state.push(w, "a", "GRADIENT", 1, 0, "none", _grad(state, 1.0))
        pullers.append(_Puller(state, w, 1))
        pullers[-1].start()
        _until_waiting(state, 2 + i)
    # Assert: none of those pushes woke anyone
    assert state.status()["pull_wakeups"] == 0
    # Execute: the last push finishes round 0
    state.push("a-3", "a", "GRADIENT", 1, 0, "none", _grad(state, 1.0))
    for p in pullers:
        p.join(10)
    # Assert: each waiter of version 1 woke exactly once and got it; the one waiting for 2 slept on
    assert [p.answer for p in pullers] == [1, 1, 1]
    status = state.status()
    assert status["pull_wakeups"] == 3 and status["pull_waiters"] == 1 and later.is_alive()
    # Execute: round 1 closes too; Assert: it wakes the one waiting for version 2 (no thread outlives the test)
    for w in WORKERS:
        state.push(w, "a", "GRADIENT", 2, 1, "none", _grad(state, 1.0))
    later.join(10)
    assert later.answer == 2 and state.status()["pull_wakeups"] == 4


def test_a_departure_that_closes_the_round_releases_its_waiters():
    # Prepare: round 0 closed; round 1 pushed by three workers, a-3 waiting for version 2
    state = _shard()
    for w in WORKERS:
        state.push(w, "a", "GRADIENT", 1, 0, "none", _grad(state, 1.0))
    waiter = _Puller(state, "a-0", 2)
    waiter.start()
    for w in WORKERS[:3]:
        state.push(w, "a", "GRADIENT", 2, 1, "none", _grad(state, 0.5))
    _until_waiting(state, 1)
    assert state.status()["pull_wakeups"] == 0
    # Execute: the fourth worker leaves instead of pushing
    state.leave("a-3")
    waiter.join(10)
    # Assert: the round closed without it and its waiter was woken once, with version 2
    assert waiter.answer == 2 and state.version == 2
    assert state.status()["pull_wakeups"] == 1 and state.status()["pull_waiters"] == 0
