"""The powersgd codec: the same math as PyTorch's powerSGD_hook, error feedback with a warm-start Q,
its layout rule, refused frames, and a real local-mode (DiLoCo) round through the shards."""

from __future__ import annotations

import struct
import threading
import tracemalloc

import numpy as np
import pytest

from hybridfleet.codec import ErrorFeedback, get_codec
from hybridfleet.codec.frame import pack_frame
from hybridfleet.codec.powersgd import PowerSGDCodec, near_square_rows, orthonormalise
from hybridfleet.errors import ProtocolError
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan, matrix_rows
from hybridfleet.spec import parse_spec

EPS32 = float(np.finfo(np.float32).eps)


def _rank(codec_payload: bytes) -> int:
    from hybridfleet.codec.frame import unpack_frame

    return struct.unpack("<III", unpack_frame(codec_payload, "powersgd", 4).fields[0])[2]


def _reference(matrix: np.ndarray, q0: np.ndarray) -> np.ndarray:
    """One PowerSGD iteration in float64 with numpy's QR: P P^T M for P = orth(M orth(q0))."""
    q, _ = np.linalg.qr(q0.astype(np.float64))
    p, _ = np.linalg.qr(matrix.astype(np.float64) @ q)
    return p @ (p.T @ matrix.astype(np.float64))


# --- equivalence with the real thing ---------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.torch
@pytest.mark.parametrize("rank", [2, 3])  # the hook orthogonalises with Gram-Schmidt up to rank 2, QR above
def test_decoded_approximation_equals_torch_powersgd_hook_on_the_same_matrix_and_q(gloo_world, rank):
    # Prepare: a real DDP model (gloo, one process) with torch's own PowerSGD hook from its third step
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    torch.manual_seed(3)
    model = torch.nn.Linear(48, 40, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                               random_seed=0)
    ddp.register_comm_hook(state, hook.powerSGD_hook)
    x, y = torch.randn(16, 48), torch.randn(16, 40)

    def gradient():
        model.zero_grad()
        ((ddp(x) - y) ** 2).sum().backward()
        return model.weight.grad.detach().clone()

    raw = gradient()  # steps 0 and 1 are plain allreduce (world size 1: the gradient itself)
    assert torch.equal(gradient(), raw)
    compressed = gradient()  # step 2: the hook's P Q^T of the same gradient (its error memory still zero)
    # the hook's first Q: torch.randn seeded from its numpy RandomState(random_seed)
    seed = np.random.RandomState(0).randint(1_000_000_000)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        q0 = torch.randn(1, 48, rank)[0].numpy()

    # Execute
    codec = PowerSGDCodec(rank=rank)
    payload, _ = codec.encode_warm(raw.numpy(), q0)
    decoded = codec.decode(payload)

    # Assert: the same approximation within float32 tolerance, and it is a real compression
    assert not torch.allclose(compressed, raw, atol=1e-3)
    np.testing.assert_allclose(decoded, compressed.numpy(), rtol=0, atol=1e-5 * float(raw.abs().max()))
    assert _rank(payload) == rank
    assert len(payload) < 4 * rank * (48 + 40) + 100 < raw.numpy().nbytes


@pytest.mark.paddle
def test_paddle_gradient_encodes_to_the_reference_approximation_through_error_feedback():
    # Prepare: a real paddle Linear's weight gradient, as numpy
    import paddle

    paddle.seed(5)
    layer = paddle.nn.Linear(30, 20)
    loss = (layer(paddle.randn([8, 30])) ** 2).sum()
    loss.backward()
    grad = layer.weight.grad.numpy()  # paddle's layout: (in, out) = (30, 20)
    codec = PowerSGDCodec(rank=2)
    q0 = np.random.default_rng((0, 30, 20)).standard_normal((20, 2)).astype(np.float32)  # the codec's seeded Q
    feedback = ErrorFeedback(codec)

    # Execute
    decoded = get_codec("powersgd").decode(feedback.encode("weight", grad))

    # Assert: the reference approximation; the residual holds exactly what was dropped
    np.testing.assert_allclose(decoded, _reference(grad, q0), rtol=0, atol=1e-5 * np.abs(grad).max())
    np.testing.assert_allclose(decoded + feedback.residual("weight"), grad, rtol=0, atol=1e-5 * np.abs(grad).max())


# --- exactness, error feedback, warm start -----------------------------------------------------


def test_rank_at_least_min_dims_reproduces_the_input_exactly():
    # Prepare
    x = np.random.default_rng(1).standard_normal((12, 7)).astype(np.float32)

    # Execute: rank >= min(12, 7) cannot save bytes, so the tensor travels dense
    payload = PowerSGDCodec(rank=7).encode(x)
    payload_big = PowerSGDCodec(rank=50).encode(x)

    # Assert
    assert _rank(payload) == 0 and _rank(payload_big) == 0
    np.testing.assert_array_equal(get_codec("powersgd").decode(payload), x)
    np.testing.assert_array_equal(get_codec("powersgd").decode(payload_big), x)


def test_a_matrix_of_rank_r_is_reproduced_by_rank_r_factors():
    # Prepare: an exactly rank-3 200 x 150 matrix
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((200, 3)) @ rng.standard_normal((3, 150))).astype(np.float32)

    # Execute
    payload = PowerSGDCodec(rank=3).encode(x)

    # Assert: 3 x (200 + 150) floats instead of 30,000, and the same matrix
    assert _rank(payload) == 3 and len(payload) < 4 * 3 * 350 + 100
    np.testing.assert_allclose(get_codec("powersgd").decode(payload), x, rtol=0, atol=1e-4 * np.abs(x).max())


def test_error_feedback_makes_the_sum_of_decoded_updates_converge_to_the_sum_of_inputs():
    # Prepare: noisy gradients of a full-rank 64 x 48 matrix, rank 2 a push (8x fewer floats)
    rng = np.random.default_rng(3)
    base = rng.standard_normal((64, 48)).astype(np.float32)
    feedback, decoder = ErrorFeedback(PowerSGDCodec(rank=2)), get_codec("powersgd")
    sum_in, sum_out, gaps = np.zeros((64, 48)), np.zeros((64, 48)), {}

    # Execute
    for step in range(1, 201):
        grad = base + 0.3 * rng.standard_normal((64, 48)).astype(np.float32)
        sum_in += grad
        sum_out += decoder.decode(feedback.encode("w", grad))
        if step in (10, 200):
            gaps[step] = np.linalg.norm(sum_out - sum_in) / np.linalg.norm(sum_in)

    # Assert: nothing is lost (decoded + residual == inputs); the relative gap shrinks like 1/T
    np.testing.assert_allclose(sum_out + feedback.residual("w"), sum_in, rtol=0, atol=1e-3 * np.abs(sum_in).max())
    assert gaps[200] < gaps[10] / 5 and gaps[200] < 0.1


def test_warm_start_converges_to_the_best_rank_r_approximation():
    # Prepare: a full-rank 80 x 60 matrix with singular values 10 ... 0.1
    rng = np.random.default_rng(4)
    u, _ = np.linalg.qr(rng.standard_normal((80, 80)))
    v, _ = np.linalg.qr(rng.standard_normal((60, 60)))
    singular = np.geomspace(10, 0.1, 60)
    x = ((u[:, :60] * singular) @ v.T).astype(np.float32)
    codec, q, errors = PowerSGDCodec(rank=2), None, []

    # Execute: each encoding starts from the previous one's Q (subspace iteration)
    for _ in range(6):
        payload, q = codec.encode_warm(x, q)
        errors.append(np.linalg.norm(codec.decode(payload) - x))

    # Assert: from the seeded Q's error down to the best rank-2 error (Eckart-Young)
    assert errors[0] == pytest.approx(np.linalg.norm(codec.decode(codec.encode(x)) - x), rel=1e-6)
    assert errors[-1] < errors[0] and errors[-1] == pytest.approx(np.linalg.norm(singular[2:]), rel=0.01)


def test_error_feedback_passes_each_keys_q_back_and_a_discarded_push_keeps_it():
    # Prepare
    rng = np.random.default_rng(5)
    g1, g2 = (rng.standard_normal((50, 40)).astype(np.float32) for _ in range(2))
    codec = PowerSGDCodec(rank=3)
    feedback = ErrorFeedback(codec)

    # Execute
    first = feedback.encode("w", g1)
    q1, residual = feedback.state_dict()["q/w"], feedback.residual("w")
    feedback.encode("w", g2 * 5, stage=True)
    feedback.discard()  # refused by the server: Q and residual stay as they were
    second = feedback.encode("w", g2)

    # Assert: the same frames as the bare codec chained by hand
    expected_first, expected_q1 = codec.encode_warm(g1, None)
    assert first == expected_first
    np.testing.assert_array_equal(q1, expected_q1)
    assert second == codec.encode_warm(g2 + residual, expected_q1)[0]
    feedback.reset("w")
    assert "q/w" not in feedback.state_dict()


def test_warm_start_q_survives_a_state_dict_round_trip_and_bad_q_is_refused():
    # Prepare
    x = np.random.default_rng(6).standard_normal((40, 30)).astype(np.float32)
    feedback = ErrorFeedback(PowerSGDCodec(rank=3))
    feedback.encode("w", x)
    state = feedback.state_dict()
    restored = ErrorFeedback(PowerSGDCodec(rank=3))

    # Execute
    restored.load_state_dict(state)

    # Assert: the next payload is the same from either
    assert restored.encode("w", x) == feedback.encode("w", x)
    bad = {**state, "q/w": np.zeros((30, 3), dtype=np.float64)}
    with pytest.raises(ValueError, match=r"q/w must be a finite 2-D float32 array \(got float64\[30, 3\]\)"):
        restored.load_state_dict(bad)
    with pytest.raises(ValueError, match="holds warm-start Q factors but codec 'int8' has none"):
        ErrorFeedback(get_codec("int8")).load_state_dict(state)


# --- layout and rank per tensor ---------------------------------------------------------------


def test_layout_rule_per_tensor():
    codec = PowerSGDCodec(rank=4)
    assert codec.layout((2048, 64)) == (2048, 64, 4)
    assert codec.layout((16, 3, 3, 3)) == (16, 27, 4)  # conv: out channels x the rest, like the hook
    assert codec.layout((131072,)) == (256, 512, 4)  # flat: near-square
    assert codec.layout((131072,), rows=2048) == (2048, 64, 4)  # the parameter's own rows
    assert codec.layout((512,), rows=1) == (1, 512, 0)  # a bias: dense
    assert codec.layout((10, 8)) == (10, 8, 0)  # tiny: 4 x 18 x 2 > 80 floats, dense
    assert codec.layout((101,)) == (1, 101, 0)  # a prime: no matrix, dense
    assert near_square_rows(0) == 1 and near_square_rows(36) == 6
    with pytest.raises(ValueError, match="rows must be a positive divisor of the tensor's 100 elements"):
        codec.layout((100,), rows=3)


def test_matrix_rows_follows_the_parameter_shape_of_each_block():
    # Prepare: a 2048 x 64 weight cut into two row-aligned blocks, a bias; a 1000 x 9 weight cut mid-row
    plan = ShardingPlan.build([ParamSpec("w", (2048, 64)), ParamSpec("b", (64,))], num_shards=2,
                              block_size_bytes=2048 * 64 * 2)
    odd = ShardingPlan.build([ParamSpec("odd", (1000, 9))], num_shards=1, block_size_bytes=14000)

    # Execute / Assert
    assert [matrix_rows(plan, b.key) for b in plan.blocks_of("w")] == [1024, 1024]
    assert matrix_rows(plan, "b") == 1
    assert [b.numel for b in odd.blocks_of("odd")] == [3000, 3000, 3000]
    assert [matrix_rows(odd, b.key) for b in odd.blocks_of("odd")] == [None, None, None]  # 333.3 rows each
    assert matrix_rows(plan, "nope") is None


def test_orthonormalise_zeroes_a_vanishing_column_instead_of_nan():
    m = np.array([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    out = orthonormalise(m.copy())
    assert np.isfinite(out).all() and (out[:, 1] == 0).all() and out[0, 0] == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"rank": 0}, r"powersgd: rank must be an integer in \[1, 1024\] \(got 0\)"),
    ({"rank": 2.5}, r"powersgd: rank must be an integer in \[1, 1024\] \(got 2.5\)"),
    ({"min_compression_rate": 0.5}, r"min_compression_rate must be a number >= 1 \(got 0.5\)"),
    ({"seed": -1}, r"seed must be an integer >= 0 \(got -1\)"),
])
def test_bad_options_are_refused_with_message(options, message):
    with pytest.raises(ValueError, match=message):
        get_codec("powersgd", **options)


# --- refused frames: nothing trusted, nothing allocated ------------------------------------------


def _frame(shape, rows, cols, rank, p_floats, q_floats, dense_floats=0) -> bytes:
    return bytes(pack_frame("powersgd", np.dtype(np.float32), shape, [
        struct.pack("<III", rows, cols, rank), np.zeros(p_floats, np.float32), np.zeros(q_floats, np.float32),
        np.zeros(dense_floats, np.float32)]))


@pytest.mark.parametrize(("payload", "message"), [
    (_frame((600,), 12, 50, 4, 48, 199), r"powersgd payload: Q field holds 796 bytes, expected 800"),
    (_frame((600,), 12, 50, 4, 47, 200), r"powersgd payload: P field holds 188 bytes, expected 192"),
    (_frame((600,), 12, 40, 4, 48, 160), r"powersgd payload announces 480 values for a tensor of 600 elements"),
    (_frame((600,), 12, 50, 13, 156, 650), r"powersgd payload: rank 13 exceeds min\(rows, cols\) = 12"),
    (_frame((600,), 12, 50, 0, 0, 0, 599), r"powersgd payload: dense field holds 2396 bytes, expected 2400"),
    (_frame((600,), 12, 50, 4, 48, 200, 600), r"powersgd payload: dense field holds 2400 bytes, expected 0"),
    (_frame((600,), 12, 50, 4, 48, 200)[:-3], r"powersgd payload truncated"),
    (_frame((600,), 12, 50, 4, 48, 200) + b"\0", r"powersgd payload has trailing bytes"),
])
def test_malformed_frame_is_refused_with_message(payload, message):
    with pytest.raises(ProtocolError, match=message):
        get_codec("powersgd").decode(payload)


def test_frame_announcing_a_huge_matrix_is_refused_before_any_allocation():
    # Prepare: a valid-looking 65535 x 65535 rank-1 frame (P and Q 256 KiB each; 17 GB decoded)
    payload = _frame((65535 * 65535,), 65535, 65535, 1, 65535, 65535)
    tracemalloc.start()

    # Execute / Assert: the caller's expected size is checked first
    try:
        with pytest.raises(ProtocolError, match=r"elements, expected 1200"):
            get_codec("powersgd").decode(payload, expected_numel=1200)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


# --- the job spec and a real local-mode round ---------------------------------------------------------


BASE = {"name": "x", "framework": "torch", "entrypoint": "train.py"}


@pytest.mark.parametrize(("compression", "message"), [
    ({"codec": "int8", "rank": 2}, "rank: only applies to codec powersgd (codec is 'int8')"),
    ({"codec": "powersgd", "error_feedback": False}, "error_feedback: powersgd is biased and needs error_feedback"),
    ({"codec": "powersgd", "rank": 0}, "rank"),
])
def test_bad_powersgd_settings_are_refused(compression, message):
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec({**BASE, "ps": {"compression": compression}})


def test_rank_reaches_the_codec_from_the_job_spec():
    from hybridfleet.codec import codec_for

    spec = parse_spec({**BASE, "ps": {"sync": "local", "compression": {"codec": "powersgd", "rank": 8}}})
    assert codec_for(spec.ps.compression).options()["rank"] == 8


def test_local_mode_round_through_real_shards_carries_rank_r_pseudo_gradients_exactly(tmp_path):
    # Prepare: two workers over real gRPC; each moves a 64 x 48 weight by its own rank-1 step and a bias
    from hybridfleet.ps.worker.client import ClientSecurity
    from hybridfleet.ps.worker.local import LocalRounds
    from hybridfleet.ps.worker.session import PSSession, WorkerConfig
    from hybridfleet.security import load_pki
    from tests.ps_helpers import start_cluster

    cluster = start_cluster(tmp_path, expected_workers=2, sync="local", local_steps=2,
                            optimizer={"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True},
                            compression={"codec": "powersgd", "rank": 2, "error_feedback": True})
    rng = np.random.default_rng(8)
    init = {"fc.weight": rng.standard_normal((64, 48)).astype(np.float32), "fc.bias": np.ones(64, np.float32)}
    moves = {site: (np.outer(rng.standard_normal(64), rng.standard_normal(48)).astype(np.float32),
                    rng.standard_normal(64).astype(np.float32)) for site in ("a", "b")}
    sessions = {}
    for site in moves:
        sec = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert), token=cluster.token(site))
        config = WorkerConfig(job=cluster.spec, site=site, rank=0 if site == "a" else 1, servers=cluster.addresses,
                              security=sec)
        sessions[site] = PSSession({k: v.shape for k, v in init.items()}, config, "torch")
    results = {}
    try:
        for s in sessions.values():
            s.start(init)

        def work(site):
            rounds = LocalRounds(sessions[site], optimizer=object())
            params = {k: v.copy() for k, v in init.items()}
            for _ in range(2):
                params["fc.weight"] -= moves[site][0] / 2
                params["fc.bias"] -= moves[site][1] / 2
                new = rounds.after_inner_step(lambda: params)
            results[site] = new

        threads = [threading.Thread(target=work, args=(site,)) for site in moves]
        # Execute
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

        # Assert: Nesterov's first step on the mean pseudo-gradient, as dense would give it
        mean = {"fc.weight": (moves["a"][0] + moves["b"][0]) / 2, "fc.bias": (moves["a"][1] + moves["b"][1]) / 2}
        for site in moves:
            for k in init:
                expected = init[k] - np.float32(0.7 * 1.9) * mean[k]
                np.testing.assert_allclose(results[site][k], expected, rtol=0, atol=1e-4 * np.abs(expected).max())
        state = cluster.servers[0].state
        assert state.version == 1
        # the weight's downlink delta travelled as rank-2 factors: far fewer bytes than dense
        assert state.downlink_encoded_bytes < 0.3 * state.downlink_dense_bytes
    finally:
        for s in sessions.values():
            s.close()
        cluster.stop()


def test_bsp_step_through_a_real_shard_applies_the_factors_and_a_refused_push_keeps_q(tmp_path):
    # Prepare: one worker, one shard, server-side SGD lr 0.5, a rank-1 gradient (exact at rank 2)
    from hybridfleet.ps.worker.client import ClientSecurity
    from hybridfleet.ps.worker.session import PSSession, WorkerConfig
    from hybridfleet.security import load_pki
    from tests.ps_helpers import start_cluster

    cluster = start_cluster(tmp_path, sites={"a": {"workers": 1}},
                            compression={"codec": "powersgd", "rank": 2, "error_feedback": True})
    rng = np.random.default_rng(9)
    init = {"fc.weight": rng.standard_normal((40, 30)).astype(np.float32), "fc.bias": np.zeros(40, np.float32)}
    grad = {"fc.weight": np.outer(rng.standard_normal(40), rng.standard_normal(30)).astype(np.float32),
            "fc.bias": rng.standard_normal(40).astype(np.float32)}
    sec = ClientSecurity.from_files(str(load_pki(cluster.certs).ca_cert), token=cluster.token("a"))
    session = PSSession({k: v.shape for k, v in init.items()},
                        WorkerConfig(job=cluster.spec, site="a", servers=cluster.addresses, security=sec), "torch")
    try:
        session.start(init)

        # Execute: one applied step, then a stale one the shard refuses
        session.step(grad)
        q_after_applied = session.feedback.state_dict()["q/fc.weight"]
        shard_after_applied = cluster.params()
        session.client.versions = [v - 1 for v in session.client.versions]
        session.step({k: v * 3 for k, v in grad.items()})

        # Assert: the shard applied lr x the gradient (rank 1: the factors are exact); the refused push
        # changed neither the shard nor the warm-start Q
        for k in init:
            np.testing.assert_allclose(shard_after_applied[k].reshape(init[k].shape), init[k] - 0.5 * grad[k],
                                       rtol=0, atol=1e-4 * np.abs(init[k]).max())
            assert np.array_equal(cluster.params()[k], shard_after_applied[k]), k
        np.testing.assert_array_equal(session.feedback.state_dict()["q/fc.weight"], q_after_applied)
        assert "q/fc.bias" not in session.feedback.state_dict()  # the bias travels dense
    finally:
        session.close()
        cluster.stop()
