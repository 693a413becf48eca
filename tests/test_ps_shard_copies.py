"""One copy of each thing: a snapshot shares the per-version copy pullers are sent, and keeps its version.

A real `ShardState` (no network: the copies are made behind the shard's lock).
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.ps.server.shard import ShardState
from hybridfleet.ps.server.snapshot import capture
from tests.ps_helpers import PARAMS, initial_values, job_spec, raw


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_snapshot_shares_the_pullers_copy_and_later_pushes_do_not_change_it(codec):
    # Prepare: an initialised asp shard (adam: optimizer slots in the snapshot) and one applied push
    spec = job_spec(sync="asp", optimizer={"name": "adam", "lr": 0.1}, compression={"codec": codec}).ps
    state = ShardState(0, spec, sites={"a": 1, "b": 1})
    state.join("a-0", "a", PARAMS, 1, spec.block_size_bytes, codec)
    state.push("a-0", "a", "INIT", 0, 0, "none", raw(initial_values()))
    enc = get_codec(codec)
    grad = {k: enc.encode(np.full(state.params[k].size, 0.5, np.float32)) for k in state.keys}
    state.push("a-0", "a", "GRADIENT", 1, 0, codec, grad)
    # Execute: capture, then a pull at that version, then another push
    version, tensors, _ = capture(state)
    _, pulled = state.pull("a-0", -1, -1, 1, 5.0)
    at_capture = {k: np.array(v) for k, v in tensors.items()}
    state.push("a-0", "a", "GRADIENT", 2, 1, codec, grad)
    # Assert: the values pullers were sent and the snapshot are one copy; it still holds version 1
    sent = "broadcast" if codec != "none" else "param"
    for key, pieces, _, _ in pulled:
        assert np.shares_memory(tensors[f"{sent}/{key}"], np.frombuffer(pieces[0], np.uint8))
    assert version == 1 and state.version == 2
    for name, arr in tensors.items():
        np.testing.assert_array_equal(arr, at_capture[name])
    assert not np.array_equal(tensors["param/fc.bias"], state.params["fc.bias"])
    assert any(name.startswith("opt/") for name in tensors)
