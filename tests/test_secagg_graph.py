"""SecAgg+'s neighbour graph and its bounds: the same graph everywhere, degree and threshold from the paper's bounds."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from scipy import stats

from hybridfleet.errors import ProtocolError
from hybridfleet.ps.secagg import graph
from hybridfleet.ps.secagg.pusher import ShardMasker
from hybridfleet.ps.secagg.settings import SecAggSettings
from hybridfleet.spec import parse_spec


def _roster(n: int) -> dict[str, bytes]:
    return {f"s{i:03d}-0": os.urandom(32) for i in range(n)}


def _job(n: int, **sa):
    return {"name": "j", "framework": "torch", "entrypoint": "t.py", "sites": {f"s{i:03d}": {} for i in range(n)},
            "ps": {"secure_aggregation": sa or True}}


def test_the_harary_graph_is_k_regular_symmetric_and_the_same_from_any_roster_order():
    roster = _roster(40)
    g = graph.neighbours(roster, 0, 8)
    assert all(len(nb) == 8 and w not in nb for w, nb in g.items())
    assert all(w in g[q] for w, nb in g.items() for q in nb)  # symmetric
    shuffled = dict(sorted(roster.items(), key=lambda kv: kv[1]))
    assert graph.neighbours(shuffled, 0, 8) == g  # insertion order does not matter
    # the ring order follows every key: a shard that changes one pusher's key gets a different graph
    changed = {**roster, "s000-0": os.urandom(32)}
    assert graph.ring_order(changed, 0) != graph.ring_order(roster, 0)
    assert graph.ring_order(roster, 1) != graph.ring_order(roster, 0)  # each shard has its own graph


def test_the_complete_graph_pairs_every_pusher_with_every_other():
    roster = _roster(5)
    g = graph.neighbours(roster, 0, 4)
    assert g == {w: tuple(q for q in sorted(roster) if q != w) for w in roster}
    assert graph.neighbours(roster, 0, 10) == g


def test_the_tails_are_the_exact_hypergeometric_ones():
    for population, marked, draws, at_least in [(99, 10, 30, 8), (99, 33, 30, 20), (19, 2, 8, 1)]:
        expected = stats.hypergeom.sf(at_least - 1, population, marked, draws)
        assert math.isclose(2 ** graph._log2_tail(population, marked, draws, at_least), expected, rel_tol=1e-9)
    assert graph._log2_tail(19, 2, 8, 3) == -math.inf  # 2 marked cannot be drawn 3 times


def test_the_neighbourhoods_of_a_random_graph_hold_colluders_as_the_bound_assumes():
    """Monte Carlo: over many rosters, one pusher's colluding neighbours follow the hypergeometric law."""
    n, k, colluders = 60, 10, 12
    bad = {f"s{i:03d}-0" for i in range(1, colluders + 1)}
    counts = [sum(q in bad for q in graph.neighbours(_roster(n), 0, k)["s000-0"]) for _ in range(400)]
    observed = np.bincount(counts, minlength=k + 1)
    pmf = stats.hypergeom.pmf(np.arange(k + 1), n - 1, colluders, k)
    keep = pmf * 400 >= 5
    chi = stats.chisquare(observed[keep], pmf[keep] / pmf[keep].sum() * observed[keep].sum())
    assert chi.pvalue > 1e-4


def test_a_shard_that_may_lie_about_dropouts_needs_the_larger_threshold():
    honest, lying = (graph.choose(100, 0.1, 0.1, 40, 20, malicious_shard=m) for m in (False, True))
    assert (honest.degree, honest.threshold) == (20, 11) and (lying.degree, lying.threshold) == (32, 23)
    assert 2 * lying.threshold > lying.degree + 2 + 10  # beats the 10 colluders even all in one neighbourhood
    assert graph.check(100, honest.degree, honest.threshold, 0.1, 0.1, 40, 20, malicious_shard=True)


def test_small_jobs_keep_the_complete_graph_and_its_threshold_and_100_pushers_get_a_sparse_one():
    for n in (3, 10, 30, 49):
        p = graph.choose(n, 0.1, 0.1, 40, 20)
        assert p.complete and p.threshold == (2 * n) // 3 + 1
    p = graph.choose(100, 0.1, 0.1, 40, 20)
    assert not p.complete and p.degree <= 4 * math.ceil(math.log2(100)) * 2
    assert graph.check(100, p.degree, p.threshold, 0.1, 0.1, 40, 20) is None
    # the degree is the smallest that passes: two fewer fails every threshold
    assert all(graph.check(100, p.degree - 2, t, 0.1, 0.1, 40, 20) for t in range(1, p.degree))
    # beyond the sizes where the colluder and dropout counts cap a neighbourhood's, it grows like log n, not n
    k1000, k2000 = (graph.choose(n, 0.1, 0.1, 40, 20).degree for n in (1000, 2000))
    assert k1000 < 100 and k2000 < 1.2 * k1000


@pytest.mark.parametrize("sa, message", [
    ({"degree": 8, "threshold": 2}, "2 colluding pusher(s) of 20 reach t = 2 of one pusher's 8 neighbours"),
    ({"degree": 8, "threshold": 6, "malicious_shard": True}, "colluding pusher(s) of 20 reach 2t - k - 2 = 2"),
    ({"degree": 8, "threshold": 9}, "dropout(s) of 20 leave a survivor fewer than 9 holders"),
    ({"degree": 7}, "degree must be an even number"),
    ({"degree": 4, "dropout_rate": 0.3, "collusion_fraction": 0.3}, "no graph for 20 pushers meets the bounds"),
])
def test_a_degree_or_threshold_that_breaks_the_bounds_is_refused_with_the_bound(sa, message):
    with pytest.raises(ValueError, match="ps.secure_aggregation") as err:
        parse_spec(_job(20, **sa))
    assert message in str(err.value)


def test_a_pusher_refuses_a_roster_whose_threshold_is_not_the_bounds_and_keeps_its_state():
    job = parse_spec(_job(20, degree=8))
    settings = SecAggSettings.resolve(job.ps, job.sites)
    assert settings.graph_for(20) == graph.GraphParams(20, 8, 5)
    ms = [ShardMasker(f"s{i:03d}-0", 0, settings) for i in range(20)]
    roster = {m.me: m.keypair.public for m in ms}
    with pytest.raises(ProtocolError, match="published threshold 3 for 20 pushers; the job's secure_aggregation "
                                            "gives 5"):
        ms[0].set_roster(1, 3, roster)
    assert ms[0].epoch == 0 and ms[0].roster == {} and not ms[0].in_roster
    for m in ms:
        assert m.set_roster(1, 5, roster)
    assert ms[0].neighbours == graph.neighbours(roster, 0, 8)[ms[0].me] and len(ms[0].secrets) == 8
    ring, shares = ms[0].mask(0, np.zeros(10, np.float32))
    assert sorted(q for q, _ in shares) == list(ms[0].neighbours)  # shares go to the 8 neighbours only


def test_a_pusher_answers_only_for_its_neighbours_and_with_threshold_many_survivors():
    job = parse_spec(_job(20, degree=8))
    settings = SecAggSettings.resolve(job.ps, job.sites)
    ms = {f"s{i:03d}-0": ShardMasker(f"s{i:03d}-0", 0, settings) for i in range(20)}
    roster = {w: m.keypair.public for w, m in ms.items()}
    for m in ms.values():
        m.set_roster(1, 5, roster)
    shares = {w: dict(m.mask(4, np.zeros(10, np.float32))[1]) for w, m in ms.items()}
    a = ms["s000-0"]
    nb = list(a.neighbours)
    addressed = {q: shares[q][a.me] for q in nb}
    outsider = next(w for w in ms if w != a.me and w not in nb)
    with pytest.raises(ProtocolError, match="do not split this worker's neighbours"):
        a.answer(4, [a.me, *nb[:-1], outsider], [nb[-1]], addressed)
    with pytest.raises(ProtocolError, match="named 4 survivor\\(s\\) among this worker's 9 share holders"):
        a.answer(4, [a.me, *nb[:3]], nb[3:], addressed)
    assert not a.answered(4)
    got, seeds = a.answer(4, [a.me, *nb[:4]], nb[4:], addressed)
    assert set(got) == {a.me, *nb[:4]} and set(seeds) == set(nb[4:])
