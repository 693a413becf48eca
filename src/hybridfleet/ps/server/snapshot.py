"""Shard snapshots through the checkpoint module: save every N steps/seconds, restore at start.

A snapshot is an ordinary hybridfleet checkpoint (safetensors + state JSON +
manifest written last) under ``<checkpoint.store>/ps/shard-<i>``: parameters,
the broadcast copy of a compressed downlink, optimizer slots, and a JSON state
with the version, sharding plan and each worker's clock (so replays stay
rejected after a restart). Copies are taken under the shard's lock (memcpy), one of
each thing: the values pullers are sent are shared with them, not copied again;
the write runs in a background thread, at most one in flight.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hybridfleet.errors import CheckpointError
from hybridfleet.obs.log import get_logger
from hybridfleet.obs.metrics import observe_snapshot
from hybridfleet.ps.server.shard import Member, ShardState
from hybridfleet.ps.wire.sharding import ShardingPlan

log = get_logger("ps.snapshot")


def snapshot_url(store: str, shard: int) -> str:
    return f"{store.rstrip('/')}/ps/shard-{shard}"


def capture(state: ShardState) -> tuple[int, dict[str, np.ndarray], dict]:
    """(version, tensors, json state) copied under the shard's lock."""
    with state.cond:
        # one copy of each thing: the values pullers are sent (params, or the broadcast copy of a
        # compressed downlink) are the per-version wire copy, shared; state_dict() is a copy already
        tensors = {f"param/{k}": v.copy() if state.compress_down else state.wire_values(k)
                   for k, v in state.params.items()}
        tensors.update({f"broadcast/{k}": state.wire_values(k) for k in state.broadcast})
        tensors.update({f"opt/{k}": v for k, v in state.optimizer.state_dict().items()})
        if state.script_optimizer is not None:  # the script's optimizer (hybridfleet.ps.server.groups)
            tensors.update({f"script/{k}": v for k, v in state.script_optimizer.state_dict().items()})
        # a push in the open round is not in the snapshot: its worker's clock is kept from before it,
        # so the push is accepted again (not refused as a replay) by a shard restored from here
        open_round = state.rounds.get(state.version) if state.in_rounds else None
        pending = open_round.contributors if open_round is not None else set()
        meta = {
            "shard": state.shard, "version": state.version, "sync": state.sync, "codec": state.codec_name,
            "plan": state.plan.to_json() if state.plan else None, "key_version": dict(state.key_version),
            "initialized": sorted(state.initialized), "applied_pushes": state.applied_pushes,
            "members": {w: {"site": m.site, "clock": m.clock - 1 if w in pending else m.clock}
                        for w, m in state.members.items()},
        }
        return state.version, tensors, meta


def restore(state: ShardState, tensors: dict[str, np.ndarray], meta: dict) -> None:
    """Put a captured snapshot back into a fresh shard state."""
    if meta["shard"] != state.shard:
        raise CheckpointError(f"snapshot is of shard {meta['shard']}, this is shard {state.shard}")
    if meta["codec"] != state.codec_name or meta["sync"] != state.sync:
        raise CheckpointError(f"snapshot was taken with codec {meta['codec']!r}/sync {meta['sync']!r}; "
                              f"the job now says {state.codec_name!r}/{state.sync!r}")
    with state.cond:
        state.plan = ShardingPlan.from_json(meta["plan"]) if meta["plan"] else None
        state.params = {k[len("param/"):]: v.astype(np.float32, copy=True)
                        for k, v in tensors.items() if k.startswith("param/")}
        state.broadcast = {k[len("broadcast/"):]: v.astype(np.float32, copy=True)
                           for k, v in tensors.items() if k.startswith("broadcast/")}
        state.optimizer.load_state_dict({k[len("opt/"):]: v for k, v in tensors.items() if k.startswith("opt/")})
        script = {k[len("script/"):]: v for k, v in tensors.items() if k.startswith("script/")}
        if script:
            state.script_optimizer = state.new_script_optimizer()
            try:
                state.script_optimizer.load_state_dict(script)
            except ValueError as err:
                raise CheckpointError(f"snapshot's script optimizer state: {err}") from None
        state.version = int(meta["version"])
        state.key_version = {k: int(v) for k, v in meta["key_version"].items()}
        state.initialized = set(meta["initialized"])
        state.applied_pushes = int(meta["applied_pushes"])
        state._wire_cache.clear()
        state._changed_cache = (-1, {})
        now = state._now()
        state.members = {w: Member(w, m["site"], now, clock=int(m["clock"])) for w, m in meta["members"].items()}
        state._first_join = now


class Snapshotter:
    """Saves a shard every ``every_steps`` versions and/or ``every_s`` seconds, keeping ``keep_last``.

    Step snapshots are taken at every multiple of ``every_steps``: the shard calls back
    right after applying a version and the copy is made then, under the shard's lock;
    a background thread writes it. When writing falls behind, the newest capture wins.
    """

    def __init__(self, state: ShardState, url: str, every_steps: int | None, every_s: float | None,
                 keep_last: int = 3):
        self.state, self.url = state, url
        self.every_steps, self.every_s, self.keep_last = every_steps, every_s, keep_last
        self._last_version = state.version
        self._last_time = time.monotonic()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pending: tuple[int, dict, dict] | None = None
        self._replaced: tuple[int, dict, dict] | None = None  # the newest capture a newer one replaced
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ps-snapshot")
        self.saved: list[int] = []

    def start(self) -> "Snapshotter":
        if self.every_steps:
            self.state.on_applied = self._on_applied
        self._thread.start()
        return self

    def _on_applied(self) -> None:
        """Called by the shard, holding its lock, after each applied version."""
        if self.state.version % self.every_steps == 0:
            captured = capture(self.state)
            with self._pending_lock:
                if self._replaced is not None and self._replaced[0] < captured[0] - 1:
                    self._replaced = None  # kept only while it is the version before the newest
                if self._pending is not None:
                    log.warning("snapshot_skipped", shard=self.state.shard, version=self._pending[0],
                                reason=f"writing fell behind; version {captured[0]} replaces it")
                    self._replaced = self._pending  # a final snapshot (hand-over) writes it after all
                self._pending = captured
            self._wake.set()

    def restore_newest(self) -> int | None:
        """Load the newest valid snapshot into the shard; returns its version, or None if there is none."""
        from hybridfleet.ckpt import load_tensors_checkpoint

        try:
            step, tensors, meta = load_tensors_checkpoint(self.url)
        except (CheckpointError, FileNotFoundError) as err:
            log.info("no_snapshot", url=self.url, reason=str(err).splitlines()[0][:200])
            return None
        restore(self.state, tensors, meta)
        self._last_version = self.state.version
        log.info("snapshot_restored", shard=self.state.shard, version=step, url=self.url)
        return step

    def _due(self) -> bool:
        version = self.state.version
        if version == self._last_version or not self.state.is_initialized():
            return False
        return bool(self.every_s and time.monotonic() - self._last_time >= self.every_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.05)
            self._wake.clear()
            with self._pending_lock:
                pending, self._pending = self._pending, None
            if pending is not None:
                self.save(pending)
            elif self._due():
                self.save()

    def save(self, captured: tuple[int, dict, dict] | None = None) -> int:
        """Write one snapshot (``captured`` by `capture`, or captured now); called from the snapshot thread."""
        from hybridfleet.ckpt import gc, save_tensors_checkpoint

        version, tensors, meta = captured if captured is not None else capture(self.state)
        t0 = time.monotonic()
        save_tensors_checkpoint(self.url, version, tensors, meta)
        self._last_version, self._last_time = version, time.monotonic()
        observe_snapshot(self._last_time - t0, sum(t.nbytes for t in tensors.values()))
        self.saved.append(version)
        log.info("snapshot_saved", shard=self.state.shard, version=version, seconds=round(time.monotonic() - t0, 3))
        try:
            gc(self.url, keep_last=self.keep_last)
        except Exception as err:  # retention must never stop training; the next save retries
            log.warning("snapshot_gc_failed", error=str(err))
        return version

    def stop(self, final: bool = False) -> None:
        """Stop taking snapshots. ``final`` (the shard no longer answers): then write one of the
        version the shard holds now unless the newest written is of it already."""
        if self.state.on_applied == self._on_applied:
            self.state.on_applied = None
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5 if not final else 60)
        if not final or self.state.plan is None:
            return
        # the version held now and the one before it (a hand-over re-cuts at the newest version every
        # shard holds, and a BSP shard may be one round ahead of another): each written once
        with self._pending_lock:
            kept = [c for c in (self._replaced, self._pending) if c is not None]
            self._replaced = self._pending = None
        kept.append(capture(self.state))
        wanted = {self.state.version - 1, self.state.version}
        for captured in sorted({c[0]: c for c in kept if c[0] in wanted}.values(), key=lambda c: c[0]):
            if captured[0] not in self.saved:
                self.save(captured)
