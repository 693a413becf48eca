"""Aggregation rules (hybridfleet.ps.aggregate): one conformance suite, then each robust rule's bound."""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.errors import SpecError
from hybridfleet.ps.aggregate import MeanRound, MedianRound, NormClipRound, TrimmedMeanRound, make_round
from hybridfleet.spec import parse_spec
from hybridfleet.spec.models import AggregateSpec

RULES = [MeanRound, MedianRound, lambda: TrimmedMeanRound(0.2), lambda: NormClipRound(1e9)]


def honest(n: int, seed: int = 0, size: int = 50) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=size).astype(np.float32)
    return [{"w": base + 0.01 * rng.normal(size=size).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("make", RULES)
def test_every_rule_returns_the_common_update_when_contributions_agree(make):
    rnd = make()
    same = {"w": np.arange(6, dtype=np.float32), "b": np.ones(2, dtype=np.float32)}
    for i in range(3):
        rnd.add(f"site-{i}", {k: v.copy() for k, v in same.items()})
    out = rnd.result()
    assert set(out) == {"w", "b"} and all(np.allclose(out[k], same[k]) for k in same)


@pytest.mark.parametrize("make", RULES)
def test_every_rule_treats_a_leaders_sum_as_the_mean_of_its_workers(make):
    rnd = make()
    rnd.add("leader", {"w": np.full(4, 6.0, dtype=np.float32)}, weight=3)  # three workers' sum: mean 2
    rnd.add("lone", {"w": np.full(4, 2.0, dtype=np.float32)}, weight=1)
    assert np.allclose(rnd.result()["w"], 2.0) and rnd.weight == 4


@pytest.mark.parametrize("make", RULES)
def test_every_rule_counts_a_key_a_contributor_left_out_as_zeros(make):
    # a key without a gradient is left out of a push; the round treats it as zeros, as DDP does
    full, partial, zeros = make(), make(), make()
    a = {"w": np.array([1.0, -2.0], np.float32), "b": np.array([3.0], np.float32)}
    b = {"w": np.array([0.5, 4.0], np.float32)}
    full.add("x", a)
    full.add("y", {**b, "b": np.zeros(1, np.float32)})
    partial.add("x", a)
    partial.add("y", b)
    want = full.result()
    got = partial.result()
    assert set(got) == {"w", "b"}
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    zeros.add("x", {})
    assert zeros.result() == {}


@pytest.mark.parametrize("make", RULES)
def test_every_rule_refuses_a_second_contribution_and_keeps_the_first(make):
    rnd = make()
    rnd.add("a", {"w": np.ones(3, dtype=np.float32)})
    with pytest.raises(ValueError, match="a already contributed to this round"):
        rnd.add("a", {"w": np.full(3, 100.0, dtype=np.float32)})
    assert rnd.contributors == {"a"} and rnd.weight == 1 and np.allclose(rnd.result()["w"], 1.0)


@pytest.mark.parametrize("attack", [1000.0, -1000.0, -1.0])
@pytest.mark.parametrize("make", [MedianRound, lambda: TrimmedMeanRound(0.2)])
def test_coordinate_rules_stay_inside_the_honest_range_whatever_one_site_sends(make, attack):
    updates = honest(4)
    rnd = make()
    for i, u in enumerate(updates):
        rnd.add(f"honest-{i}", u)
    rnd.add("attacker", {"w": updates[0]["w"] * attack})
    out = rnd.result()["w"]
    stacked = np.stack([u["w"] for u in updates])
    assert (out >= stacked.min(axis=0) - 1e-6).all() and (out <= stacked.max(axis=0) + 1e-6).all()
    plain = MeanRound()
    for i, u in enumerate(honest(4)):
        plain.add(f"honest-{i}", u)
    plain.add("attacker", {"w": updates[0]["w"] * attack})
    if abs(attack) > 1:  # the plain mean is dragged far outside it
        assert np.abs(plain.result()["w"] - stacked.mean(axis=0)).max() > 10


def test_norm_clip_bounds_one_sites_influence_by_clip_norm_times_its_share():
    updates = honest(3, size=20)
    clip = 0.5
    rnd = NormClipRound(clip)
    for i, u in enumerate(updates):
        rnd.add(f"honest-{i}", {"w": u["w"] * (clip / 10 / np.linalg.norm(u["w"]))})  # honest ones under the bound
    reference = rnd.result()["w"].copy() * 3 / 4  # the honest part of a 4-way mean
    attacked = NormClipRound(clip)
    for i, u in enumerate(updates):
        attacked.add(f"honest-{i}", {"w": u["w"] * (clip / 10 / np.linalg.norm(u["w"]))})
    attacked.add("attacker", {"w": np.full(20, 1e6, dtype=np.float32)})
    moved = np.linalg.norm(attacked.result()["w"] - reference)
    assert moved <= clip / 4 + 1e-5 and attacked.clipped == 1


def test_trimmed_mean_always_keeps_one_value():
    assert TrimmedMeanRound(0.4).trimmed(2) == 0 and TrimmedMeanRound(0.2).trimmed(10) == 2


def test_make_round_follows_the_spec():
    assert isinstance(make_round(AggregateSpec.model_validate("median")), MedianRound)
    assert isinstance(make_round(AggregateSpec(rule="norm_clip", clip_norm=1.0)), NormClipRound)
    assert isinstance(make_round(AggregateSpec()), MeanRound)


def _job(**ps):
    return {"name": "j", "framework": "torch", "entrypoint": "train.py", "mode": "ps",
            "sites": {"a": {"workers": 1}}, "ps": ps}


@pytest.mark.parametrize("ps, message", [
    ({"aggregate": "median", "sync": "asp"}, "aggregate: rule median combines the updates of one round; it needs sync: bsp"),
    ({"aggregate": "norm_clip"}, "clip_norm: rule norm_clip needs clip_norm > 0"),
    ({"aggregate": "krum"}, "ps.aggregate.rule"),
    ({"aggregate": {"rule": "trimmed_mean", "trim_fraction": 0.5}}, "ps.aggregate.trim_fraction"),
])
def test_bad_aggregate_settings_name_the_field_and_the_fix(ps, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_job(**ps))


def test_a_shard_with_a_median_rule_applies_the_median_of_the_sites(tmp_path):
    from tests.ps_helpers import join_and_init, start_cluster
    from tests.test_ps_server import encoded, grads

    sites = {s: {"workers": 1} for s in ("a", "b", "c")}
    cluster = start_cluster(tmp_path, expected_workers=3, sites=sites, aggregate="median",
                            optimizer={"name": "sgd", "lr": 1.0})
    try:
        clients = [cluster.client(site) for site in ("a", "b", "c")]
        for c in clients:
            join_and_init(cluster, c, init=c is clients[0])  # a-0 initialises (global rank 0)
        before = {k: v.copy() for k, v in cluster.params().items()}
        for c, value in zip(clients, (1.0, 2.0, 1000.0)):
            c.push(encoded(c, grads(value)), codec="none")
        after = cluster.params()
        assert all(np.allclose(before[k] - after[k], 2.0) for k in before)  # median of 1, 2, 1000
    finally:
        cluster.stop()
