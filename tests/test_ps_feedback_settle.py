"""Error feedback loses nothing: a residual is committed only when its push is applied."""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.codec import ErrorFeedback, get_codec
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.session import PSSession, WorkerConfig
from hybridfleet.security import load_pki
from tests.ps_helpers import initial_values, start_cluster

SHAPES = {k: v.shape for k, v in initial_values().items()}


def _grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def test_staged_encoding_is_dropped_by_discard_and_kept_by_commit():
    # Prepare: one committed push, so the key has a residual
    fb = ErrorFeedback(get_codec("topk", ratio=0.25))
    g = np.linspace(-1, 1, 16, dtype=np.float32)
    fb.encode("k", g)
    before = fb.residual("k")
    # Execute: a staged encoding that is discarded, then one that is committed
    fb.encode("k", g * 3, stage=True)
    assert fb.staged and np.array_equal(fb.residual("k"), before)
    assert fb.discard() == ["k"]
    after_discard = fb.residual("k")
    payload = fb.encode("k", g * 3, stage=True)
    fb.commit()
    # Assert: discard restored the residual bit for bit; commit holds corrected - sent
    assert np.array_equal(after_discard, before)
    expected = g * 3 + before - get_codec("topk", ratio=0.25).decode(payload)
    np.testing.assert_allclose(fb.residual("k"), expected, rtol=0, atol=1e-6)
    assert not fb.staged


def test_refused_push_leaves_the_residual_as_before_encoding_and_an_applied_one_commits_it(tmp_path):
    # Prepare: one worker, one shard, top-k with error feedback
    cluster = start_cluster(tmp_path, sites={"a": {"workers": 1}},
                            compression={"codec": "topk", "ratio": 0.25, "error_feedback": True})
    sec = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert), token=cluster.token("a"))
    session = PSSession(SHAPES, WorkerConfig(job=cluster.spec, site="a", servers=cluster.addresses, security=sec),
                        "torch")
    try:
        session.start(initial_values())
        session.step(_grads(1))  # applied: its residual is committed
        committed = {k: session.feedback.residual(k) for k in SHAPES}
        assert all(np.abs(r).sum() > 0 for r in committed.values())
        shard_before = cluster.params()
        # Execute: a push computed on an old version, which the shard refuses as stale
        session.client.versions = [v - 1 for v in session.client.versions]
        session.step(_grads(2))
        # Assert: refused, nothing applied, every residual exactly as before that encoding
        after_refusal = {k: session.feedback.residual(k) for k in SHAPES}
        for k in SHAPES:
            assert np.array_equal(after_refusal[k], committed[k]), k
            assert np.array_equal(cluster.params()[k], shard_before[k]), k
        assert not session.feedback.staged
        # Execute: the next push is applied again, and carries the kept residual
        g3 = _grads(3)
        session.step(g3)
        for k in SHAPES:
            assert not np.array_equal(session.feedback.residual(k), committed[k]), k
            # what was sent plus what is kept equals this gradient plus the residual it started from
            sent = committed[k].reshape(-1) + g3[k].reshape(-1) - session.feedback.residual(k)
            assert np.count_nonzero(np.abs(sent) > 1e-6) <= int(np.ceil(0.25 * g3[k].size)), k
    finally:
        session.close()
        cluster.stop()
