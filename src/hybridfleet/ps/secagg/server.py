"""The shard's side of secure aggregation: keys, roster, shares, masked sums and unmasking.

Each shard runs the protocol for its own keys, on its own; it holds no secret of any
pusher. One round (the shard's BSP round, i.e. its version):

1. every pusher in the roster sends its encrypted shares (`shares`), one per neighbour
   in the roster's graph (`graph.neighbours`; every other pusher when it is complete),
   then its masked ring vector through the ordinary Push (summed mod 2^bits by
   `MaskedRound`);
2. when every live roster member pushed (after heartbeat reaping), the round's
   survivors U1 and dropped D are fixed; each survivor fetches the shares addressed to
   it by its surviving neighbours (`unmask_request`) and answers (`reveal`) with shares
   of their self-mask seeds (and its own) and its pair seeds with its dropped neighbours;
3. from >= t answers among each survivor's share holders the shard rebuilds the self
   seeds, removes every remaining mask, dequantises and hands the mean to the optimizer:
   O(n k) masks and shares for n pushers of degree k. A pusher that dropped leaves the
   roster; it comes back only with a fresh key.

All methods run under the shard's lock (``state.cond``) and raise `Reject` without
changing anything when a request is refused; the unmasking itself (Shamir rebuilds and
mask expansions, the round's heavy work) runs in its own thread without the lock, so
pulls, heartbeats and other shards' calls go on meanwhile.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.aggregate.base import RoundAggregator
from hybridfleet.ps.secagg import graph, shamir
from hybridfleet.ps.secagg.keys import NONCE_BYTES, PUBLIC_KEY_BYTES, TAG_BYTES
from hybridfleet.ps.secagg.masks import add_mask
from hybridfleet.ps.secagg.ring import RING_DTYPES, dequantise
from hybridfleet.ps.secagg.settings import SecAggSettings
from hybridfleet.ps.server.limits import PULL_WAIT_CEILING_S
from hybridfleet.ps.wire.reject import Reject

log = get_logger("ps.secagg")

CIPHERTEXT_BYTES = NONCE_BYTES + shamir.SHARE_BYTES + TAG_BYTES
SEED_BYTES = 32


def kept_indices(key: str, rnd: int, numel: int, ratio: float) -> np.ndarray:
    """Shared-seed random-k: the coordinates every pusher keeps of ``key`` in round ``rnd`` (sorted)."""
    k = min(numel, max(1, math.ceil(ratio * numel)))
    if k == numel:
        return np.arange(numel, dtype=np.int64)
    seed = int.from_bytes(hashlib.sha256(f"hfleet-secagg-randomk|{key}|{rnd}".encode()).digest()[:16], "big")
    chosen = np.random.Generator(np.random.PCG64(seed)).choice(numel, size=k, replace=False)
    chosen.sort()
    return chosen


class MaskedRound(RoundAggregator):
    """The running ring sum of one round's masked vectors (each one alone is uniform noise)."""

    def __init__(self, bits: int) -> None:
        super().__init__()
        self.dtype = RING_DTYPES[bits][0]
        self.total: np.ndarray | None = None

    def _add(self, update: dict[str, np.ndarray], weight: int) -> None:
        vector = update["ring"]
        if self.total is None:
            self.total = vector.astype(self.dtype, copy=True)
        else:
            np.add(self.total, vector, out=self.total)  # unsigned: wraps mod 2^bits

    def result(self) -> dict[str, np.ndarray]:
        raise RuntimeError("a masked round is finished by SecAggServer.finish, not read directly")


@dataclass
class SecRound:
    roster: tuple[str, ...]
    epoch: int
    threshold: int
    neighbours: dict[str, tuple[str, ...]]
    shares: dict[str, dict[str, bytes]] = field(default_factory=dict)   # sender -> recipient -> ciphertext
    survivors: tuple[str, ...] | None = None
    dropped: tuple[str, ...] = ()
    reveals: dict[str, tuple[dict[str, bytes], dict[str, bytes]]] = field(default_factory=dict)
    unmasking: bool = False                      # the unmask thread runs
    update: dict[str, np.ndarray] | None = None  # its result, for the locked close of the round
    silent: tuple[str, ...] = ()                 # survivors that pushed and never answered

    def __post_init__(self) -> None:
        self._x = {w: i + 1 for i, w in enumerate(self.roster)}

    def x_of(self, worker: str) -> int:
        """``worker``'s Shamir share point: its place in the round's roster, from 1."""
        return self._x[worker]

    def holders(self, worker: str) -> tuple[str, ...]:
        """Who holds a share of ``worker``'s self seed: itself and its neighbours (sorted)."""
        return tuple(sorted((worker, *self.neighbours[worker])))


class SecAggServer:
    """One shard's secure-aggregation state; ``state`` is its `ShardState` (lock, members, version)."""

    def __init__(self, state, settings: SecAggSettings) -> None:
        self.state = state
        self.settings = settings
        self.dtype = RING_DTYPES[settings.bits][0]
        self.keys: dict[str, bytes] = {}            # advertised keys, roster members' and pending ones
        self.key_join: dict[str, int] = {}          # the member's join count when it advertised
        self.roster: dict[str, bytes] = {}
        self.graph: dict[str, tuple[str, ...]] = {}  # the roster's neighbour graph
        self.epoch = 0                              # 0: no roster published yet
        self.rounds: dict[int, SecRound] = {}
        # the unmask requests' own condition on the shard's lock: a push wakes none of them, the
        # round's survivors being fixed (or the protocol failing) wakes each once
        self._unmask_open = threading.Condition(state._lock)
        self.failed: str | None = None
        self.last_unmask: dict | None = None        # what the shard learnt in the last unmasked round
        self.unmasked_rounds = 0
        self.dropped_pushers = 0                    # pushers unmasked out of a round (dropped before pushing)

    # ------------------------------------------------------------- helpers
    def _fail_check(self) -> None:
        if self.failed:
            raise Reject("ABORTED", self.failed)

    def _fail(self, message: str) -> None:
        if not self.failed:
            self.failed = f"secure aggregation stopped at shard {self.state.shard}: {message}"
            log.error("secagg_failed", shard=self.state.shard, reason=self.failed)
        self.state.cond.notify_all()
        self._unmask_open.notify_all()
        self.state.wake_all_pullers()

    def _caller(self, worker_id: str):
        member = self.state.members.get(worker_id)
        if member is None:
            raise Reject("FAILED_PRECONDITION", f"worker {worker_id!r} has not joined this shard; call Join first")
        return member

    def _round_open(self) -> bool:
        rnd = self.rounds.get(self.state.version)
        return rnd is not None

    def threshold(self, roster_size: int) -> int:
        return self.settings.threshold_for(roster_size)

    # -------------------------------------------------------------- keys
    def advertise(self, worker_id: str, public_key: bytes) -> int:
        """Record ``worker_id``'s public key (the caller's authenticated identity); returns the epoch."""
        self._fail_check()
        member = self._caller(worker_id)
        if worker_id not in self.settings.pushers:
            raise Reject("PERMISSION_DENIED", f"worker {worker_id} does not push to the shards (pushers: "
                                              f"{', '.join(self.settings.pushers)}); its site leader does")
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise Reject("INVALID_ARGUMENT", f"public key of {len(public_key)} bytes; an X25519 key is "
                                             f"{PUBLIC_KEY_BYTES}")
        if worker_id in self.keys and self.key_join.get(worker_id) == member.joins:
            raise Reject("ALREADY_EXISTS", f"worker {worker_id} already advertised a key to shard {self.state.shard}; "
                                           "a key is kept until its worker leaves the roster (rejoin for a new one)")
        self.keys[worker_id] = public_key  # a rejoined worker's fresh key replaces its old one
        self.key_join[worker_id] = member.joins
        log.info("secagg_key_advertised", shard=self.state.shard, worker=worker_id)
        if self._round_open():  # the round may have waited for this worker's old self to answer
            self.state._maybe_finish_rounds()
        self._maybe_publish()
        self.state.cond.notify_all()
        return self.epoch

    def _maybe_publish(self) -> None:
        """Publish the first roster once every expected pusher advertised (or the join wait passed);
        later, take in fresh keys between rounds."""
        state = self.state
        if self.epoch == 0:
            live = state.live_members()
            ready = {w for w in live if w in self.keys}
            if len(ready) < 2 or not live <= ready:
                return
            if len(ready) < len(self.settings.pushers):
                waited = state._now() - (state._first_join or state._now())
                if waited < state.spec.heartbeat_timeout_s:
                    return
            self._set_roster({w: self.keys[w] for w in sorted(ready)})
            self.epoch = 1
            self._log_roster()
            return
        if self._round_open():
            return
        changed = {w: k for w, k in self.keys.items() if self.roster.get(w) != k and state.members[w].alive}
        if changed:
            self._set_roster({**self.roster, **changed})
            self.epoch += 1
            self._log_roster()

    def _log_roster(self) -> None:
        params = self.settings.graph_for(len(self.roster))
        log.info("secagg_roster", shard=self.state.shard, epoch=self.epoch, pushers=sorted(self.roster),
                 degree=min(params.degree, len(self.roster) - 1), threshold=params.threshold)

    def _set_roster(self, roster: dict[str, bytes]) -> None:
        self.roster = dict(sorted(roster.items()))
        self.graph = graph.neighbours(self.roster, self.state.shard,
                                      self.settings.graph_for(len(self.roster)).degree) if self.roster else {}

    def roster_wait(self, worker_id: str, known_epoch: int, timeout_s: float) -> tuple[int, int, dict[str, bytes]]:
        """(epoch, threshold, roster) once a roster other than ``known_epoch`` is published."""
        state = self.state
        deadline = state._now() + min(max(0.0, timeout_s), PULL_WAIT_CEILING_S)
        self._caller(worker_id)
        while True:
            self._fail_check()
            self._maybe_publish()
            if self.epoch and self.epoch != known_epoch:
                return self.epoch, self.threshold(len(self.roster)), dict(self.roster)
            left = deadline - state._now()
            if left <= 0:
                waiting = sorted(set(self.settings.pushers) - set(self.keys))
                raise Reject("DEADLINE_EXCEEDED", f"no new secure-aggregation roster at shard {state.shard} "
                                                  f"(epoch {self.epoch}; keys missing from {waiting})")
            state.cond.wait(min(left, 0.5))

    # ------------------------------------------------------------- round
    def shares(self, worker_id: str, rnd: int, epoch: int, shares: list[tuple[str, bytes]]) -> None:
        """Keep ``worker_id``'s encrypted shares of its round-``rnd`` self seed, one per roster peer."""
        self._fail_check()
        self._caller(worker_id)
        state = self.state
        if not self.epoch:
            raise Reject("FAILED_PRECONDITION", "no secure-aggregation roster yet; wait for it (Roster)")
        if self.roster.get(worker_id) is None or self.roster[worker_id] != self.keys.get(worker_id):
            raise Reject("FAILED_PRECONDITION", f"worker {worker_id} is not in shard {state.shard}'s roster (epoch "
                                                f"{self.epoch}); advertise a key and wait for the roster")
        if epoch != self.epoch:
            raise Reject("FAILED_PRECONDITION", f"shares for roster epoch {epoch}; the roster is at epoch "
                                                f"{self.epoch}: fetch it and mask again")
        if rnd != state.version:
            raise Reject("FAILED_PRECONDITION", f"shares for round {rnd}; round {state.version} is open")
        sr = self.rounds.get(rnd)
        if sr is not None and sr.survivors is not None:
            raise Reject("FAILED_PRECONDITION", f"round {rnd} is closed to new pushers (unmasking)")
        if sr is not None and worker_id in sr.shares:
            raise Reject("ALREADY_EXISTS", f"worker {worker_id} already sent its shares for round {rnd}")
        peers = list(self.graph[worker_id])
        got = [p for p, _ in shares]
        if sorted(got) != peers:
            raise Reject("INVALID_ARGUMENT", f"shares must go to each neighbour in the roster's graph once "
                                             f"({len(peers)}: {', '.join(peers[:5])}); got {len(got)}")
        bad = next((p for p, blob in shares if len(blob) != CIPHERTEXT_BYTES), None)
        if bad is not None:
            raise Reject("INVALID_ARGUMENT", f"the share for {bad} is not {CIPHERTEXT_BYTES} bytes")
        if sr is None:
            sr = self.rounds[rnd] = SecRound(tuple(self.roster), self.epoch, self.threshold(len(self.roster)),
                                             dict(self.graph))
        sr.shares[worker_id] = dict(shares)

    def admit_push(self, worker_id: str, rnd: int) -> None:
        """A masked push to round ``rnd`` needs the pusher's shares for it first."""
        self._fail_check()
        sr = self.rounds.get(rnd)
        if sr is None or worker_id not in sr.shares:
            raise Reject("FAILED_PRECONDITION", f"worker {worker_id}: send the round-{rnd} shares (Shares) before "
                                                "the masked push")
        if sr.survivors is not None:  # e.g. a pusher reaped as dropped that comes back: its mask stays out
            raise Reject("FAILED_PRECONDITION", f"round {rnd} is being unmasked without worker {worker_id}; "
                                                "pull and push the next round")

    def expected(self, live: set[str]) -> set[str]:
        """Who the open round waits for: live members holding the key the round's roster has."""
        sr = self.rounds.get(self.state.version)
        if sr is None:
            return live
        return {w for w in live if w in sr.roster and self.keys.get(w) == self.roster.get(w)}

    def finish(self, rnd: int, agg: MaskedRound) -> dict[str, np.ndarray] | None:
        """The round's mean update once unmasked; None while answers are missing (or the round failed)."""
        sr = self.rounds.get(rnd)
        if sr is None or self.failed:
            return None
        if sr.update is not None:
            return self._close(rnd, sr)
        if sr.unmasking:
            return None
        if sr.survivors is None:
            sr.survivors = tuple(w for w in sr.roster if w in agg.contributors)
            sr.dropped = tuple(w for w in sr.roster if w not in agg.contributors)
            log.info("secagg_unmask_open", shard=self.state.shard, round=rnd, survivors=len(sr.survivors),
                     dropped=list(sr.dropped))
            if len(sr.survivors) < sr.threshold:
                self._fail(f"round {rnd}: only {len(sr.survivors)} of {len(sr.roster)} pushers pushed; the threshold "
                           f"is {sr.threshold}, so the round cannot be unmasked")
                return None
            short = self._short_holders(sr, set(sr.survivors))
            if short:
                p, left = short
                self._fail(f"round {rnd}: pusher {p} has {left} surviving share holder(s) of {len(sr.holders(p))} "
                           f"(itself and its neighbours); the threshold is {sr.threshold}, so the round cannot be "
                           "unmasked")
                return None
            self._unmask_open.notify_all()
        live = self.state.live_members()
        # a survivor that restarted since it pushed (a fresh key advertised) cannot answer for its old self
        restarted = {w for w in sr.survivors if self.keys.get(w) != self.roster.get(w)}
        answering = [w for w in sr.survivors if w in live and w not in sr.reveals and w not in restarted]
        if answering:
            return None
        revealed = set(sr.reveals)
        if len(revealed) < sr.threshold:
            self._fail(f"round {rnd}: {len(revealed)} survivor(s) answered the unmask, fewer than the threshold "
                       f"{sr.threshold}; the round cannot be unmasked")
            return None
        short = self._short_holders(sr, revealed)
        if short:
            p, left = short
            self._fail(f"round {rnd}: {left} of pusher {p}'s {len(sr.holders(p))} share holders answered the unmask, "
                       f"fewer than the threshold {sr.threshold}; the round cannot be unmasked")
            return None
        silent = [w for w in sr.survivors if w not in revealed]
        dropped = set(sr.dropped)
        stuck = [w for w in silent if dropped & set(sr.neighbours[w])]
        if stuck:
            lost = sorted(dropped & {d for w in stuck for d in sr.neighbours[w]})
            self._fail(f"round {rnd}: {', '.join(stuck)} pushed but vanished before revealing its pair seeds with "
                       f"the dropped {', '.join(lost)}; those masks cannot be removed")
            return None
        # every answer is in and no new push is admitted: the sum and the answers stay as they are
        sr.unmasking, sr.silent = True, tuple(silent)
        threading.Thread(target=self._unmask_unlocked, args=(rnd, sr, agg.total, agg.weight), daemon=True,
                         name=f"secagg-unmask-{self.state.shard}-{rnd}").start()
        return None

    def _unmask_unlocked(self, rnd: int, sr: SecRound, total: np.ndarray, weight: int) -> None:
        """Unmask round ``rnd`` without the shard's lock, then close it under the lock."""
        try:
            total, self_seeds, pair_seeds = self._unmask(rnd, sr, total)
            update, error = self._to_update(rnd, total, weight, len(sr.survivors)), None
        except ValueError as err:
            update, error = None, err
        state = self.state
        with state.cond:
            if self.rounds.get(rnd) is not sr:
                return
            if error is not None:
                self._fail(f"round {rnd}: {error}")
                return
            self.last_unmask = {"round": rnd, "shard": state.shard, "survivors": sr.survivors, "dropped": sr.dropped,
                                "revealed_by": tuple(sorted(sr.reveals)), "self_seeds": self_seeds,
                                "pair_seeds": pair_seeds}
            log.info("secagg_unmasked", shard=state.shard, round=rnd, survivors=len(sr.survivors),
                     dropped=list(sr.dropped))
            sr.update = update
            state._maybe_finish_rounds()
            state.cond.notify_all()

    def _close(self, rnd: int, sr: SecRound) -> dict[str, np.ndarray]:
        """The unmasked round's update, handed to the optimizer; its dropped and silent pushers leave the roster."""
        del self.rounds[rnd]
        self.unmasked_rounds += 1
        self.dropped_pushers += len(sr.dropped)
        self._evict(set(sr.dropped) | set(sr.silent) | (set(sr.roster) - self.state.live_members()))
        return sr.update

    @staticmethod
    def _short_holders(sr: SecRound, answering: set[str]) -> tuple[str, int] | None:
        """(a survivor, how many of its share holders are in ``answering``) when fewer than the threshold."""
        for p in sr.survivors:
            left = sum(q in answering for q in sr.holders(p))
            if left < sr.threshold:
                return p, left
        return None

    @staticmethod
    def _unmask(rnd: int, sr: SecRound, total: np.ndarray) -> tuple[np.ndarray, dict[str, bytes], set]:
        """(the sum without masks, the rebuilt self seeds, the (revealer, dropped) pair seeds used)."""
        self_seeds = {}  # the round's sum is unmasked in place: the round ends here either way
        for p in sr.survivors:
            points = {sr.x_of(q): sr.reveals[q][0][p] for q in sr.holders(p) if q in sr.reveals}
            self_seeds[p] = shamir.reconstruct(points, sr.threshold)
            add_mask(total, self_seeds[p], -1)
        pair_seeds = set()
        for q, (_, seeds) in sr.reveals.items():
            for d in seeds:
                # q's vector holds +PRG(seed) for a peer sorted after it, -PRG(seed) for one before
                add_mask(total, seeds[d], -1 if d > q else 1)
                pair_seeds.add((q, d))
        return total, self_seeds, pair_seeds

    def _to_update(self, rnd: int, total: np.ndarray, weight: int, pushers: int) -> dict[str, np.ndarray]:
        """The round's mean update of the keys some pusher had a gradient for (the others are left out,
        so they are not stepped); ValueError when the presence counts exceed the ``pushers``."""
        s = self.settings
        layout = self.layout()
        counts = total[total.size - len(layout):]
        if (counts > pushers).any():
            raise ValueError(f"presence counts exceed the {pushers} pusher(s) of the round; the sum was tampered with")
        values = dequantise(total[:total.size - len(layout)], s.clip, s.limit, s.bits)
        if weight > 1:
            values /= np.float32(weight)
        out, offset = {}, 0
        for (key, numel), count in zip(layout, counts):
            if not count:  # no pusher had a gradient for it: skip its values, leave it out
                offset += numel if s.randomk_ratio is None else min(numel, max(1, math.ceil(s.randomk_ratio * numel)))
                continue
            if s.randomk_ratio is None:
                out[key] = values[offset:offset + numel]
                offset += numel
            else:
                idx = kept_indices(key, rnd, numel, s.randomk_ratio)
                dense = np.zeros(numel, np.float32)
                dense[idx] = values[offset:offset + idx.size]
                out[key] = dense
                offset += idx.size
        return out

    def _evict(self, workers: set[str]) -> None:
        gone = [w for w in workers if w in self.roster]
        for w in gone:
            del self.roster[w]
            if self.keys.get(w) is not None and w not in self.state.live_members():
                del self.keys[w]
        if gone:
            self._set_roster(self.roster)
            self.epoch += 1
            log.warning("secagg_evicted", shard=self.state.shard, workers=sorted(gone), epoch=self.epoch)
        self._maybe_publish()

    def layout(self) -> list[tuple[str, int]]:
        """(key, element count) of this shard's keys, in the order a masked vector concatenates them."""
        return [(b.key, b.stop - b.start) for b in self.state.plan.blocks_for_shard(self.state.shard)]

    def decode(self, rnd: int, payloads: dict[str, bytes]) -> dict[str, np.ndarray]:
        """A masked push's payloads (per key, the kept elements' ring values, then the key's masked
        presence flag) as one vector: every key's values, then every key's flag; sizes are checked
        against the key before anything is allocated."""
        item = self.dtype.itemsize
        parts, flags = [], []
        for key, numel in self.layout():
            payload = payloads[key]
            kept = numel if self.settings.randomk_ratio is None else \
                min(numel, max(1, math.ceil(self.settings.randomk_ratio * numel)))
            if len(payload) != (kept + 1) * item:
                raise Reject("INVALID_ARGUMENT", f"key {key!r}: masked payload of {len(payload)} bytes, expected "
                                                 f"{kept} ring elements and a presence element of "
                                                 f"{self.settings.bits} bits")
            ring = np.frombuffer(payload, dtype=self.dtype)
            parts.append(ring[:kept])
            flags.append(ring[kept:])
        return {"ring": np.concatenate(parts + flags)}

    # ------------------------------------------------------------ unmask
    def unmask_request(self, worker_id: str, rnd: int, timeout_s: float):
        """(survivors, dropped, [(sender, ciphertext)] for the caller) once round ``rnd``'s pushers are known."""
        state = self.state
        self._caller(worker_id)
        deadline = state._now() + min(max(0.0, timeout_s), PULL_WAIT_CEILING_S)
        while True:
            self._fail_check()
            sr = self.rounds.get(rnd)
            if sr is None:
                raise Reject("FAILED_PRECONDITION", f"round {rnd} is not being unmasked at shard {state.shard} "
                                                    f"(open round {state.version})")
            if sr.survivors is not None:
                break
            left = deadline - state._now()
            if left <= 0:
                raise Reject("DEADLINE_EXCEEDED", f"round {rnd} still waits for pushes")
            if not self._unmask_open.wait(min(left, 0.5)):
                state._maybe_finish_rounds()  # e.g. the expected workers' join wait has passed
        if worker_id not in sr.survivors:
            raise Reject("FAILED_PRECONDITION", f"worker {worker_id} is not among round {rnd}'s pushers")
        survivors, dropped = self._split(sr, worker_id)
        addressed = [(p, sr.shares[p][worker_id]) for p in survivors if p != worker_id]
        return survivors, dropped, addressed

    @staticmethod
    def _split(sr: SecRound, worker_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``worker_id``'s share holders split into (survivors, dropped): what its answer covers."""
        holders = sr.holders(worker_id)
        dropped = set(sr.dropped)
        return tuple(w for w in holders if w not in dropped), tuple(w for w in holders if w in dropped)

    def reveal(self, worker_id: str, rnd: int, shares: dict[str, bytes], seeds: dict[str, bytes]) -> None:
        """Keep a survivor's answer: a share of every survivor's self seed, its pair seed with every dropped."""
        self._fail_check()
        self._caller(worker_id)
        sr = self.rounds.get(rnd)
        if sr is None or sr.survivors is None:
            raise Reject("FAILED_PRECONDITION", f"round {rnd} is not being unmasked at shard {self.state.shard}")
        if worker_id not in sr.survivors:
            raise Reject("PERMISSION_DENIED", f"worker {worker_id} is not among round {rnd}'s pushers")
        if worker_id in sr.reveals:
            raise Reject("ALREADY_EXISTS", f"worker {worker_id} already answered the unmask of round {rnd}")
        if sr.unmasking:
            raise Reject("FAILED_PRECONDITION", f"round {rnd} is being unmasked without worker {worker_id}'s answer "
                                                "(it was reaped before answering)")
        survivors, dropped = self._split(sr, worker_id)
        if sorted(shares) != sorted(survivors):
            raise Reject("INVALID_ARGUMENT", f"the answer needs one share per surviving neighbour and itself "
                                             f"({len(survivors)}); got {len(shares)}")
        if sorted(seeds) != sorted(dropped):
            raise Reject("INVALID_ARGUMENT", f"the answer needs one pair seed per dropped neighbour "
                                             f"({len(dropped)}); got {len(seeds)}")
        if any(len(v) != shamir.SHARE_BYTES for v in shares.values()) or \
                any(len(v) != SEED_BYTES for v in seeds.values()):
            raise Reject("INVALID_ARGUMENT", f"shares are {shamir.SHARE_BYTES} bytes and pair seeds {SEED_BYTES}")
        sr.reveals[worker_id] = (dict(shares), dict(seeds))
        self.state._maybe_finish_rounds()
        self.state.cond.notify_all()

    def status(self) -> dict:
        return {"epoch": self.epoch, "roster": sorted(self.roster), "failed": self.failed,
                "open_rounds": sorted(self.rounds)}
