"""A worker's push and pull make no copy of the model: raw frames are sent from the gradient's own
memory and pulled values land in the session's parameters, the same buffers step after step.

The shard runs in its own process (``hfleet ps serve``), so tracemalloc in this process sees the
worker's allocations only. Figures asserted are memory, never time.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
import yaml

from hybridfleet.codec import get_codec
from hybridfleet.codec.frame import FrameParts, frame_pieces
from hybridfleet.ps.worker.client import ClientSecurity
from hybridfleet.ps.worker.session import PSSession, WorkerConfig
from hybridfleet.spec import load_spec
from tests.ps_helpers import initial_values, join_and_init, start_cluster

REPO = Path(__file__).resolve().parents[1]
MODEL_BYTES = 32 << 20
SHAPES = {"a.weight": (MODEL_BYTES // 8,), "b.weight": (MODEL_BYTES // 16, 2)}  # 32 MiB of float32
LR = 0.5


def test_raw_frame_parts_share_the_gradient_and_equal_the_packed_frame():
    # Prepare
    codec = get_codec("none")
    x = np.linspace(-1, 1, 1000, dtype=np.float32)

    # Execute
    parts = codec.encode_parts(x)
    strided = codec.encode_parts(x[::2])

    # Assert: the values piece is x's own memory; the bytes are the frame encode() makes
    assert isinstance(parts, FrameParts)
    assert np.shares_memory(np.frombuffer(parts.parts[-1], np.uint8), x)
    assert bytes(parts) == bytes(codec.encode(x)) and len(parts) == len(codec.encode(x))
    np.testing.assert_array_equal(codec.decode(bytes(parts)), x)
    assert bytes(strided) == bytes(codec.encode(x[::2]))  # a non-contiguous view: one packed copy
    assert frame_pieces(b"abc") == (b"abc",)


def test_raw_frame_parts_refuse_what_encode_refuses():
    # Prepare
    codec = get_codec("none")
    bad = np.array([1.0, np.nan], np.float32)

    # Execute / Assert: the same errors as encode(), and the input is left as it was
    with pytest.raises(ValueError, match="cannot encode a gradient holding NaN or Inf"):
        codec.encode_parts(bad)
    with pytest.raises(TypeError, match="encodes numpy arrays"):
        codec.encode_parts([1.0, 2.0])
    assert np.isnan(bad[1]) and bad[0] == 1.0


@pytest.fixture
def shard(tmp_path):
    """One plaintext shard process (no auth) for one worker; yields (job spec, address)."""
    job = {"name": "push-memory", "framework": "torch", "entrypoint": "unused.py",
           "sites": {"a": {"workers": 1}},
           "ps": {"shards": 1, "sync": "bsp", "optimizer": {"name": "sgd", "lr": LR},
                  "block_size_bytes": 8 << 20, "heartbeat_timeout_s": 60},
           "security": {"tls": "off", "tokens": "off"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    port_file = tmp_path / "shard.port"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HFLEET_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "ps", "serve", str(path), "--shard", "0",
                             "--port", "0", "--port-file", str(port_file), "--expected-workers", "1",
                             "--insecure-plaintext", "--no-auth"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the shard did not start"
            time.sleep(0.05)
        yield load_spec(path), port_file.read_text().strip()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_step_of_a_32_mib_model_allocates_far_less_than_the_model_and_reuses_the_parameters(shard):
    # Prepare: a session against the shard, one warm-up step
    spec, address = shard
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}
    grads = {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}
    session = PSSession(SHAPES, WorkerConfig(job=spec, site="a", servers=[address],
                                             security=ClientSecurity(insecure=True)), "torch")
    try:
        session.start(params)
        assert session.client.transport == ["bulk"]
        session.step(grads)
        addresses = {k: v.ctypes.data for k, v in session._flat.items()}

        # Execute: one traced step, then another
        tracemalloc.start()
        try:
            session.step(grads)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        out = session.step(grads)

        # Assert: no frame or receive copy of the model (a packed frame alone would be 32 MiB; what
        # remains is the finiteness checks' boolean temporaries, a quarter of one block or tensor)
        assert peak < MODEL_BYTES // 4, f"one step allocated {peak} bytes for a {MODEL_BYTES}-byte model"
        assert {k: v.ctypes.data for k, v in session._flat.items()} == addresses
        for k, v in out.items():
            assert np.shares_memory(v, session._flat[k])
            # equivalence: three SGD steps of the same gradient, as the shard applies them
            np.testing.assert_allclose(v, params[k] - 3 * LR * grads[k], rtol=0, atol=1e-5)
    finally:
        session.close()


def _push_constant(client, g: float) -> None:
    """Push round 0's gradient ``g`` for every parameter, raw, block by block of the client's plan."""
    blocks = {k: get_codec("none").encode(part) for name, v in initial_values().items()
              for k, part in client.plan.split(name, np.full(v.size, g, np.float32)).items()}
    client.push(blocks, codec="none", base_versions=[0])


@contextlib.contextmanager
def _two_joined_workers(tmp_path):
    """One BSP shard (SGD lr 0.5) and two workers a, b joined on it (a initialised the values)."""
    cluster = start_cluster(tmp_path)
    a, b = cluster.client("a"), cluster.client("b")
    try:
        join_and_init(cluster, a)
        join_and_init(cluster, b, init=False)
        yield cluster, cluster.servers[0].state, a, b
    finally:
        a.close()
        b.close()
        cluster.stop()


def test_bsp_shard_lets_go_of_its_wire_pieces_once_every_worker_pulled_the_round(tmp_path):
    # Prepare: two workers, one BSP shard, one round pushed by both
    with _two_joined_workers(tmp_path) as (cluster, state, a, b):
        for client, g in ((a, 1.0), (b, 3.0)):
            _push_constant(client, g)
        assert state.version == 1

        # Execute / Assert: the pieces cut for a's pull (views of the parameters: no copy in bsp)
        # stay until b has pulled the same version too
        pulled_a = a.pull(wait_for_versions=[1])
        assert state._wire_cache, "the first puller's pieces are kept for the others"
        assert all(values is state.params[key] for key, (_, values, _) in state._wire_cache.items())
        pulled_b = b.pull(wait_for_versions=[1])
        assert state._wire_cache == {}

        # Assert: both got the round's values (SGD lr 0.5 on the mean gradient 2.0), and a repeated
        # full pull is still answered
        expected = initial_values()["fc.bias"] - 1.0
        for pulled in (pulled_a, pulled_b, a.pull(full=True)):
            got = next(p for p in pulled if p.key.startswith("fc.bias"))
            np.testing.assert_allclose(np.frombuffer(got.payload(), np.float32), expected, rtol=1e-6)


def test_a_worker_joining_with_other_values_receives_the_jobs_values_in_place(shard):
    # Prepare: the shard initialised by one session, which then leaves
    spec, address = shard
    rng = np.random.default_rng(1)
    job_values = {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}
    own_values = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}

    def session() -> PSSession:
        return PSSession(SHAPES, WorkerConfig(job=spec, site="a", servers=[address],
                                              security=ClientSecurity(insecure=True)), "torch")

    first = session()
    first.start(job_values)
    first.close()
    joiner = session()
    try:
        # Execute: a start whose values differ from the job's, so every value is pulled
        tracemalloc.start()
        try:
            out = joiner.start(own_values)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

        # Assert: the session's one copy of the parameters, and no receive buffer beside it
        assert peak < MODEL_BYTES + MODEL_BYTES // 4, f"start allocated {peak} bytes for a {MODEL_BYTES}-byte model"
        for k, v in out.items():
            np.testing.assert_array_equal(v, job_values[k])
    finally:
        joiner.close()


def test_bsp_round_sums_are_let_go_once_the_round_is_applied(tmp_path):
    # Prepare: two workers, one BSP shard; the first push's values become the round's sums
    with _two_joined_workers(tmp_path) as (cluster, state, a, b):
        _push_constant(a, 1.0)
        sums = [weakref.ref(arr) for arr in state.rounds[0].sums.values()]
        assert sums and all(r() is not None for r in sums)
        alive_when_applied = []
        state.on_applied = lambda: alive_when_applied.append(sum(r() is not None for r in sums))

        # Execute: the second push closes and applies the round
        _push_constant(b, 3.0)

        # Assert: applied (SGD lr 0.5 on the mean 2.0); every sum was let go within the apply, before
        # the push that closed the round returned
        assert state.version == 1 and state.rounds == {}
        assert alive_when_applied == [0]
        np.testing.assert_allclose(cluster.params()["fc.bias"], initial_values()["fc.bias"] - 1.0, rtol=1e-6)


def test_the_push_that_closes_a_bsp_round_lets_go_of_its_buffers_before_the_step(tmp_path, monkeypatch):
    # Prepare: two workers on the bulk plane, one BSP shard with the job's optimizer; every push
    # buffer the shard receives is watched (weak references to what the bulk server's reads return)
    from hybridfleet.ps.server import bulk_server

    received: list[weakref.ref] = []
    real_recv = bulk_server.recv_exact

    def watched_recv(conn, n):
        buf = real_recv(conn, n)
        received.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(bulk_server, "recv_exact", watched_recv)
    with _two_joined_workers(tmp_path) as (cluster, state, a, b):
        _push_constant(a, 1.0)
        first = len(received)  # b's buffers are the reads from here on
        alive_in_step = []
        real_step = state.optimizer.step

        def step(key, param, grad):
            alive_in_step.append(sum(r() is not None for r in received[first:]))
            real_step(key, param, grad)

        state.optimizer.step = step

        # Execute: b's push closes and applies the round
        _push_constant(b, 3.0)

        # Assert: b's buffers were read, and none was alive while the round's keys were stepped
        assert len(received) > first
        assert state.version == 1 and alive_in_step and set(alive_in_step) == {0}
        np.testing.assert_allclose(cluster.params()["fc.bias"], initial_values()["fc.bias"] - 1.0, rtol=1e-6)
