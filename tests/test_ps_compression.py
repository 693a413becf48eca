"""Compressed uplink and downlink through real shards, and site aggregation end to end."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from hybridfleet.codec import ErrorFeedback, get_codec
from hybridfleet.ps.wire.sharding import ParamSpec
from tests.ps_helpers import PARAMS, start_cluster
from tests.test_ps_run import _job


def _session_values(client, pulled, flat, codec_name: str = "topk"):
    """Apply a pull's entries to ``flat`` (param -> flat array) the way a worker does."""
    from hybridfleet.ps.worker.session import PSSession

    session = PSSession.__new__(PSSession)
    session.plan, session._flat, session._down_codec, session.codec_name = client.plan, flat, None, codec_name
    session._block_index = None
    session._apply_pulled(pulled)
    return flat


@pytest.fixture
def topk_cluster(tmp_path):
    c = start_cluster(tmp_path, sync="asp", compression={"codec": "topk", "ratio": 0.25})
    yield c
    c.stop()


def test_unknown_or_other_codec_is_refused_at_join_with_a_message(topk_cluster):
    client = topk_cluster.client("a")
    with pytest.raises(grpc.RpcError) as err:
        client.join(PARAMS, topk_cluster.spec.ps.block_size_bytes, "zstd", "torch")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "codec 'zstd' does not match this job's codec 'topk'" in err.value.details()
    client.close(leave=False)


def test_compressed_downlink_deltas_rebuild_the_same_values_as_a_full_pull(topk_cluster):
    # Prepare: two workers; one follows every version's delta, the other pulls values at the end.
    # Keys of 256 and 64 elements: their top-k frames are smaller than their values, so deltas are sent
    wide = [ParamSpec("fc.weight", (64, 4)), ParamSpec("fc.bias", (64,))]
    a, b = topk_cluster.client("a"), topk_cluster.client("b")
    for c in (a, b):
        c.join(wide, topk_cluster.spec.ps.block_size_bytes, "topk", "torch")
    a.push({p.name: np.linspace(-1, 1, int(np.prod(p.shape)), dtype=np.float32).tobytes() for p in wide},
           codec="none", kind="INIT")
    flat = {p.name: np.zeros(int(np.prod(p.shape)), np.float32) for p in wide}
    _session_values(a, a.pull(full=True), flat)
    feedback = ErrorFeedback(get_codec("topk", ratio=0.25))
    rng = np.random.default_rng(0)
    # Execute: 10 sparse pushes, a pulling deltas after each
    for _ in range(10):
        payloads = {}
        for p in wide:
            for key, part in a.plan.split(p.name, rng.standard_normal(int(np.prod(p.shape))).astype(np.float32)).items():
                payloads[key] = feedback.encode(key, part)
        a.push(payloads, codec="topk")
        pulled = a.pull()
        assert all(e.delta_version > 0 for e in pulled)  # deltas, not values
        _session_values(a, pulled, flat)
    full = {p.name: np.zeros(int(np.prod(p.shape)), np.float32) for p in wide}
    _session_values(b, b.pull(full=True), full)
    # Assert: bit-identical to the shard's broadcast values, and to the full pull
    state = topk_cluster.servers[0].state
    for p in wide:
        np.testing.assert_array_equal(flat[p.name], full[p.name])
        np.testing.assert_array_equal(flat[p.name], state.broadcast[p.name])
    # accounting: what `a` received after its full pull (320 values) is exactly the encoded deltas
    status = state.status()
    assert a.bytes.received["params"] == 320 * 4 + status["downlink_encoded_bytes"]
    a.close()
    b.close()


@pytest.mark.slow
@pytest.mark.parametrize("example,codec,aggregate", [
    ("digits-hybrid.yaml", {"codec": "topk", "ratio": 0.05}, True),
    ("digits-hybrid-paddle.yaml", {"codec": "sign"}, False),
])
def test_compressed_job_trains_and_every_worker_holds_identical_parameters(tmp_path, example, codec, aggregate):
    from hybridfleet.launch.psjob import run_ps_job
    from hybridfleet.spec import load_spec

    job = _job(tmp_path, example, train__site_baselines=False)
    import yaml

    data = yaml.safe_load(job.read_text())
    data["ps"]["compression"] = {**codec, "error_feedback": True}
    data["ps"]["optimizer"] = {"name": "sgd", "lr": 0.3}  # the spec refuses the examples' server Adam with top-k/sign
    for site in data["sites"].values():
        site["aggregate"] = aggregate
    job.write_text(yaml.safe_dump(data))
    summary = run_ps_job(load_spec(job), job, echo=False, show_progress=False, run_root=tmp_path / "runs")
    assert summary["status"] == "completed", summary
    assert summary["test_accuracy"] >= 0.9
    finals = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
              if '"final": true' in line]
    assert len(finals) == 4
    assert len({f["params_sha256"] for f in finals}) == 1
    if aggregate:
        followers = [f for f in finals if f["worker"].endswith("-1")]
        assert followers and all(f["sent"] == 0 and f["site_lan_bytes"] > 0 for f in followers)
