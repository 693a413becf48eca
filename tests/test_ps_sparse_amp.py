"""Sparse embeddings and mixed precision through the parameter server.

Real TLS shards on 127.0.0.1, workers as threads of this process, real torch / paddle
models on both sides.
"""

from __future__ import annotations

import pytest

import script_optim_helpers as h


@pytest.fixture
def shards(tmp_path):
    started = []

    def start(framework: str, workers: int = 1, shards: int = 1, **ps):
        s = h.start_shards(tmp_path, h.job(framework, workers, shards, **ps))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# ------------------------------------------------------------------------------------ sparse embeddings
@pytest.mark.torch
def test_a_torch_sparse_embedding_with_sgd_joins_and_trains(shards):
    # the optimizers whose sparse update is the dense one train (tests/test_ps_sparse_embeddings.py)
    import torch

    import hybridfleet.torch as hf

    cluster = shards("torch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    before = m[0].weight.detach().clone()
    ps = hf.connect(m, torch.optim.SGD(m.parameters(), lr=0.1), config=cluster.config(0))
    m(torch.tensor([1, 2, 2])).sum().backward()
    ps.step()
    ps.close()
    moved = (m[0].weight.detach() != before).any(dim=1)
    assert moved.tolist() == [False, True, True] + [False] * 7  # only the touched rows had a gradient


@pytest.mark.paddle
def test_a_paddle_sparse_embedding_under_the_jobs_optimizer_trains_as_a_dense_one(shards):
    # without the script's optimizer the shards apply ps.optimizer to the dense reading of the gradient
    import numpy as np
    import paddle

    import hybridfleet.paddle as hf

    class Net(paddle.nn.Layer):
        def __init__(self, sparse):
            super().__init__()
            self.emb = paddle.nn.Embedding(10, 4, sparse=sparse)
            self.fc = paddle.nn.Linear(4, 2)

    got = []
    for sparse in (True, False):
        cluster = shards("paddle", optimizer={"name": "adam", "lr": 0.1})
        paddle.seed(0)
        m = Net(sparse)
        ps = hf.connect(m, config=cluster.config(0))
        for rows in ([[3, 0, 3]], [[1, 9, 0]], [[5, 5, 2]]):
            m.fc(m.emb(paddle.to_tensor(np.array(rows)))).sum().backward()
            ps.step()
            ps.zero_grad()
        ps.close()
        got.append({k: v.numpy().copy() for k, v in m.state_dict().items()})
    h.assert_close(got[0], got[1])


@pytest.mark.torch
def test_a_dense_torch_embedding_still_joins(shards):
    import torch

    import hybridfleet.torch as hf

    cluster = shards("torch")
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    ps = hf.connect(m, torch.optim.SGD(m.parameters(), lr=0.1), config=cluster.config(0))
    ps.close()
    assert cluster.status()[0]["initialized"]


# ------------------------------------------------------------------------------ non-finite gradients
SKIP_AT, STEPS = 3, 6  # worker 1's gradient holds an Inf at step SKIP_AT (1-based)


def _data(seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((4, 5)).astype("float32"), rng.standard_normal((4, 2)).astype("float32"))
            for _ in range(STEPS)]


class _Torch:
    @staticmethod
    def model():
        import torch

        torch.manual_seed(0)
        m = torch.nn.Linear(5, 2)
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    @staticmethod
    def backward(m, x, y, poison: bool = False):
        import torch

        m.zero_grad(set_to_none=True)
        ((m(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean().backward()
        if poison:
            m.weight.grad[0, 0] = float("inf")  # as a float16 overflow under autocast would

    @staticmethod
    def values(m):
        return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


class _Paddle:
    @staticmethod
    def model():
        import paddle

        paddle.seed(0)
        m = paddle.nn.Linear(5, 2)
        return m, paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=m.parameters())

    @staticmethod
    def backward(m, x, y, poison: bool = False):
        import paddle

        m.clear_gradients(set_to_zero=False)
        ((m(paddle.to_tensor(x)) - paddle.to_tensor(y)) ** 2).mean().backward()
        if poison:
            g = m.weight.grad.numpy()
            g[0, 0] = float("inf")
            m.weight.grad.set_value(g)

    @staticmethod
    def values(m):
        return {k: v.numpy().copy() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_a_non_finite_gradient_on_one_worker_skips_that_round_for_all_and_training_goes_on(shards, framework,
                                                                                           capsys):
    import threading

    import numpy as np

    f = _Torch if framework == "torch" else _Paddle
    hf = __import__(f"hybridfleet.{framework}", fromlist=["connect"])
    data = [_data(1), _data(2)]
    # Prepare: the plain script on both workers' batches together, with GradScaler's skip at SKIP_AT
    ref, opt = f.model()
    for step, ((x0, y0), (x1, y1)) in enumerate(zip(*data), start=1):
        if step != SKIP_AT:
            f.backward(ref, np.concatenate([x0, x1]), np.concatenate([y0, y1]))
            opt.step()
    cluster = shards(framework, workers=2, shards=2)
    lock = threading.Lock()  # workers are threads here: one forward/backward at a time (paddle's autograd)

    def worker(rank):
        with lock:
            m, opt = f.model()
        ps = hf.connect(m, opt, config=cluster.config(rank))
        seen = [f.values(m)]
        for step, (x, y) in enumerate(data[rank], start=1):
            with lock:
                f.backward(m, x, y, poison=rank == 1 and step == SKIP_AT)
            ps.step()
            seen.append(f.values(m))
        ps.close()
        return seen

    # Execute
    got = h.run_workers(worker, 2)
    # Assert: round SKIP_AT changed nothing on either worker, the others did; the result is the plain script's
    for seen in got:
        assert all((seen[SKIP_AT][k] == seen[SKIP_AT - 1][k]).all() for k in seen[0])
        assert all(not (seen[SKIP_AT + 1][k] == seen[SKIP_AT][k]).all() for k in seen[0])
        h.assert_close(seen[-1], f.values(ref))
    assert [s["skipped_rounds"] for s in cluster.status()] == [1, 1]
    assert all(s["version"] == STEPS for s in cluster.status())
    err = capsys.readouterr().err
    assert '"event":"round_skipped_nonfinite"' in err and '"worker":"a-1"' in err


@pytest.mark.torch
def test_a_skip_push_that_carries_keys_is_refused_and_changes_nothing(shards):
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.ps.wire.reject import Reject

    cluster = shards("torch")
    m, opt = _Torch.model()
    ps = hf.connect(m, opt, config=cluster.config(0))
    state = cluster.servers[0].state
    before, status = cluster.params(), state.status()
    key = state.keys[0]
    with pytest.raises(Reject, match=r"a push that skips its round \(non-finite gradient\) carries no keys; "
                                     r"this one carries 1; nothing changed"):
        state.push("a-0", "a", "GRADIENT", 1, 0, "none", {key: b"\0" * 4 * state.params[key].size},
                   skip_nonfinite=True)
    assert state.status() == status
    assert all((cluster.params()[k] == v).all() for k, v in before.items())
    ps.close()
    assert torch.isfinite(m.weight).all()


# ------------------------------------------------------------------------- low-precision parameters
def _shard_values(cluster) -> dict:
    """The shards' float32 master weights, by parameter name, flat."""
    import numpy as np

    blocks = cluster.params()
    plan = cluster.servers[0].state.plan
    return {name: np.concatenate([blocks[b.key] for b in plan.blocks if b.param == name]) for name in plan.params}


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_torch_model_trains_on_float32_master_weights_like_the_amp_recipe(shards, dtype):
    import torch

    import hybridfleet.torch as hf

    low = getattr(torch, dtype)
    data = _data(3)

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(5, 2).to(low)

    def loss(m, x, y):
        return ((m(torch.from_numpy(x).to(low)).float() - torch.from_numpy(y)) ** 2).mean()

    # Prepare: the usual recipe: float32 master weights stepped by the optimizer, copied into the low-precision model
    ref = model()
    master = [torch.nn.Parameter(p.detach().float().clone()) for p in ref.parameters()]
    opt = torch.optim.SGD(master, lr=0.1, momentum=0.9)
    for x, y in data:
        ref.zero_grad(set_to_none=True)
        loss(ref, x, y).backward()
        for mp, p in zip(master, ref.parameters()):
            mp.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for mp, p in zip(master, ref.parameters()):
                p.copy_(mp)
    cluster = shards("torch")
    m = model()
    # Execute
    ps = hf.connect(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), config=cluster.config(0))
    for x, y in data:
        ps.zero_grad()
        loss(m, x, y).backward()
        ps.step()
    ps.close()
    # Assert: the shard's float32 masters match the recipe's; the model keeps its dtype, holding them cast
    names = [n for n, _ in ref.named_parameters()]
    h.assert_close(_shard_values(cluster), {n: mp.detach().numpy().reshape(-1) for n, mp in zip(names, master)})
    for (n, p), mp in zip(m.named_parameters(), master):
        assert p.dtype == low, n
        assert torch.equal(p.detach(), mp.detach().to(low)), n
    assert not torch.equal(master[0].detach().to(low), model().weight.detach())  # it trained


@pytest.mark.paddle
def test_a_bfloat16_paddle_model_trains_on_float32_master_weights_like_the_amp_recipe(shards):
    # paddle's CPU kernels have no bfloat16 matmul: the model is element-wise (bfloat16 multiply and add exist)
    import numpy as np
    import paddle

    import hybridfleet.paddle as hf

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = self.create_parameter([5], default_initializer=paddle.nn.initializer.Normal(0.0, 1.0))
            self.b = self.create_parameter([2], default_initializer=paddle.nn.initializer.Constant(0.25))

        def forward(self, x):
            return (x * self.w).astype("float32").sum(-1, keepdim=True) + self.b.astype("float32")

    def model(dtype="bfloat16"):
        paddle.seed(0)
        m = Net()
        m.to(dtype=dtype)
        return m

    def loss(m, x, y):
        return ((m(paddle.to_tensor(x).astype("bfloat16")) - paddle.to_tensor(y)) ** 2).mean()

    data = _data(4)
    # Prepare: the recipe: float32 master weights stepped by paddle's Momentum, cast into the bfloat16 model
    ref, master = model(), model("float32")
    for mp, p in zip(master.parameters(), ref.parameters()):
        mp.set_value(p.astype("float32"))
    opt = paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=master.parameters())
    for x, y in data:
        ref.clear_gradients(set_to_zero=False)
        loss(ref, x, y).backward()
        grads = [p.grad.astype("float32") for p in ref.parameters()]
        master.clear_gradients(set_to_zero=False)
        sum((mp * g).sum() for mp, g in zip(master.parameters(), grads)).backward()  # master.grad = the model's
        opt.step()
        for mp, p in zip(master.parameters(), ref.parameters()):
            p.set_value(mp.astype("bfloat16"))
    cluster = shards("paddle")
    m = model()
    # Execute
    ps = hf.connect(m, paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=m.parameters()),
                    config=cluster.config(0))
    for x, y in data:
        m.clear_gradients(set_to_zero=False)
        loss(m, x, y).backward()
        ps.step()
    ps.close()
    # Assert: the shard's float32 masters match the recipe's; the model stays bfloat16, holding them cast
    h.assert_close(_shard_values(cluster), {n: p.numpy().reshape(-1) for n, p in master.named_parameters()})
    for (n, p), mp in zip(m.named_parameters(), master.parameters()):
        assert p.dtype == paddle.bfloat16, n
        assert (p.numpy() == mp.astype("bfloat16").numpy()).all(), n
    assert not np.allclose(master.w.numpy(), model("float32").w.numpy())  # it trained


@pytest.mark.torch
def test_connect_refuses_torch_sparse_adam_whose_lazy_updates_the_shards_do_not_run(shards):
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.ps.worker.optim_spec import UnsupportedOptimizer

    cluster = shards("torch")
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    with pytest.raises(UnsupportedOptimizer, match=r"optimizer torch\.optim\.sparse_adam\.SparseAdam: the shards run"):
        hf.connect(m, torch.optim.SparseAdam(list(m.parameters())), config=cluster.config(0))
    status = cluster.status()[0]
    assert status["members"] == {} and not status["initialized"]


@pytest.mark.torch
def test_without_servers_a_non_finite_gradient_skips_the_scripts_optimizer_step(capsys):
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.ps.worker.session import WorkerConfig

    m, opt = _Torch.model()
    ps = hf.connect(m, opt, config=WorkerConfig(job=h.job("torch"), site="a"))
    (x, y), (x2, y2) = _data(5)[:2]
    _Torch.backward(m, x, y, poison=True)
    before = _Torch.values(m)
    ps.step()
    assert all((_Torch.values(m)[k] == v).all() for k, v in before.items())  # skipped, nothing became Inf
    _Torch.backward(m, x2, y2)
    ps.step()
    assert not (_Torch.values(m)["weight"] == before["weight"]).all()  # training goes on
    assert ps.session.skipped_nonfinite == 1
    assert '"event":"round_skipped_nonfinite"' in capsys.readouterr().err
    ps.close()
