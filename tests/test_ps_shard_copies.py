"""One copy of each thing: an asp shard's snapshot shares the per-version copy pullers are sent, a bsp
shard sends pulls from its parameters themselves, and a pull whose values change while sent is cut.

A real `ShardState` (no network: the copies are made behind the shard's lock).
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.ps.server.bulk_loop import FAILED
from hybridfleet.ps.server import downlink
from hybridfleet.ps.server.downlink import ValuesChanged, send_values
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
    # and the asp shard's copy is not the parameters themselves (a push may step them while a pull is sent)
    assert not any(np.shares_memory(state.params[key], np.frombuffer(pieces[0], np.uint8)) for key, pieces, _, _ in pulled)


def _bsp_shard_at_round_1() -> ShardState:
    """A bsp shard (SGD lr 0.5) with workers a-0 and b-0 whose first round closed."""
    spec = job_spec(sync="bsp", optimizer={"name": "sgd", "lr": 0.5}).ps
    state = ShardState(0, spec, sites={"a": 1, "b": 1})
    state.join("a-0", "a", PARAMS, 1, spec.block_size_bytes, "none")
    state.join("b-0", "b", PARAMS, 1, spec.block_size_bytes, "none")
    state.push("a-0", "a", "INIT", 0, 0, "none", raw(initial_values()))
    _round(state, 1, 1.0)
    return state


def _round(state: ShardState, step: int, g: float) -> None:
    grad = {k: get_codec("none").encode(np.full(state.params[k].size, g, np.float32)) for k in state.keys}
    for worker, site in (("a-0", "a"), ("b-0", "b")):
        state.push(worker, site, "GRADIENT", step, step - 1, "none", grad)


def test_a_bsp_shard_sends_pulls_from_its_parameters_and_a_snapshot_takes_its_own_copy():
    # Prepare: a bsp shard after one round
    state = _bsp_shard_at_round_1()
    assert state.version == 1 and state.sends_live_values
    # Execute: a pull and a snapshot at version 1, then the next round
    _, pulled = state.pull("a-0", -1, -1, 1, 5.0)
    views = pulled and all(np.shares_memory(state.params[key], np.frombuffer(pieces[0], np.uint8))
                           for key, pieces, _, _ in pulled)
    del pulled
    version, tensors, _ = capture(state)
    at_capture = {k: np.array(v) for k, v in tensors.items()}
    _round(state, 2, 1.0)
    # Assert: the pull's pieces were views of the parameters (no copy per version); the snapshot
    # is a copy of its own and still holds version 1 after the round changed the parameters
    assert views
    assert version == 1 and state.version == 2
    for name, arr in tensors.items():
        assert not any(np.shares_memory(arr, p) for p in state.params.values())
        np.testing.assert_array_equal(arr, at_capture[name])
    assert not np.array_equal(tensors["param/fc.bias"], state.params["fc.bias"])


def _received(sock) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 20):
        out += chunk
    return bytes(out)


def test_a_pull_sent_from_parameters_that_stay_put_arrives_whole():
    # Prepare: a bsp shard at version 1, a pull's items and a socket pair
    state = _bsp_shard_at_round_1()
    _, items = state.pull("a-0", -1, -1, 1, 5.0)
    expected = b"".join(state.params[key].tobytes() for key, _, _, _ in items)
    a, b = socket.socketpair()
    # Execute: send the values while nothing changes them
    with a, b:
        sender = threading.Thread(target=lambda: (send_values(a.sendall, items), a.shutdown(socket.SHUT_WR)))
        sender.start()
        got = _received(b)
        sender.join()
    # Assert: every byte, equal to the parameters of the version the pull names
    assert got == expected


def test_a_round_that_closes_while_a_pull_is_sent_steps_a_copy_and_the_pull_sends_its_version():
    # Prepare: a bsp shard at version 1 and a pull's items (views of the parameters), not sent yet
    state = _bsp_shard_at_round_1()
    _, items = state.pull("a-0", -1, -1, 1, 5.0)
    at_version_1 = {key: state.params[key].copy() for key, _, _, _ in items}
    # Execute: the next round closes (as when it closes without a worker whose pull is still being
    # sent), then the sender sends the items it was given before
    _round(state, 2, 1.0)
    a, b = socket.socketpair()
    with a, b:
        send_values(a.sendall, items)
        a.shutdown(socket.SHUT_WR)
        got = _received(b)
    # Assert: the round stepped copies (one per key the pull held), the pull sent version 1 whole,
    # and the shard holds version 2
    assert state.detached_values == len(items)
    assert got == b"".join(at_version_1[key].tobytes() for key, _, _, _ in items)
    assert state.version == 2
    for key, old in at_version_1.items():
        assert not np.array_equal(state.params[key], old)


def test_a_round_with_no_pull_in_flight_steps_the_parameters_in_place():
    state = _bsp_shard_at_round_1()
    state.pull("a-0", -1, -1, 1, 5.0)  # answered and let go
    arrays = {k: v for k, v in state.params.items()}
    _round(state, 2, 1.0)
    assert state.detached_values == 0
    assert all(state.params[k] is arrays[k] for k in arrays)


def test_a_pull_whose_parameters_change_while_it_is_sent_is_cut_one_byte_short(monkeypatch):
    # Prepare: a bsp shard at version 1 and a pull's items (views of the parameters); the shard
    # is made to miss that the pull still holds them, so the round writes the values in place
    state = _bsp_shard_at_round_1()
    _, items = state.pull("a-0", -1, -1, 1, 5.0)
    total = sum(state.params[key].nbytes for key, _, _, _ in items)
    monkeypatch.setattr(downlink, "held_elsewhere", lambda held, key: False)
    # Execute: the next round closes, then the sender sends the items it was given before
    _round(state, 2, 1.0)
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValuesChanged, match="changed while a pull was sent"):
            send_values(a.sendall, items)
        a.shutdown(socket.SHUT_WR)
        got = _received(b)
    # Assert: the frame is one byte short, so the worker cannot take values of two versions for
    # one; the round was applied as usual, and the error closes a bulk connection
    assert len(got) == total - 1
    assert state.version == 2 and state.detached_values == 0
    assert issubclass(ValuesChanged, FAILED)


def test_pulls_over_grpc_leave_the_parameters_to_be_stepped_in_place(tmp_path):
    # Prepare: a bsp shard with two workers on gRPC (real TLS, tokens); b pushes every round
    # without pulling, so the shard's pieces of each version stay cut when the next round closes
    from tests.ps_helpers import join_and_init, start_cluster
    from tests.test_ps_server import encoded, grads

    cluster = start_cluster(tmp_path, transport="grpc")
    try:
        a, b = cluster.client("a"), cluster.client("b")
        join_and_init(cluster, a)
        join_and_init(cluster, b, init=False)
        state = cluster.servers[0].state
        assert state.sends_live_values and a.transport == b.transport == ["grpc"]
        arrays = dict(state.params)
        # Execute: three rounds; a pulls each one after it closes
        for step in range(3):
            a.push(encoded(a, grads(1.0)), codec="none", base_versions=list(a.versions))
            b.push(encoded(b, grads(3.0)), codec="none", base_versions=[step])
            entries = a.pull(wait_for_versions=[step + 1])
            # Assert: a got this version's values, equal to the shard's parameters
            got = {e.key: np.frombuffer(b"".join(bytes(d) for _, d in e.pieces), "<f4") for e in entries}
            assert set(got) == set(state.params)
            for key, values in got.items():
                np.testing.assert_array_equal(values, state.params[key], err_msg=key)
        # Assert: no send was reading the parameters when a round closed, so none stepped a copy
        # (what the gRPC path keeps of a pull is its encoded messages, not views of the parameters)
        assert state.version == 3 and state.detached_values == 0
        assert all(state.params[k] is arrays[k] for k in arrays)
        a.close()
        b.close()
    finally:
        cluster.stop()
