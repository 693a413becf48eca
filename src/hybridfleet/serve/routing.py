"""Which version answers a request: the registry alias's stable version, or its canary by weight.

`Rollout` reads the alias state (stable, canary, weight) from the registry's alias
history, loads the verified artefact of every version it names, and only then makes the
new state current: a request always finds its version loaded, so a rollout, promotion or
rollback changes traffic without a failed request and without a restart. A refresh that
fails (registry unreachable, a canary without an export) keeps the previous state and is
counted.

A request with a routing key goes where the registry's own `resolve` sends that key
(the same bucket function: sticky while the weight only grows); a request without one
goes to the canary with probability weight/100.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hybridfleet.errors import RegistryNotFoundError, UsageError
from hybridfleet.obs.log import get_logger
from hybridfleet.registry.aliases import BUCKETS, bucket
from hybridfleet.registry.refs import parse_ref
from hybridfleet.serve.export import fetch_export
from hybridfleet.serve.runtime import Runtime, load_runtime

log = get_logger("serve.routing")


@dataclass(frozen=True)
class RolloutState:
    """One alias state and the runtime of each version it names."""

    stable: int
    canary: int | None
    weight: float  # percent of traffic on the canary
    revision: int
    runtimes: dict[int, Runtime]

    def pick(self, full_name: str, alias: str, key: str | None, rng: random.Random) -> int:
        """The version that answers a request with routing ``key`` (None: a weighted random draw)."""
        if self.canary is None or self.weight <= 0:
            return self.stable
        if key is not None:
            return self.canary if bucket(full_name, alias, key) < round(self.weight * 100) else self.stable
        return self.canary if rng.random() * BUCKETS < round(self.weight * 100) else self.stable


def alias_state(reg: Any, full_name: str, alias: str) -> tuple[int, int | None, float, int]:
    """(stable, canary, weight, revision) of an alias, from the newest entry of its history."""
    events = reg.history(full_name, alias)
    if not events:
        raise RegistryNotFoundError(f"model {full_name} has no alias {alias!r}")
    last = events[-1]
    return int(last["to_version"]), last["canary_version"], float(last["canary_weight"] or 0.0), int(last["revision"])


class Rollout:
    """The live routing of ``ref`` (NAME@ALIAS, or NAME@VERSION: one fixed version), refreshed every ``poll_s``."""

    def __init__(self, reg: Any, ref: str, fmt: str, cache_dir: str | Path, poll_s: float = 2.0, threads: int = 1,
                 loader: Callable[[Path], Runtime] | None = None, on_refresh_error: Callable[[Exception], None] | None = None):  # fmt: skip
        parsed = parse_ref(ref)
        self.reg, self.fmt, self.cache_dir, self.poll_s = reg, fmt, Path(cache_dir), poll_s
        self.full_name, self.alias, self.fixed_version = parsed.full_name, parsed.alias, parsed.version
        self.model_name = parsed.name
        self._load = loader or (lambda path: load_runtime(path, threads))
        self._on_error = on_refresh_error or (lambda err: None)
        self._rng = random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.state = self._read_state(None)  # the first state must load: a server never starts without a model

    def _read_state(self, current: RolloutState | None) -> RolloutState:
        if self.alias is None:
            number = self.fixed_version or self.reg.get_version(self.full_name).version
            stable, canary, weight, revision = number, None, 0.0, 0
        else:
            stable, canary, weight, revision = alias_state(self.reg, self.full_name, self.alias)
        if current is not None and (current.stable, current.canary, current.weight) == (stable, canary, weight):
            return current
        runtimes = {}
        for number in {stable, canary} - {None}:
            if current is not None and number in current.runtimes:
                runtimes[number] = current.runtimes[number]
            else:
                path, _ = fetch_export(self.reg, f"{self.full_name}@{number}", self.fmt, self.cache_dir)
                runtimes[number] = self._load(path)
        return RolloutState(stable, canary, weight, revision, runtimes)

    def refresh(self) -> bool:
        """Re-read the alias; True when the state changed. A failure keeps the current state."""
        try:
            new = self._read_state(self.state)
        except Exception as err:  # noqa: BLE001 - the server keeps answering on the state it has
            log.warning("rollout_refresh_failed", model=self.full_name, alias=self.alias, error=str(err))
            self._on_error(err)
            return False
        changed = new is not self.state
        if changed:
            log.info("rollout_changed", model=self.full_name, alias=self.alias, stable=new.stable, canary=new.canary,
                     weight=new.weight)  # fmt: skip
        self.state = new
        return changed

    def route(self, key: str | None, state: RolloutState | None = None) -> tuple[int, Runtime]:
        """(version, runtime) for one request, from ``state`` (default: the current one)."""
        state = state or self.state  # one read: the pick and the runtime come from the same state
        version = state.pick(self.full_name, self.alias or "", key, self._rng)
        return version, state.runtimes[version]

    def start(self) -> None:
        """Refresh every ``poll_s`` in a daemon thread until `stop`."""
        if self.alias is None or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.poll_s):
                self.refresh()

        self._thread = threading.Thread(target=loop, name="hfleet-serve-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def poll_interval_ok(poll_s: float) -> float:
    """``poll_s`` if usable (0.05 .. 3600 s)."""
    if not 0.05 <= poll_s <= 3600:
        raise UsageError(f"--poll-s must be between 0.05 and 3600 seconds (got {poll_s})")
    return poll_s


