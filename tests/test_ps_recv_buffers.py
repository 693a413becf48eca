"""Push receive buffers kept across rounds (`hybridfleet.ps.server.recv_buffers`).

The pool is exercised alone (every way a buffer's memory can still be reached keeps it out of
reuse) and behind a real bulk plane (TLS, tokens, real sockets): bsp rounds whose payloads land
in reused buffers give the parameters plain arithmetic gives.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hybridfleet.codec import get_codec
from hybridfleet.ps.server.recv_buffers import ReceiveBuffers
from tests.ps_helpers import initial_values, join_and_init, start_cluster

MIB = 1 << 20


def _reachable_ways(buf: np.ndarray):
    """Objects that keep ``buf``'s memory reachable the way the shard's code does."""
    yield "slice", buf[8:]
    yield "float view", np.frombuffer(buf, np.float32)
    yield "memoryview", memoryview(buf)
    yield "memoryview slice", memoryview(buf)[4:]
    yield "frombuffer of memoryview", np.frombuffer(memoryview(buf)[4:], np.uint8)
    yield "reshaped view", buf.view(np.float32).reshape(-1, 2)


@pytest.mark.parametrize("way", [name for name, _ in _reachable_ways(np.empty(16, np.uint8))])
def test_a_buffer_that_can_still_be_reached_is_not_handed_out_again(way):
    # Prepare: a pool that keeps buffers from 1 byte up, one buffer taken and something derived from it
    pool = ReceiveBuffers(min_bytes=1)
    first = pool.take(MIB)
    holder = dict(_reachable_ways(first))[way]
    first_address = first.__array_interface__["data"][0]
    del first
    # Execute: take another buffer of the same size while the derived object lives, then after it is gone
    second = pool.take(MIB)
    during = second.__array_interface__["data"][0]
    del holder, second
    third = pool.take(MIB)
    # Assert: not reused while reachable; reused (the same memory) once nothing holds it
    assert during != first_address
    assert third.__array_interface__["data"][0] in (first_address, during)
    assert pool.reused == 1 and pool.made == 2


def test_idle_buffers_beyond_the_peak_in_use_are_let_go():
    # Prepare: three 1 MiB buffers in use at once (the peak), then all idle
    pool = ReceiveBuffers(min_bytes=1)
    held = [pool.take(MIB) for _ in range(3)]
    assert pool.peak_in_use == 3 * MIB
    del held
    # Execute: take sizes no idle buffer fits (more than twice as large, then smaller than half)
    big = pool.take(3 * MIB)
    small = pool.take(MIB // 4)
    # Assert: the kept bytes never exceed the peak in use (the idle ones made room), and what is
    # handed out has the asked size
    assert pool.kept_bytes() <= pool.peak_in_use
    assert big.size == 3 * MIB and small.size == MIB // 4
    assert pool.made == 5 and pool.reused == 0


def test_a_buffer_fits_between_the_size_and_twice_the_size():
    pool = ReceiveBuffers(min_bytes=1)
    a = pool.take(2 * MIB)
    address = a.__array_interface__["data"][0]
    del a
    b = pool.take(MIB)  # 2 MiB fits 1 MiB
    assert b.size == MIB and b.__array_interface__["data"][0] == address
    del b
    c = pool.take(MIB // 2 - 1)  # does not fit: a new one
    assert c.__array_interface__["data"][0] != address


def test_small_payloads_are_not_kept():
    pool = ReceiveBuffers()  # the default minimum, 4 MiB
    for _ in range(3):
        pool.take(MIB)
    assert pool.kept_bytes() == 0 and pool.made == 0


def test_threads_taking_and_dropping_never_share_memory():
    # Prepare: 4 threads, each holding up to 2 buffers of mixed sizes, writing their own mark in them
    pool = ReceiveBuffers(min_bytes=1)
    errors: list[str] = []

    def run(mark: int) -> None:
        rng = np.random.default_rng(mark)
        held: list[np.ndarray] = []
        for _ in range(300):
            buf = pool.take(int(rng.integers(1, 4)) * 64 * 1024)
            buf[:] = mark
            held.append(buf)
            if len(held) > 2:
                old = held.pop(0)
                if not (old == mark).all():  # someone else wrote into a buffer this thread holds
                    errors.append(f"thread {mark}: a held buffer was handed to another thread")
    threads = [threading.Thread(target=run, args=(m,)) for m in range(1, 5)]
    # Execute
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Assert: no buffer was ever handed out while another thread held it, and buffers were reused
    assert errors == []
    assert pool.reused > 0


def test_bsp_rounds_through_the_bulk_plane_in_reused_buffers_give_plain_arithmetics_values(tmp_path):
    # Prepare: one bsp shard (SGD lr 0.5) over TLS and tokens whose pool keeps buffers of any size,
    # two workers joined
    cluster = start_cluster(tmp_path)
    pool = cluster.servers[0].bulk.receive_buffers
    pool.min_bytes = 1
    a, b = cluster.client("a"), cluster.client("b")
    try:
        join_and_init(cluster, a)
        join_and_init(cluster, b, init=False)
        expected = {k: v.reshape(-1).astype(np.float32) for k, v in initial_values().items()}
        rng = np.random.default_rng(0)
        for step in range(1, 6):
            grads = {w: {k: rng.standard_normal(v.size).astype(np.float32) for k, v in expected.items()}
                     for w in ("a", "b")}
            # Execute: both push the round (each push's payloads land in the pool's buffers), then pull
            for w, client in (("a", a), ("b", b)):
                blocks = {}
                for name, g in grads[w].items():
                    blocks.update(client.plan.split(name, g))
                client.push({k: get_codec("none").encode(v) for k, v in blocks.items()}, codec="none",
                            base_versions=[step - 1])
            for name in expected:
                expected[name] = expected[name] - np.float32(0.5) * ((grads["a"][name] + grads["b"][name]) / 2)
            pulled = {p.key: np.frombuffer(p.payload(), np.float32) for p in a.pull(wait_for_versions=[step])}
            # Assert: the shard's values equal plain arithmetic's after every round
            for name, want in expected.items():
                got = np.concatenate([pulled[k] for k in sorted(pulled) if k.startswith(name)])
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert pool.reused > 0, "later rounds' payloads landed in kept buffers"
    finally:
        a.close()
        b.close()
        cluster.stop()
