"""The pushing worker's side of secure aggregation, for one shard (no network here).

`ShardMasker` holds the worker's X25519 key for the shard, the pair secrets with its
neighbours in the roster's graph (`graph.neighbours`: every other pusher when complete),
and each open round's self seed; it masks a vector and answers the shard's unmask
request. It never reveals, in one (shard, round), both a share of a pusher's self
seed and its pair seed with that pusher: with both, the shard could unmask that
pusher's update alone; and it answers only when at least the threshold of its share
holders are named survivors, so no lie about who dropped gathers both kinds.
"""

from __future__ import annotations

import os

import numpy as np

from hybridfleet.errors import ProtocolError
from hybridfleet.ps.secagg import graph, shamir
from hybridfleet.ps.secagg.keys import KeyPair, decrypt_share, encrypt_share, pair_seed
from hybridfleet.ps.secagg.masks import add_mask
from hybridfleet.ps.secagg.ring import quantise
from hybridfleet.ps.secagg.settings import SecAggSettings


class ShardMasker:
    """Worker ``me``'s masking state for shard ``shard``."""

    def __init__(self, me: str, shard: int, settings: SecAggSettings, rng: np.random.Generator | None = None):
        self.me, self.shard, self.settings = me, shard, settings
        self.keypair = KeyPair()
        self.epoch = 0
        self.threshold = 0
        self.roster: dict[str, bytes] = {}
        self.neighbours: tuple[str, ...] = ()     # this worker's neighbours in the roster's graph
        self.secrets: dict[str, bytes] = {}       # pair secret with each neighbour
        self.in_roster = False  # this key has been in a published roster (a later absence means eviction)
        self._open: dict[int, dict] = {}
        self.rng = rng or np.random.default_rng()

    def fresh_key(self) -> None:
        """A new key pair (after an eviction: a dropped pusher rejoins only with fresh keys)."""
        self.keypair, self.in_roster, self.epoch, self.roster, self.secrets = KeyPair(), False, 0, {}, {}
        self.neighbours = ()

    def set_roster(self, epoch: int, threshold: int, roster: dict[str, bytes]) -> bool:
        """Adopt a published roster; False when it does not hold this worker's current key. ProtocolError
        when the shard's threshold is not the one the job's bounds give for the roster (a lower one
        would let fewer holders, colluding, rebuild a self seed)."""
        if roster.get(self.me) != self.keypair.public:
            return False
        params = self.settings.graph_for(len(roster))
        if threshold != params.threshold:
            raise ProtocolError(f"shard {self.shard} published threshold {threshold} for {len(roster)} pushers; the "
                                f"job's secure_aggregation gives {params.threshold}")
        self.epoch, self.threshold, self.roster = epoch, threshold, dict(sorted(roster.items()))
        self.neighbours = graph.neighbours(self.roster, self.shard, params.degree)[self.me]
        self.secrets = {q: self.keypair.pair_secret(self.me, q, self.roster[q], self.shard) for q in self.neighbours}
        self.in_roster = True
        return True

    def mask(self, rnd: int, vector: np.ndarray, present: np.ndarray | None = None) -> tuple[np.ndarray, list[tuple[str, bytes]]]:
        """(masked ring vector, encrypted shares of this round's self seed, one per peer).

        ``present``: one flag per key, 1 when this pusher had a gradient for it; appended to the
        quantised values as whole ring elements and masked with them, so the shard learns only
        how many pushers had a gradient for each key."""
        s = self.settings
        x_of = {w: i + 1 for i, w in enumerate(self.roster)}
        holders = sorted((self.me, *self.neighbours))
        seed = os.urandom(shamir.SECRET_BYTES)
        shares = shamir.split(seed, [x_of[w] for w in holders], self.threshold)
        ring = quantise(vector, s.clip, s.limit, s.bits, self.rng)
        if present is not None:
            ring = np.concatenate([ring, np.asarray(present, dtype=ring.dtype)])
        add_mask(ring, seed)
        for q, secret in self.secrets.items():
            add_mask(ring, pair_seed(secret, self.shard, rnd), 1 if q > self.me else -1)
        encrypted = [(q, encrypt_share(self.secrets[q], self.shard, rnd, self.me, q, shares[x_of[q]]))
                     for q in self.neighbours]
        self._open = {rnd: {"own_share": shares[x_of[self.me]], "answered": False}}
        return ring, encrypted

    def answered(self, rnd: int) -> bool:
        """Whether this worker already revealed its answer for round ``rnd`` of its current key."""
        state = self._open.get(rnd)
        return state is not None and state["answered"]

    def answer(self, rnd: int, survivors: list[str], dropped: list[str],
               addressed: dict[str, bytes]) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """(share of each survivor's self seed, pair seed with each dropped pusher) for round ``rnd``:
        ``survivors`` (this worker among them) and ``dropped`` split this worker's neighbours."""
        state = self._open.get(rnd)
        if state is None:
            raise ProtocolError(f"shard {self.shard} asked to unmask round {rnd}, which this worker did not mask")
        if state["answered"]:
            raise ProtocolError(f"shard {self.shard} asked twice to unmask round {rnd}; refusing the second answer")
        s_set, d_set = set(survivors), set(dropped)
        if s_set & d_set:
            raise ProtocolError(f"shard {self.shard} named {sorted(s_set & d_set)} both survivor and dropped in round "
                                f"{rnd}; revealing both a share and a pair seed would unmask them")
        if self.me not in s_set or (s_set | d_set) != {self.me, *self.neighbours} or len(survivors) != len(s_set):
            raise ProtocolError(f"shard {self.shard}'s survivors/dropped for round {rnd} do not split this worker's "
                                "neighbours in the roster's graph")
        if len(s_set) < self.threshold:
            raise ProtocolError(f"shard {self.shard} named {len(s_set)} survivor(s) among this worker's "
                                f"{len(self.neighbours) + 1} share holders in round {rnd}, fewer than the threshold "
                                f"{self.threshold}; refusing to answer")
        shares = {}
        for p in survivors:
            if p == self.me:
                shares[p] = state["own_share"]
                continue
            blob = addressed.get(p)
            if blob is None:
                raise ProtocolError(f"shard {self.shard} sent no share from {p} for round {rnd}")
            shares[p] = decrypt_share(self.secrets[p], self.shard, rnd, p, self.me, blob)
        seeds = {d: pair_seed(self.secrets[d], self.shard, rnd) for d in dropped}
        state["answered"] = True
        return shares, seeds
