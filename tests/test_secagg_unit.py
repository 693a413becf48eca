"""Secure aggregation's pieces (hybridfleet.ps.secagg): Shamir, the ring, masks, keys, settings."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridfleet.errors import ProtocolError, SpecError
from hybridfleet.ps.secagg import shamir
from hybridfleet.ps.secagg.keys import KeyPair, decrypt_share, encrypt_share, pair_seed
from hybridfleet.ps.secagg.masks import add_mask, prg
from hybridfleet.ps.secagg.pusher import ShardMasker
from hybridfleet.ps.secagg.ring import RING_DTYPES, check_resolution, dequantise, levels, quantise
from hybridfleet.ps.secagg.settings import SecAggSettings, default_threshold, pusher_ids
from hybridfleet.spec import parse_spec


def test_any_t_shares_recover_the_secret_and_t_minus_1_fit_every_secret():
    secret = os.urandom(32)
    shares = shamir.split(secret, [1, 2, 3, 4, 5], threshold=3)
    for chosen in ([1, 2, 3], [5, 3, 1], [2, 4, 5]):
        assert shamir.reconstruct({x: shares[x] for x in chosen}, 3) == secret
    two = {x: shares[x] for x in (1, 4)}
    with pytest.raises(ValueError, match="2 share.s. cannot recover a secret split 3-of-n"):
        shamir.reconstruct(two, 3)
    # two shares are consistent with ANY secret: for a guess g, the polynomial through (0, g) and
    # the two shares exists, so the shares say nothing about which secret was split
    for guess in (0, int.from_bytes(os.urandom(32), "big")):
        points = {0: guess.to_bytes(shamir.SHARE_BYTES, "big"), **two}
        assert shamir.interpolate(points, at=0) == guess
        assert shamir.interpolate(points, at=4) == int.from_bytes(two[4], "big")


def test_a_garbled_share_does_not_pass_as_the_secret():
    """A random field element for a share interpolates to a 521-bit value: not a 32-byte seed (odds 2^-265)."""
    shares = shamir.split(os.urandom(32), [1, 2, 3], threshold=2)
    shares[1] = (int.from_bytes(os.urandom(65), "big") % shamir.PRIME).to_bytes(shamir.SHARE_BYTES, "big")
    with pytest.raises(ValueError, match="a share is wrong"):
        shamir.reconstruct({1: shares[1], 2: shares[2]}, 2)


@pytest.mark.parametrize("bits, pushers", [(16, 3), (16, 30), (32, 10), (32, 1000)])
def test_the_sum_of_pushers_extreme_values_cannot_overflow_the_ring(bits, pushers):
    limit = levels(bits, pushers)
    assert pushers * limit <= (1 << (bits - 1)) - 1
    rng = np.random.default_rng(0)
    x = np.array([1e9, -1e9, 1.0, -1.0], np.float32)  # clipped to [-clip, clip] first
    total = np.zeros(4, RING_DTYPES[bits][0])
    for _ in range(pushers):
        total += quantise(x, 1.0, limit, bits, rng)
    assert np.allclose(dequantise(total, 1.0, limit, bits), [pushers, -pushers, pushers, -pushers])


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    bits, limit, clip = 16, levels(16, 4), 0.5
    rng = np.random.default_rng(1)
    x = rng.uniform(-0.5, 0.5, 200_000).astype(np.float32)
    back = dequantise(quantise(x, clip, limit, bits, rng), clip, limit, bits)
    step = clip / limit
    assert np.max(np.abs(back - x)) <= step * (1 + 1e-4)
    assert abs(float(np.mean(back - x))) < step / 100


def test_a_ring_too_narrow_for_its_pushers_is_refused():
    assert check_resolution(16, 500) == levels(16, 500)
    with pytest.raises(ValueError, match="leaves each only 127 quantisation levels .at least 128"):
        check_resolution(16, 512)


def test_pairwise_masks_cancel_in_the_sum_and_self_masks_come_off_with_their_seed():
    n, size, bits = 4, 1000, 32
    dtype = RING_DTYPES[bits][0]
    ids = [f"s{i}" for i in range(n)]
    keys = {w: KeyPair() for w in ids}
    x = [np.full(size, i, dtype) for i in range(n)]
    seeds = [os.urandom(32) for _ in ids]
    total = np.zeros(size, dtype)
    for i, p in enumerate(ids):
        y = x[i] + prg(seeds[i], size, dtype)
        for q in ids:
            if q != p:
                secret = keys[p].pair_secret(p, q, keys[q].public, shard=0)
                add_mask(y, pair_seed(secret, 0, 7), 1 if q > p else -1)
        assert not np.array_equal(y, x[i])
        total += y
    for s in seeds:
        add_mask(total, s, -1)
    assert np.array_equal(total, sum(x))


def test_a_mask_is_the_aes_256_ctr_keystream_across_chunk_boundaries():
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    seed, count = os.urandom(32), 3_000_001  # > one 4 MiB chunk of uint32
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(4 * count))
    assert np.array_equal(prg(seed, count, np.uint32), np.frombuffer(stream, np.uint32))
    acc = np.arange(count, dtype=np.uint32)
    add_mask(acc, seed)
    add_mask(acc, seed, -1)
    assert np.array_equal(acc, np.arange(count, dtype=np.uint32))


def test_both_ends_of_a_pair_derive_the_same_secret_bound_to_shard_and_ids():
    a, b = KeyPair(), KeyPair()
    s_ab = a.pair_secret("a", "b", b.public, shard=1)
    assert s_ab == b.pair_secret("b", "a", a.public, shard=1)
    assert s_ab != a.pair_secret("a", "b", b.public, shard=2)
    assert pair_seed(s_ab, 1, 0) != pair_seed(s_ab, 1, 1)


def test_a_share_decrypts_only_where_and_when_it_was_meant_for():
    secret = os.urandom(32)
    blob = encrypt_share(secret, 0, 3, "a", "b", b"x" * shamir.SHARE_BYTES)
    assert decrypt_share(secret, 0, 3, "a", "b", blob) == b"x" * shamir.SHARE_BYTES
    for args in ((0, 4, "a", "b"), (1, 3, "a", "b"), (0, 3, "c", "b")):
        with pytest.raises(ValueError, match="does not authenticate"):
            decrypt_share(secret, *args, blob)


def _maskers(n: int = 3) -> list[ShardMasker]:
    job = parse_spec({"name": "j", "framework": "torch", "entrypoint": "t.py",
                      "sites": {f"s{i}": {} for i in range(n)}, "ps": {"secure_aggregation": {"threshold": 2}}})
    settings = SecAggSettings.resolve(job.ps, job.sites)
    ms = [ShardMasker(f"s{i}-0", 0, settings) for i in range(n)]
    roster = {m.me: m.keypair.public for m in ms}
    for m in ms:
        assert m.set_roster(1, 2, roster)
    return ms


def test_a_survivor_never_reveals_a_share_and_a_pair_seed_of_the_same_pusher():
    a, b, c = _maskers()
    for m in (a, b, c):
        m.mask(5, np.zeros(10, np.float32))
    with pytest.raises(ProtocolError, match="both survivor and dropped"):
        a.answer(5, ["s0-0", "s1-0"], ["s1-0", "s2-0"], {})
    assert not a._open[5]["answered"]
    shares, seeds = a.answer(5, ["s0-0", "s1-0"], ["s2-0"], {"s1-0": _share_for(b, a, 5)})
    assert set(shares) == {"s0-0", "s1-0"} and set(seeds) == {"s2-0"}
    with pytest.raises(ProtocolError, match="asked twice"):
        a.answer(5, ["s0-0", "s1-0", "s2-0"], [], {})
    with pytest.raises(ProtocolError, match="did not mask"):
        a.answer(6, ["s0-0"], [], {})


def _share_for(sender: ShardMasker, recipient: ShardMasker, rnd: int) -> bytes:
    _, shares = sender.mask(rnd, np.zeros(10, np.float32))
    return dict(shares)[recipient.me]


def test_settings_follow_the_codec_and_count_site_leaders_as_one_pusher():
    job = parse_spec({"name": "j", "framework": "torch", "entrypoint": "t.py",
                      "sites": {"h": {"workers": 3, "aggregate": True}, "c": {"workers": 2}},
                      "ps": {"secure_aggregation": {"clip": 0.5}, "compression": {"codec": "int8"}}})
    s = SecAggSettings.resolve(job.ps, job.sites)
    assert pusher_ids(job.sites) == ["c-0", "c-1", "h-0"] and s.pushers == ("c-0", "c-1", "h-0")
    assert s.bits == 16 and s.limit == 32767 // 3 and s.clip == 0.5 and s.codec_name == "secagg16"
    assert s.threshold_for(3) == default_threshold(3) == 3 and default_threshold(10) == 7
    int4 = parse_spec({"name": "j", "framework": "torch", "entrypoint": "t.py", "sites": {"h": {"workers": 2}},
                       "ps": {"secure_aggregation": True, "compression": {"codec": "int4"}}})
    assert SecAggSettings.resolve(int4.ps, int4.sites).bits == 16  # a dense quantiser: the 16-bit ring replaces it


@pytest.mark.parametrize("ps, message", [
    ({"compression": {"codec": "topk"}}, "codec 'topk' keeps different coordinates on each pusher"),
    ({"compression": {"codec": "sign"}}, "codec 'sign' keeps different coordinates"),
    ({"aggregate": "median"}, "aggregate rule median needs each pusher's update in the clear"),
    ({"aggregate": {"rule": "trimmed_mean"}}, "rule trimmed_mean needs each pusher's update"),
    ({"sync": "asp"}, "needs rounds that close together .sync: bsp or local.; sync is 'asp'"),
    ({"sync": "ssp"}, "sync is 'ssp'"),
    ({"compression": {"codec": "randomk", "momentum": 0.9}}, "momentum and warmup_steps are not supported"),
    ({"secure_aggregation": {"threshold": 9}}, "threshold: 9 exceeds the job's 3 pushers"),
    ({"secure_aggregation": {"threshold": 1}}, "threshold"),
    ({"secure_aggregation": {"clip": 0}}, "clip"),
    ({"secure_aggregation": {"bits": 8}}, "bits"),
])
def test_combinations_that_cannot_be_masked_are_refused_with_the_reason(ps, message):
    job = {"name": "j", "framework": "torch", "entrypoint": "t.py", "sites": {"a": {}, "b": {}, "c": {}},
           "ps": {"secure_aggregation": True, **ps}}
    with pytest.raises(SpecError, match=message):
        parse_spec(job)


def test_masking_accepts_norm_clip_randomk_and_local_sgd():
    for ps in ({"aggregate": {"rule": "norm_clip", "clip_norm": 1.0}}, {"compression": {"codec": "randomk"}},
               {"sync": "local"}, {"secure_aggregation": False}):
        job = parse_spec({"name": "j", "framework": "torch", "entrypoint": "t.py", "sites": {"a": {}, "b": {}},
                          "ps": {"secure_aggregation": True, **ps}})
        assert (job.ps.secure_aggregation is None) == (ps == {"secure_aggregation": False})
