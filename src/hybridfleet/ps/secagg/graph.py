"""SecAgg+'s sparse neighbour graph (Bell et al. 2020) and the bounds that choose its degree and threshold.

Each pusher masks pairwise and shares its self seed only with its ``k`` neighbours in a
Harary graph H(n, k): the roster's pushers sit on a ring in an order drawn from the
roster itself (every id with its fresh public key), each joined to the ``k/2`` nearest on
either side. Every party derives the same graph from the published roster; the shard
cannot place a pusher without choosing the pushers' keys. When ``k >= n - 1`` the graph
is complete: every pusher pairs with every other (the original Bonawitz protocol).

A pusher's self seed has ``k + 1`` holders (itself and its neighbours), ``t`` of which
must answer. With ``n`` pushers of which ``C = floor(gamma n)`` collude with the shard
and at most ``D = floor(delta n)`` drop out, and neighbourhoods that are uniform random
``k``-subsets (the ring order is a random permutation), the round is

- **private** for an honest pusher ``i`` with ``c_i`` colluding neighbours while
  ``c_i < t`` against a shard that follows the protocol (the colluders' shares cannot
  rebuild ``i``'s self seed, which alone would strip ``i``'s masks once ``i`` is declared
  dropped), and while ``2t > k + 2 + c_i`` against one that names ``i`` a survivor to
  some holders and dropped to others (``malicious_shard``): each honest holder reveals,
  for ``i``, either a share of its self seed or its pair seed with ``i``, never both,
  and ``i`` answers only when at least ``t`` of its holders are named survivors, so such
  a shard, to learn every pair seed of ``i``, gathers at most ``1 + c_i + (k + 1 - t)``
  shares of its self seed: fewer than ``t``;
- **live** while each survivor keeps ``t`` holders: ``d_i <= k + 1 - t`` dropped neighbours;
- **one sum**: the honest survivors stay connected, so the shard learns their total and
  no partial sum; H(n, k) splits only where two runs of ``k/2`` ring neighbours are all
  colluding or dropped.

`choose` takes the smallest even ``k`` for which some ``t`` meets all three with
probability ``1 - 2^-security_bits`` (privacy and one sum) and ``1 - 2^-correctness_bits``
(liveness), union-bounded over the pushers, with exact hypergeometric tails. Below
`AUTO_SPARSE_FROM` pushers the default is the complete graph with its threshold
floor(2n/3)+1: its n - 1 masks per pusher are cheap there, and it tolerates about n/3
dropouts and n/3 colluders whatever the graph's draw.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

AUTO_SPARSE_FROM = 50  # pushers: the default graph is sparse from here, complete below


@dataclass(frozen=True)
class GraphParams:
    """A roster's graph degree ``k`` (each pusher's neighbours) and Shamir threshold ``t`` (of ``k + 1`` holders)."""

    pushers: int
    degree: int
    threshold: int

    @property
    def complete(self) -> bool:
        return self.degree >= self.pushers - 1


def _log2_tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """log2 P[X >= at_least] for X hypergeometric (``draws`` of ``population`` holding ``marked``); -inf if 0."""
    lo = max(at_least, 0, draws - (population - marked))
    hi = min(draws, marked)
    if lo > hi:
        return -math.inf
    total = sum(math.comb(marked, x) * math.comb(population - marked, draws - x) for x in range(lo, hi + 1))
    return math.log2(total) - math.log2(math.comb(population, draws))


def _log2_split(pushers: int, bad: int, degree: int) -> float:
    """log2 of a bound on P[the ring's good nodes split]: two disjoint runs of ``degree/2`` bad nodes."""
    if degree >= pushers - 1 or bad < degree:
        return -math.inf
    # (bad)_k / (n)_k: a fixed set of k ring positions all bad, times n^2/2 choices of the two runs' starts
    log_p = sum(math.log2(bad - j) - math.log2(pushers - j) for j in range(degree))
    return log_p + 2 * math.log2(pushers) - 1


@lru_cache(maxsize=256)
def check(pushers: int, degree: int, threshold: int, dropout_rate: float, collusion_fraction: float,
          security_bits: int, correctness_bits: int, malicious_shard: bool = False) -> str | None:
    """Why (``degree``, ``threshold``) breaks the bounds for ``pushers`` (None when it meets them)."""
    n, k, t = pushers, min(degree, pushers - 1), threshold
    colluders = math.floor(collusion_fraction * n)
    dropped = math.floor(dropout_rate * n)
    if not 1 <= t <= k + 1:
        return f"threshold {t} must lie in 1..{k + 1} (a pusher and its {k} neighbours)"
    log_n = math.log2(n)
    reach, rule = (2 * t - k - 2, "2t - k - 2") if malicious_shard else (t, "t")
    privacy = _log2_tail(n - 1, colluders, k, reach) + log_n
    if privacy > -security_bits:
        return (f"threshold {t} of {k + 1} holders: {colluders} colluding pusher(s) of {n} reach {rule} = "
                f"{reach} of one pusher's {k} neighbours with probability 2^{privacy:.1f} > "
                f"2^-{security_bits}; raise threshold or degree")
    liveness = _log2_tail(n - 1, dropped, k, k + 2 - t) + log_n
    if liveness > -correctness_bits:
        return (f"threshold {t} of {k + 1} holders: {dropped} dropout(s) of {n} leave a survivor fewer than {t} "
                f"holders with probability 2^{liveness:.1f} > 2^-{correctness_bits}; lower threshold or raise degree")
    split = _log2_split(n, colluders + dropped, k)
    if split > -security_bits:
        return (f"degree {k}: {colluders + dropped} colluding or dropped pusher(s) of {n} can split the honest "
                f"survivors' graph with probability 2^{split:.1f} > 2^-{security_bits}; raise degree")
    return None


def choose(pushers: int, dropout_rate: float, collusion_fraction: float, security_bits: int,
           correctness_bits: int, degree: int | None = None, threshold: int | None = None,
           malicious_shard: bool = False) -> GraphParams:
    """The graph for ``pushers``: the given ``degree``/``threshold`` checked against the bounds, the missing
    ones chosen (smallest even degree, then the middle of the thresholds that pass); ValueError naming
    the broken bound. The complete graph's default threshold stays floor(2n/3)+1."""
    n = pushers
    args = (dropout_rate, collusion_fraction, security_bits, correctness_bits, malicious_shard)
    if degree is not None and (degree < 2 or (degree % 2 and degree < n - 1)):
        raise ValueError(f"degree must be an even number >= 2, or >= n-1 = {n - 1} for the complete graph "
                         f"(got {degree})")
    if degree is not None:
        degrees = [min(degree, n - 1)]
    else:
        degrees = [*range(2, n - 1, 2), n - 1] if n >= AUTO_SPARSE_FROM else [n - 1]
    last = None
    for k in degrees:
        if threshold is not None:
            ts = [threshold]
        elif k >= n - 1:
            ts = [min(n, (2 * n) // 3 + 1)] + list(range(1, n + 1))
        else:
            ts = list(range(1, k + 2))
        good = [t for t in ts if check(n, k, t, *args) is None]
        if good:
            t = good[0] if (threshold is not None or k >= n - 1) else good[len(good) // 2]
            return GraphParams(n, k, t)
        last = check(n, k, ts[0] if threshold is not None else (k + 2) // 2 + 1, *args)
    raise ValueError(f"no graph for {n} pushers meets the bounds (dropout_rate {dropout_rate}, collusion_fraction "
                     f"{collusion_fraction}): {last}")


def ring_order(roster: dict[str, bytes], shard: int) -> list[str]:
    """The roster's pushers in ring order: sorted by a hash of the whole roster (ids and keys) and the id."""
    digest = hashlib.sha256(f"hfleet-secagg-graph|{shard}|".encode())
    for w, key in sorted(roster.items()):
        digest.update(w.encode() + b"\0" + key)
    seed = digest.digest()
    return sorted(roster, key=lambda w: hashlib.sha256(seed + w.encode()).digest())


def neighbours(roster: dict[str, bytes], shard: int, degree: int) -> dict[str, tuple[str, ...]]:
    """Each pusher's neighbours (sorted ids) in H(n, ``degree``) over `ring_order`; all others when complete."""
    ids = sorted(roster)
    n = len(ids)
    if degree >= n - 1:
        return {w: tuple(q for q in ids if q != w) for w in ids}
    order = ring_order(roster, shard)
    half = degree // 2
    return {w: tuple(sorted(order[(i + o) % n] for o in range(-half, half + 1) if o))
            for i, w in enumerate(order)}
