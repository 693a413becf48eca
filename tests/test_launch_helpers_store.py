"""Launch helpers write checkpoints to a remote store when HFLEET_CKPT_DIR is a URL (pods lose their own disk).

The store's credentials come from the standard AWS variables, as a rendered pod gets them
from its optional store Secret; the endpoint is a real SeaweedFS S3 server.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.ckpt import list_checkpoints
from hybridfleet.launch import helpers

pytest_plugins = ["tests.seaweed"]


def test_save_rank0_and_latest_checkpoint_round_trip_through_s3(monkeypatch, seaweed, s3_url):
    # Prepare: what a pod of `hfleet k8s render` sees (--ckpt-dir s3://..., credentials from the store Secret)
    monkeypatch.setenv("HFLEET_CKPT_DIR", s3_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    state = {"layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}

    # Execute
    written = helpers.save_rank0(state, step=7)
    found = helpers.latest_checkpoint()

    # Assert
    assert str(written).startswith(s3_url)
    assert found is not None and found.step == 7
    np.testing.assert_array_equal(found.state["layer.weight"], state["layer.weight"])
    assert [c.step for c in list_checkpoints(s3_url, endpoint_url=seaweed.endpoint_url, key=seaweed.key,
                                             secret=seaweed.secret)] == [7]
    assert helpers.ckpt_dir() is None  # no local directory stands in for the URL
