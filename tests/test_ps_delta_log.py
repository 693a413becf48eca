"""The compressed downlink's delta log: bounded in bytes, never costlier than values, counted in the budget.

Real TLS + token shards on 127.0.0.1 (bulk plane), fp16 downlink, ASP; a worker's view is rebuilt
from its pulls the way `PSSession` applies them and compared bit for bit with the shard's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.ps.wire.bulk import BulkError
from hybridfleet.ps.wire.sharding import ParamSpec
from tests.ps_helpers import start_cluster
from tests.test_ps_compression import _session_values

FP16 = get_codec("fp16")


def _cluster(tmp_path, params: list[ParamSpec], **ps):
    cluster = start_cluster(tmp_path, sync="asp", compression={"codec": "fp16"}, **ps)
    clients = [cluster.client(site) for site in ("a", "b")]
    for c in clients:
        c.join(params, cluster.spec.ps.block_size_bytes, "fp16", "torch")
    init = {p.name: np.linspace(-1, 1, int(np.prod(p.shape)), dtype=np.float32) for p in params}
    clients[0].push({k: v.tobytes() for k, v in init.items()}, codec="none", kind="INIT")
    return cluster, clients


def _push(client, params: list[ParamSpec], rng) -> None:
    client.push({p.name: FP16.encode(rng.standard_normal(int(np.prod(p.shape))).astype(np.float32))
                 for p in params}, codec="fp16")


def _pull(client, flat) -> tuple[list, int]:
    """Apply one pull to ``flat``; returns its entries and the value bytes it moved."""
    before = client.bytes.received.get("params", 0)
    pulled = client.pull()
    _session_values(client, pulled, flat, "fp16")
    return pulled, client.bytes.received["params"] - before


def test_a_far_behind_pull_moves_no_more_than_the_dense_bytes_and_rebuilds_the_shards_values(tmp_path):
    # Prepare: a 16 KiB key; b follows with a full pull, a pushes
    params = [ParamSpec("w", (4096,))]
    cluster, (a, b) = _cluster(tmp_path, params)
    state = cluster.servers[0].state
    try:
        flat = {"w": np.zeros(4096, np.float32)}
        _session_values(b, b.pull(full=True), flat, "fp16")
        rng = np.random.default_rng(0)
        dense = 4096 * 4
        # Execute: one version behind, then many
        _push(a, params, rng)
        near, near_bytes = _pull(b, flat)
        for _ in range(12):
            _push(a, params, rng)
            status = state.status()
            assert 0 < status["delta_log_bytes"] <= status["delta_log_bound_bytes"] == dense
        far, far_bytes = _pull(b, flat)
        # Assert: one behind gets the delta (half the values), many behind the values, never more
        assert [e.delta_version for e in near] == [1] and near_bytes < dense
        assert [e.delta_version for e in far] == [0] and far_bytes == dense
        np.testing.assert_array_equal(flat["w"], state.broadcast["w"])
        _push(a, params, rng)  # and deltas resume from there
        again, _ = _pull(b, flat)
        assert [e.delta_version for e in again] == [state.version]
        np.testing.assert_array_equal(flat["w"], state.broadcast["w"])
    finally:
        a.close()
        b.close()
        cluster.stop()


def test_what_the_delta_log_holds_counts_in_the_memory_budget_and_a_push_beyond_the_rest_is_refused(tmp_path):
    # Prepare: a 768 KiB slice under a 1 MiB budget (the log may hold 512 KiB); one fp16 version logged
    params = [ParamSpec("w", (196608,))]
    cluster, (a, b) = _cluster(tmp_path, params, memory_budget_bytes=1 << 20)
    state = cluster.servers[0].state
    try:
        _push(a, params, np.random.default_rng(0))
        held = state.status()["delta_log_bytes"]
        assert state.status()["delta_log_bound_bytes"] == 512 << 10 and 384 << 10 < held <= 512 << 10
        before_version, before = state.version, state.snapshot_arrays()["w"]
        # Execute: a push declaring 700 KiB (within the key's frame cap and the whole budget, not with the log)
        with pytest.raises(BulkError) as err:
            a.push({"w": b"\0" * (700 << 10)}, codec="fp16")
        # Assert: refused for the log's share, nothing changed
        assert (f"push of {700 << 10} bytes exceeds the shard's memory budget of 1048576 bytes less the {held} "
                "bytes its compressed downlink's delta log holds (ps.memory_budget_bytes)") in str(err.value)
        assert state.version == before_version and state.status()["applied_pushes"] == 1
        np.testing.assert_array_equal(state.snapshot_arrays()["w"], before)
    finally:
        a.close()
        b.close()
        cluster.stop()
