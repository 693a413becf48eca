"""Embeddings built with ``sparse=True`` train on the parameter server as the plain script trains them.

Real TLS shards on 127.0.0.1, one worker as a thread of this process, real torch / paddle
training. The reference is the same loop with ``optimizer.step()`` and no hybridfleet, the
embedding sparse there too; an optimizer whose sparse update is not its dense one is refused
at connect, before joining.
"""

from __future__ import annotations

import numpy as np
import pytest

import script_optim_helpers as h
from hybridfleet.codec import get_codec

VOCAB, DIM, CLASSES, STEPS = 40, 4, 3, 30


@pytest.fixture
def shards(tmp_path):
    started = []

    def start(framework: str, shards: int = 1, **ps):
        s = h.start_shards(tmp_path, h.job(framework, 1, shards, **ps))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _batches():
    """Token batches with repeated and unsorted rows (the sparse gradient's duplicate indices summed)."""
    rng = np.random.default_rng(7)
    return [(rng.integers(0, VOCAB, (4, 5)).astype(np.int64), rng.integers(0, CLASSES, 4).astype(np.int64))
            for _ in range(STEPS)]


# --------------------------------------------------------------------------------------------- torch
def _torch_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(VOCAB, DIM, sparse=True),
                                "fc": torch.nn.Linear(DIM, CLASSES)})


TORCH = {
    "sgd": lambda torch, p: torch.optim.SGD(p, lr=0.5),
    "sgd_momentum_dampening": lambda torch, p: torch.optim.SGD(p, lr=0.2, momentum=0.9, dampening=0.3),
    "sgd_nesterov": lambda torch, p: torch.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True),
    "adagrad": lambda torch, p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.01, initial_accumulator_value=0.1),
}


def _torch_train(m, opt, ps=None):
    import torch

    for tokens, labels in _batches():
        m.zero_grad(set_to_none=True)
        logits = m["fc"](m["emb"](torch.from_numpy(tokens)).mean(1))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).backward()
        ps.step() if ps is not None else opt.step()


def _torch_values(m):
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


@pytest.mark.torch
@pytest.mark.parametrize("name, n_shards", [("sgd", 1), ("sgd_momentum_dampening", 2), ("sgd_nesterov", 1),
                                            ("adagrad", 2)])
def test_a_torch_sparse_embedding_trains_as_the_plain_script(shards, name, n_shards):
    # Prepare: the plain script, embedding sparse there too
    import torch

    import hybridfleet.torch as hf

    ref = _torch_model()
    _torch_train(ref, TORCH[name](torch, ref.parameters()))
    cluster = shards("torch", shards=n_shards)
    m = _torch_model()
    opt = TORCH[name](torch, m.parameters())
    # Execute
    ps = hf.connect(m, opt, config=cluster.config(0))
    _torch_train(m, opt, ps)
    ps.close()
    # Assert: within 1e-5 of the plain script, and the embedding trained
    want = _torch_values(ref)
    h.assert_close(_torch_values(m), want)
    assert not np.allclose(want["emb.weight"], _torch_values(_torch_model())["emb.weight"])


# -------------------------------------------------------------------------------------------- paddle
def _paddle_model():
    import paddle

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.emb = paddle.nn.Embedding(VOCAB, DIM, sparse=True)
            self.fc = paddle.nn.Linear(DIM, CLASSES)

        def forward(self, tokens):
            return self.fc(self.emb(tokens).mean(1))

    paddle.seed(0)
    return Net()


PADDLE = {
    "sgd": lambda paddle, p: paddle.optimizer.SGD(0.5, parameters=p),
    "sgd_weight_decay": lambda paddle, p: paddle.optimizer.SGD(0.5, parameters=p, weight_decay=0.01),
    "adagrad": lambda paddle, p: paddle.optimizer.Adagrad(0.3, parameters=p),
    "sgd_clip": lambda paddle, p: paddle.optimizer.SGD(0.5, parameters=p,
                                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05)),
}


def _paddle_train(m, opt, ps=None):
    import paddle

    for tokens, labels in _batches():
        m.clear_gradients(set_to_zero=False)
        paddle.nn.functional.cross_entropy(m(paddle.to_tensor(tokens)), paddle.to_tensor(labels)).backward()
        ps.step() if ps is not None else opt.step()


def _paddle_values(m):
    return {k: v.numpy().copy() for k, v in m.state_dict().items()}


@pytest.mark.paddle
@pytest.mark.parametrize("name, n_shards", [("sgd", 1), ("sgd_weight_decay", 2), ("adagrad", 2), ("sgd_clip", 1)])
def test_a_paddle_sparse_embedding_trains_as_the_plain_script(shards, name, n_shards):
    import paddle

    import hybridfleet.paddle as hf

    ref = _paddle_model()
    _paddle_train(ref, PADDLE[name](paddle, ref.parameters()))
    cluster = shards("paddle", shards=n_shards)
    m = _paddle_model()
    opt = PADDLE[name](paddle, m.parameters())
    ps = hf.connect(m, opt, config=cluster.config(0))
    _paddle_train(m, opt, ps)
    ps.close()
    want = _paddle_values(ref)
    h.assert_close(_paddle_values(m), want)
    assert not np.allclose(want["emb.weight"], _paddle_values(_paddle_model())["emb.weight"])


def test_a_selected_rows_gradient_reads_as_the_dense_gradient():
    # duplicate and unsorted rows are summed into their rows; untouched rows are zero
    from hybridfleet.ps.worker.sparse_grads import paddle_dense

    class Rows:  # the three accessors of a paddle SelectedRows gradient, as paddle 3.3 names them
        def rows(self):
            return [3, 0, 3]

        def get_selected_rows(self):
            return type("H", (), {"height": lambda self: 5})()

        def _get_tensor_from_selected_rows(self):
            return type("T", (), {"astype": lambda self, _: self,
                                  "numpy": lambda self: np.array([[1, 2], [3, 4], [5, 6]], np.float32)})()

    got = paddle_dense(Rows())
    assert got.shape == (5, 2) and got.dtype == np.float32
    assert got.tolist() == [[3, 4], [0, 0], [0, 0], [6, 8], [0, 0]]


# ------------------------------------------------------------------------------------------ refusals
TORCH_REFUSED = {
    "sparse_adam": (lambda torch, p: torch.optim.SparseAdam(list(p)),
                    r"torch\.optim\.SparseAdam is lazy \(only the touched rows' moments move\)"),
    "adam": (lambda torch, p: torch.optim.Adam(p), r"torch\.optim\.Adam does not support sparse gradients"),
    "adamw": (lambda torch, p: torch.optim.AdamW(p), r"torch\.optim\.AdamW does not support sparse gradients"),
    "sgd_weight_decay": (lambda torch, p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
                         r"torch\.optim\.SGD\(weight_decay=0\.1\) raises on sparse gradients \(add\(sparse, dense\)"),
    "adagrad_weight_decay": (lambda torch, p: torch.optim.Adagrad(p, weight_decay=0.1),
                             r"torch\.optim\.Adagrad\(weight_decay=0\.1\) raises on sparse gradients "
                             r"\(weight_decay option is not compatible with sparse gradients\)"),
}


@pytest.mark.torch
def test_the_torch_plain_script_itself_fails_on_what_is_refused():
    # the refusals above for Adam and weight decay state torch's own behaviour: the plain script raises
    import torch

    for make, reason in (TORCH_REFUSED["adam"], TORCH_REFUSED["sgd_weight_decay"],
                         TORCH_REFUSED["adagrad_weight_decay"]):
        m = _torch_model()
        opt = make(torch, m.parameters())
        m["emb"](torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError, match="sparse|add\\(sparse, dense\\)"):
            opt.step()


@pytest.mark.torch
def test_a_torch_group_with_the_embedding_at_weight_decay_0_joins(shards):
    import torch

    import hybridfleet.torch as hf

    cluster = shards("torch")
    m = _torch_model()
    opt = torch.optim.SGD([{"params": m["emb"].parameters()},
                           {"params": m["fc"].parameters(), "weight_decay": 0.1}], lr=0.1, momentum=0.9)
    ps = hf.connect(m, opt, config=cluster.config(0))
    ps.close()
    assert cluster.status()[0]["initialized"]


PADDLE_REFUSED = {
    "adam_lazy": (lambda paddle, p: paddle.optimizer.Adam(0.1, parameters=p, lazy_mode=True),
                  r"paddle\.optimizer\.Adam\(lazy_mode=True\) moves only the touched rows' moments"),
    "adamw_lazy": (lambda paddle, p: paddle.optimizer.AdamW(0.1, parameters=p, lazy_mode=True),
                   r"paddle\.optimizer\.AdamW\(lazy_mode=True\) moves only the touched rows' moments"),
    "adam": (lambda paddle, p: paddle.optimizer.Adam(0.1, parameters=p),
             r"paddle\.optimizer\.Adam's sparse kernel does not apply the update its dense kernel applies"),
    "momentum": (lambda paddle, p: paddle.optimizer.Momentum(0.1, parameters=p),
                 r"paddle\.optimizer\.Momentum's sparse kernel does not apply the update its dense kernel applies"),
}


REFUSED = ([pytest.param("torch", n, marks=pytest.mark.torch, id=f"torch-{n}") for n in TORCH_REFUSED]
           + [pytest.param("paddle", n, marks=pytest.mark.paddle, id=f"paddle-{n}") for n in PADDLE_REFUSED])


@pytest.mark.parametrize("framework, name", REFUSED)
def test_connect_refuses_an_optimizer_whose_sparse_update_differs_before_joining(shards, framework, name):
    # Prepare
    import importlib

    from hybridfleet.errors import SpecError

    lib, hf = importlib.import_module(framework), importlib.import_module(f"hybridfleet.{framework}")
    model, values = (_torch_model, _torch_values) if framework == "torch" else (_paddle_model, _paddle_values)
    make, reason = (TORCH_REFUSED if framework == "torch" else PADDLE_REFUSED)[name]
    cluster = shards(framework)
    m = model()
    before = values(m)
    # Execute / Assert: the message names the parameter, the optimizer and the fix; nothing joined or changed
    with pytest.raises(SpecError, match=r"parameter 'emb\.weight' \(nn\.Embedding\(sparse=True\)\) has sparse "
                                        rf"gradients: {reason}.*build the embedding with sparse=False"):
        hf.connect(m, make(lib, m.parameters()), config=cluster.config(0))
    status = cluster.status()[0]
    assert status["members"] == {} and not status["initialized"]
    h.assert_close(values(m), before, rtol=0)


@pytest.mark.paddle
@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_the_paddle_plain_script_with_a_refused_optimizer_differs_from_its_dense_update(name):
    # what the refusal states, measured: the same steps with sparse=True and sparse=False part ways
    import paddle

    results = []
    for sparse in (True, False):
        paddle.seed(0)
        emb = paddle.nn.Embedding(4, 2, sparse=sparse)
        opt = PADDLE_REFUSED[name][0](paddle, emb.parameters())
        for rows in ([2, 0], [1, 3], [3, 1]):
            opt.clear_grad()
            emb(paddle.to_tensor(np.array(rows))).sum().backward()
            opt.step()
        results.append(emb.weight.numpy().copy())
    assert np.abs(results[0] - results[1]).max() > 1e-3


# ------------------------------------------------------------------------------ only touched rows travel
TABLE_ROWS, TABLE_DIM = 100_000, 64
TOUCHED = np.arange(0, TABLE_ROWS, 100)  # 1% of the rows, no two adjacent: one run each
FRAME_BYTES = 6 + 4 + 1  # magic, version, codec, dtype, ndim; one uint32 dim; the field count


def _table(framework: str, sparse: bool):
    """(model, optimizer, one training step) of a 100k x 64 embedding alone, SGD with momentum."""
    if framework == "torch":
        import torch

        torch.manual_seed(0)
        m = torch.nn.Embedding(TABLE_ROWS, TABLE_DIM, sparse=sparse)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(ps=None):
            m.zero_grad(set_to_none=True)
            (m(torch.from_numpy(TOUCHED)) ** 2).sum().backward()
            ps.step() if ps is not None else opt.step()
        return m, opt, step, lambda: m.weight.detach().numpy().copy()
    import paddle

    paddle.seed(0)
    m = paddle.nn.Embedding(TABLE_ROWS, TABLE_DIM, sparse=sparse)
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())

    def step(ps=None):
        m.clear_gradients(set_to_zero=False)
        (m(paddle.to_tensor(TOUCHED)) ** 2).sum().backward()
        ps.step() if ps is not None else opt.step()
    return m, opt, step, lambda: m.weight.numpy().copy()


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_a_sparse_table_pushes_only_its_touched_rows_and_trains_as_the_plain_script(shards, framework):
    # Prepare: the plain script's two steps; the same through one shard, sparse=True and sparse=False
    import importlib

    hf = importlib.import_module(f"hybridfleet.{framework}")
    ref, opt, step, values = _table(framework, sparse=True)
    step()
    step()
    want = values()
    pushed, got = {}, {}
    for sparse in (True, False):
        cluster = shards(framework, block_size_bytes=4 << 20)
        m, opt, step, values = _table(framework, sparse)
        ps = hf.connect(m, opt, config=cluster.config(0))
        # Execute
        step(ps)
        step(ps)
        pushed[sparse] = ps.session.client.bytes.sent["gradients"]
        ps.close()
        got[sparse] = values()
        blocks = len(cluster.servers[0].state.plan.blocks)
    # Assert: the bytes are those of the frames, exactly: rows-only carries each touched row's
    # 64 values and one run (start, length) per row, dense every element
    assert blocks == 7
    rows_frame = FRAME_BYTES + 3 * 8 + 12  # three field lengths, params (runs, values)
    assert pushed[True] == 2 * (blocks * rows_frame + TOUCHED.size * (8 + 4 * TABLE_DIM)) == 528_658
    assert pushed[False] == 2 * (blocks * (FRAME_BYTES + 8) + 4 * TABLE_ROWS * TABLE_DIM) == 51_200_266
    h.assert_close({"w": got[True]}, {"w": want})
    h.assert_close({"w": got[False]}, {"w": want})


def test_a_shard_refuses_a_malformed_rows_frame_naming_the_key_and_nothing_changes(shards):
    # Prepare: a joined, initialised worker (raw client) and a rows frame whose run ends past the block
    import struct

    import grpc

    from hybridfleet.codec.frame import pack_frame
    from test_ps_script_optimizer import _raw_clients

    cluster = shards("torch")
    (a0,) = _raw_clients(cluster, 1)
    before = cluster.params()
    bad = bytes(pack_frame("rows", np.dtype(np.float32), (12,), [struct.pack("<IQ", 1, 3),
                                                                 np.array([10, 3], "<u4"), np.ones(3, "<f4")]))
    good_bias = bytes(get_codec("none").encode(np.zeros(4, "<f4")))
    # Execute
    with pytest.raises(grpc.RpcError) as err:
        a0.push({"fc.weight": bad, "fc.bias": good_bias}, codec="none", base_versions=[0])
    # Assert
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 'fc.weight': rows payload: runs must be non-empty, increasing, disjoint and within 12" \
        in err.value.details()
    status = cluster.status()[0]
    assert status["version"] == 0 and status["members"]["a-0"]["clock"] == 0
    assert all((cluster.params()[k] == v).all() for k, v in before.items())
    # and a well-formed rows frame is applied as the dense gradient it stands for
    a0.clock -= 1  # the refused push did not count
    grad = np.zeros(12, "<f4")
    grad[3:6] = 1.0
    a0.push({"fc.weight": get_codec("rows").encode(grad), "fc.bias": good_bias}, codec="none", base_versions=[0])
    after = cluster.params()
    assert cluster.status()[0]["version"] == 1
    moved = np.flatnonzero(after["fc.weight"] != before["fc.weight"])
    assert moved.tolist() == [3, 4, 5]
    a0.close()



def test_a_shard_whose_codec_is_not_none_refuses_a_rows_frame_and_nothing_changes(tmp_path):
    # Prepare: shards agreed on int8; a joined, initialised worker (raw client) and a well-formed rows frame
    import grpc

    from hybridfleet.ps.worker.client import PSClient
    from hybridfleet.ps.wire.sharding import ParamSpec

    spec = h.job("torch", 1, 1, compression={"codec": "int8"})
    cluster = h.start_shards(tmp_path, spec)
    try:
        cfg = cluster.config(0)
        a0 = PSClient(cfg.servers, cfg.security, cfg.worker_id, "a", 0, retry_timeout_s=2.0)
        a0.join([ParamSpec("fc.weight", (4, 3)), ParamSpec("fc.bias", (4,))], spec.ps.block_size_bytes, "int8",
                "torch")
        init = {"fc.weight": np.arange(12, dtype="<f4") / 10, "fc.bias": np.ones(4, "<f4")}
        a0.push({k: v.tobytes() for k, v in init.items()}, codec="none", kind="INIT")
        before = cluster.params()
        grad = np.zeros(12, "<f4")
        grad[3:6] = 1.0
        int8 = get_codec("int8")
        # Execute
        with pytest.raises(grpc.RpcError) as err:
            a0.push({"fc.weight": get_codec("rows").encode(grad), "fc.bias": int8.encode(np.ones(4, "<f4"))},
                    codec="int8", base_versions=[0])
        # Assert
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("key 'fc.weight': a rows frame is taken only under codec 'none'; this job's codec is 'int8'"
                in err.value.details())
        status = cluster.status()[0]
        assert status["version"] == 0 and status["members"]["a-0"]["clock"] == 0
        assert all((cluster.params()[k] == v).all() for k, v in before.items())
        # the same push with the agreed codec's frames is applied
        a0.clock -= 1  # the refused push did not count
        a0.push({"fc.weight": int8.encode(grad), "fc.bias": int8.encode(np.ones(4, "<f4"))}, codec="int8",
                base_versions=[0])
        assert cluster.status()[0]["version"] == 1
        a0.close()
    finally:
        cluster.stop()


@pytest.mark.torch
def test_weight_decay_set_on_the_embeddings_group_after_connect_is_refused_at_the_step_before_pushing(shards):
    # Prepare: trains one step, then the script sets weight_decay (the plain script's step would raise now)
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.errors import SpecError

    cluster = shards("torch")
    m = _torch_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ps = hf.connect(m, opt, config=cluster.config(0))
    tokens, labels = _batches()[0]

    def backward():
        m.zero_grad(set_to_none=True)
        logits = m["fc"](m["emb"](torch.from_numpy(tokens)).mean(1))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).backward()

    backward()
    ps.step()
    opt.param_groups[0]["weight_decay"] = 0.1
    backward()
    before = cluster.params()
    # Execute / Assert
    with pytest.raises(SpecError, match=r"torch\.optim\.SGD\(weight_decay=0\.1\) raises on sparse gradients"):
        ps.step()
    assert cluster.status()[0]["version"] == 1
    assert all((cluster.params()[k] == v).all() for k, v in before.items())
    ps.close()
