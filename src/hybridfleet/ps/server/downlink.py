"""What a shard sends back: pulls that wait per the consistency mode, values or encoded deltas.

Methods of `hybridfleet.ps.server.shard.ShardState` (mixed in). With a compressed
downlink (codec != none) workers hold ``broadcast``; each applied version encodes
``params - broadcast`` once into the delta log, shared by every puller.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from hybridfleet.ps.server.limits import PULL_WAIT_CEILING_S, delta_log_bound
from hybridfleet.ps.server.refs import held_elsewhere
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.buffers import DTYPE
from hybridfleet.ps.wire.protocol import CHUNK_BYTES
from hybridfleet.ps.wire.reject import Reject
from hybridfleet.ps.wire.sharding import matrix_rows



class Downlink:
    """Pull and the compressed downlink's delta log of one shard."""

    @property
    def delta_log_bound_bytes(self) -> int:
        """The most bytes the compressed downlink's delta log holds (what it holds counts against
        the shard's memory budget; 0 without a compressed downlink or before the plan is fixed)."""
        if not self.compress_down or self.plan is None:
            return 0
        return delta_log_bound(self.slice_bytes, self.spec.memory_budget_bytes)

    def _encode_deltas(self, keys: list[str]) -> None:
        """Encode this version's change of ``keys`` once into the delta log, dropping the oldest
        versions while the log holds more than its bound."""
        job_codec, dense = self.codec(), buffers.dense_codec()
        deltas, sizes = {}, {}
        for key in keys:
            codec = dense if buffers.is_buffer(key) else job_codec
            if getattr(codec, "warm_start", False):  # powersgd: the block in its parameter's rows, Q warm-started
                payload, self._down_q[key] = codec.encode_warm(self.params[key] - self.broadcast[key],
                                                               self._down_q.get(key),
                                                               rows=matrix_rows(self.plan, key))
            else:
                payload = codec.encode(self.params[key] - self.broadcast[key])
            self.broadcast[key] += codec.decode(payload)
            deltas[key], sizes[key] = _pieces(payload), len(payload)
            self.downlink_dense_bytes += self.params[key].nbytes
            self.downlink_encoded_bytes += len(payload)
        self.delta_log.append((self.version, deltas, sizes))
        self.delta_log_bytes += sum(sizes.values())
        bound = self.delta_log_bound_bytes
        while self.delta_log and self.delta_log_bytes > bound:
            self.delta_log_bytes -= sum(self.delta_log.popleft()[2].values())

    # -------------------------------------------------------------------- pull
    def pull(self, worker_id: str, since_version: int, wait_for_version: int, worker_clock: int,
             timeout_s: float, init_digest: str = "") -> tuple[int, list[tuple[str, list[memoryview], int, int]]]:
        """Wait per the consistency mode, then return ``(version, [(key, chunks, total_bytes, delta_version)])``:
        values (delta_version 0) of the keys changed since ``since_version``, or, with a compressed
        downlink, the encoded deltas of each later version in order.

        A waiting pull sleeps on its own condition, registered under what it waits for (the
        initial values, a version, or in ssp the other workers' clocks); only the event that
        can make it ready wakes it (counted in ``status()["pull_wakeups"]``), so a push that
        does not finish a round wakes no puller."""
        deadline = self._now() + min(max(0.0, timeout_s), PULL_WAIT_CEILING_S)
        with self.cond:
            self._member(worker_id)
            while (blocked := self._pull_blocked(worker_id, wait_for_version, worker_clock)) is not None:
                if self.secagg is not None and self.secagg.failed:
                    raise Reject("ABORTED", self.secagg.failed)
                left = deadline - self._now()
                if left <= 0:
                    raise Reject("DEADLINE_EXCEEDED", self._wait_reason(worker_id, wait_for_version, worker_clock))
                waiter = threading.Condition(self._lock)
                waiting = self._pull_waiters.setdefault(blocked, set())
                waiting.add(waiter)
                try:
                    waiter.wait(min(left, 0.5))  # the timeout also closes a round only waiting for the clock
                finally:
                    waiting.discard(waiter)
                    if not waiting and self._pull_waiters.get(blocked) is waiting:
                        del self._pull_waiters[blocked]
                self._maybe_finish_rounds()
            return self._pull_answer(worker_id, since_version, init_digest)

    def pull_now(self, worker_id: str, since_version: int, wait_for_version: int, worker_clock: int,
                 init_digest: str = "", waiter: Any = None, expired: bool = False
                 ) -> tuple[int, list[tuple[str, list[memoryview], int, int]]] | None:
        """`pull`'s answer when it is ready now; else None after registering ``waiter`` (no thread
        waits): its ``notify()`` is called once, under the shard's lock, by the event that can make
        the pull ready (it must not block; the caller then asks again). With ``expired`` the pull's
        time is up: Reject DEADLINE_EXCEEDED with the reason instead of registering.
        A waiter that is given up on is removed with `unpark`."""
        with self.cond:
            self._member(worker_id)
            blocked = self._pull_blocked(worker_id, wait_for_version, worker_clock)
            if blocked is None:
                return self._pull_answer(worker_id, since_version, init_digest)
            if self.secagg is not None and self.secagg.failed:
                raise Reject("ABORTED", self.secagg.failed)
            if expired or waiter is None:
                raise Reject("DEADLINE_EXCEEDED", self._wait_reason(worker_id, wait_for_version, worker_clock))
            waiter.blocked = blocked
            self._pull_waiters.setdefault(blocked, set()).add(waiter)
            return None

    def unpark(self, waiter: Any) -> None:
        """Forget ``waiter`` registered by `pull_now` (no-op once it was notified)."""
        with self.cond:
            what = getattr(waiter, "blocked", None)
            waiting = self._pull_waiters.get(what)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._pull_waiters[what]

    def poll_parked(self) -> None:
        """What a waiting thread of `pull` does every half second, once for all parked pulls: close a
        round only waiting for the clock (late joiners) and wake the pulls waiting for ssp clocks."""
        with self.cond:
            if not self._pull_waiters:
                return
            self._maybe_finish_rounds()
            if "clock" in self._pull_waiters:
                self._wake_pullers("clock")

    def _pull_answer(self, worker_id: str, since_version: int, init_digest: str
                     ) -> tuple[int, list[tuple[str, list[memoryview], int, int]]]:
        """The answer of a pull that is ready (called under the shard's lock)."""
        if since_version < 0 and init_digest and init_digest == self.init_digest:
            since_version = 0  # the caller holds the initial values already
        if self.compress_down:
            return self.version, self._pull_compressed(since_version)
        answer = self.version, self._changed_since(since_version)
        if self.in_rounds:
            self._answered(worker_id)
        return answer

    def _answered(self, worker_id: str) -> None:
        """In round modes, once every live worker has been answered at this version the shard lets
        go of its wire copies: none is asked for again before the next round closes (a late or
        repeated pull makes one anew), so the push buffers of that round do not sit beside a
        copy of the slice. Each copy is freed when the last send still using it ends."""
        if self._pulled[0] != self.version:
            self._pulled = (self.version, set())
        self._pulled[1].add(worker_id)
        if self._wire_cache and self.live_members() <= self._pulled[1]:
            self._drop_wire_copies(list(self._wire_cache))

    def _changed_since(self, since_version: int) -> list[tuple[str, list[memoryview], int, int]]:
        """The values of the keys changed since ``since_version``, worked out once per version and
        caller version (every puller of a bsp round asks the same)."""
        if self._changed_cache[0] != self.version:
            self._changed_cache = (self.version, {})
        out = self._changed_cache[1].get(since_version)
        if out is None:
            out = [(k, self._wire_chunks(k), self.params[k].nbytes, 0)
                   for k in self.keys if self.key_version[k] > since_version]
            self._changed_cache[1][since_version] = out
        return out

    def _pull_blocked(self, worker_id: str, wait_for_version: int, worker_clock: int) -> str | int | None:
        """What a pull waits for: ``"init"``, a version, ``"clock"`` (ssp), or None when it is ready."""
        if not self.is_initialized():
            return "init"
        if wait_for_version >= 0 and self.version < wait_for_version:
            return wait_for_version
        if self.sync == "ssp":
            live = [m.clock for m in self.members.values() if m.alive and m.worker_id != worker_id]
            if live and worker_clock - min(live) > self.spec.staleness_bound:
                return "clock"
        return None

    def _drop_wire_copies(self, keys) -> None:
        """Forget the wire copies of ``keys``, about to change (each is freed once no pull still sends it)."""
        for key in keys:
            self._wire_cache.pop(key, None)
        self._changed_cache = (-1, {})

    def _published(self, changed: list[str]) -> None:
        """A new version is in place: nothing cut for the last one is kept; wake the pulls it makes ready."""
        self._drop_wire_copies(changed)
        self._wake_pullers()

    def _wake_pullers(self, *events: str, every: bool = False) -> None:
        """Wake the pulls waiting for ``events`` (``"init"``, ``"clock"``) and for any version up
        to the shard's (``every``: all waiting pulls); each waiter is woken once and registers
        again if it must wait on."""
        due = [w for w in self._pull_waiters
               if every or w in events or (isinstance(w, int) and w <= self.version)]
        for what in due:
            for waiter in self._pull_waiters.pop(what):
                self.pull_wakeups += 1
                waiter.notify()

    def wake_all_pullers(self) -> None:
        """Wake every waiting pull (e.g. secure aggregation stopped: each is answered with the reason)."""
        with self.cond:
            self._wake_pullers(every=True)

    def _pull_compressed(self, since_version: int) -> list[tuple[str, list[memoryview], int, int]]:
        """Encoded deltas since ``since_version`` in order, except for a key whose pending deltas
        are larger than its values: that key's broadcast values instead (so a pull never moves
        more than the dense bytes); every key's values when the log does not reach back that far
        (a new, rejoining or far-behind worker)."""
        if since_version >= 0 and since_version >= self.version:
            return []
        logged = [entry for entry in self.delta_log if entry[0] > since_version]
        if not (since_version >= 0 and logged and logged[0][0] == since_version + 1):
            return [(k, self._wire_chunks(k), self.broadcast[k].nbytes, 0) for k in self.keys]
        pending: dict[str, int] = {}
        for _, _, sizes in logged:
            for key, nbytes in sizes.items():
                pending[key] = pending.get(key, 0) + nbytes
        dense = {key for key, nbytes in pending.items() if nbytes > self.broadcast[key].nbytes}
        out = [(k, self._wire_chunks(k), self.broadcast[k].nbytes, 0) for k in pending if k in dense]
        out += [(k, pieces, sizes[k], v) for v, deltas, sizes in logged for k, pieces in deltas.items()
                if k not in dense]
        return out

    @property
    def sends_live_values(self) -> bool:
        """Whether pulls are sent from the parameters themselves, with no copy per version: in the
        round modes with a dense downlink, where a version's values stay put while its pullers are
        answered (the next round closes only once every live worker pushed it, so after its pull).
        A round that closes while a send is still reading (its worker left or was declared dead)
        steps a copy instead (`_before_values_change`), and the send goes on from the old values;
        should a send ever find its values changed all the same (`LivePieces.intact`), it drops
        the connection instead of finishing the frame, and the worker pulls again."""
        return self.in_rounds and not self.compress_down

    def _before_values_change(self, keys: list[str]) -> None:
        """Called under the lock before ``params`` of ``keys`` are written in place. The wire
        pieces cut for them are forgotten; where a pull's answer still holds a key's pieces (its
        send has not ended: the pieces are referenced beyond this call), the key gets a copy of
        its values to be written, and the old array, which that send reads, is never written
        again. Otherwise nothing is copied."""
        held = {k: self._wire_cache[k][2] for k in keys
                if k in self._wire_cache and isinstance(self._wire_cache[k][2], LivePieces)}
        self._drop_wire_copies(keys)
        for key in keys:
            self.value_changes[key] = self.value_changes.get(key, 0) + 1
        for key in list(held):
            if held_elsewhere(held, key):
                self.params[key] = self.params[key].copy()
                self.detached_values += 1
            del held[key]

    def _wire_chunks(self, key: str) -> list[memoryview]:
        """The key's current values as wire-sized pieces, made once per version and shared by every
        puller: views of the parameters (`sends_live_values`), else of one copy."""
        return self._wire_copy(key)[1]

    def wire_values(self, key: str) -> np.ndarray:
        """The key's current values (``broadcast`` with a compressed downlink, else ``params``) as a
        read-only array that stays as it is (a snapshot written after the lock is let go): the
        per-version wire copy, shared with pullers; a copy of its own where pulls send the
        parameters themselves."""
        if self.sends_live_values:
            out = self.params[key].copy()
            out.flags.writeable = False
            return out
        return self._wire_copy(key)[0]

    def _wire_copy(self, key: str) -> tuple[np.ndarray, list[memoryview]]:
        cached = self._wire_cache.get(key)
        if cached is not None and cached[0] == self.key_version[key]:
            return cached[1], cached[2]
        if self.sends_live_values:
            whole = self.params[key]
            pieces = LivePieces(_pieces(whole), self, key)
        else:
            # numpy's allocation (transparent huge pages where the kernel offers them), not bytes:
            # a fresh copy's page faults cost several times the copy itself
            whole = (self.broadcast if self.compress_down else self.params)[key].copy()
            whole.flags.writeable = False
            pieces = _pieces(whole)
        self._wire_cache[key] = (self.key_version[key], whole, pieces)
        return whole, pieces

    def _wait_reason(self, worker_id: str, wait_for_version: int, worker_clock: int) -> str:
        if not self.is_initialized():
            return "parameters not initialized yet"
        if self.version < wait_for_version:
            rnd = self.rounds.get(self.version)
            have = sorted(rnd.contributors) if rnd else []
            return f"round {self.version} waits for {sorted(self.live_members() - set(have))}"
        return f"worker {worker_id} at clock {worker_clock} is more than {self.spec.staleness_bound} steps ahead"


def _pieces(data: np.ndarray | bytes) -> list[memoryview]:
    """``data``'s bytes cut into wire-sized pieces without copying (views that keep ``data`` alive)."""
    view = memoryview(data).cast("B")
    return [view[i:i + CHUNK_BYTES] for i in range(0, max(len(view), 1), CHUNK_BYTES)]


class LivePieces(list):
    """Wire pieces that are views of one key's parameters (`Downlink.sends_live_values`), stamped
    with the count of writes into them when they were cut: `intact` says whether nothing has
    written the values since (the key's array was replaced by a copy, or its count has not moved),
    so that every byte read from them before the call belongs to the version the pull names."""

    def __init__(self, pieces: list[memoryview], state, key: str):
        super().__init__(pieces)
        self._state, self._key, self._values = state, key, state.params[key]
        self._stamp = state.value_changes.get(key, 0)

    def origin(self) -> tuple:
        """(the array viewed, its count of writes when these pieces were cut): equal for pieces that
        hold the same bytes while both are `intact`."""
        return self._values, self._stamp

    def intact(self) -> bool:
        return (self._state.params.get(self._key) is not self._values
                or self._state.value_changes.get(self._key, 0) == self._stamp)


class ValuesChanged(ConnectionAbortedError):
    """The parameters a pull was being sent from changed before its last byte went out."""


def send_values(sendall: Callable[[Any], Any], items: list) -> None:
    """Send the pieces of a pull's ``items`` with ``sendall``. Where any are `LivePieces`, the
    frame's last byte is read first and held back until every other byte has been sent and
    the values are found unchanged; else `ValuesChanged` is raised with the frame one byte short,
    so the connection must be closed and the worker, which cannot use a cut frame, pulls again."""
    pieces = [piece for _, chunk, _, _ in items for piece in chunk if len(piece)]
    live = [chunk for _, chunk, _, _ in items if isinstance(chunk, LivePieces)]
    if not live or not pieces:
        for piece in pieces:
            sendall(piece)
        return
    tail = bytes(pieces[-1][-1:])  # read before the check, like every other byte
    pieces[-1] = pieces[-1][:-1]
    for piece in pieces:
        if len(piece):
            sendall(piece)
    if not all(chunk.intact() for chunk in live):
        raise ValuesChanged("the parameters changed while a pull was sent from them (a round closed "
                            "without its worker); the connection is closed, the worker pulls again")
    sendall(tail)
