"""The shards apply the script's own optimizer: the same result as the plain script, step for step.

Real TLS shards on 127.0.0.1, workers as threads of this process, real torch / paddle
training on both sides. The reference is the same loop with ``optimizer.step()`` and no
hybridfleet at all.
"""

from __future__ import annotations

import json
import threading

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


TORCH_OPTIMIZERS = ["sgd_nesterov", "sgd_dampening", "adam", "adamw_amsgrad", "rmsprop", "adagrad"]
PADDLE_OPTIMIZERS = ["sgd", "momentum_nesterov", "adam", "adamw_decay_fun", "rmsprop", "adagrad"]
CASES = ([pytest.param("torch", n, marks=pytest.mark.torch, id=f"torch-{n}") for n in TORCH_OPTIMIZERS]
         + [pytest.param("paddle", n, marks=pytest.mark.paddle, id=f"paddle-{n}") for n in PADDLE_OPTIMIZERS])


def _framework(name: str):
    """(the script's helpers, the hybridfleet adapter) of one framework."""
    import importlib

    return importlib.import_module(f"script_optim_{name}"), importlib.import_module(f"hybridfleet.{name}")


@pytest.mark.parametrize("framework, name", CASES)
def test_one_worker_bsp_matches_the_plain_script_for_50_steps(shards, framework, name):
    # Prepare: the plain script's result (paddle's grad_clip included), then the same script through two shards
    f, hf = _framework(framework)
    ref = f.model()
    opt, sched = f.make(name, ref)
    f.train(ref, opt, sched, h.batches(0, h.TOTAL))
    cluster = shards(framework, shards=2)
    m = f.model()
    opt, sched = f.make(name, m)
    # Execute
    ps = hf.connect(m, opt, config=cluster.config(0))
    f.train(m, opt, sched, h.batches(0, h.TOTAL), ps=ps)
    ps.close()
    # Assert: the model, and the shards' own copy, match the plain script
    want = f.values(ref)
    h.assert_close(f.values(m), want)
    h.assert_close({k: v.reshape(want[k].shape) for k, v in _by_param(cluster).items()}, want)


@pytest.mark.parametrize("sync", ["ssp", "asp"])
@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "adamw_decay_fun", marks=pytest.mark.paddle)])
def test_one_worker_in_ssp_and_asp_also_matches_the_plain_script(shards, framework, name, sync):
    f, hf = _framework(framework)
    ref = f.model()
    opt, sched = f.make(name, ref)
    f.train(ref, opt, sched, h.batches(4, 20))
    cluster = shards(framework, sync=sync)
    m = f.model()
    opt, sched = f.make(name, m)
    ps = hf.connect(m, opt, config=cluster.config(0))
    f.train(m, opt, sched, h.batches(4, 20), ps=ps)
    ps.close()
    h.assert_close(f.values(m), f.values(ref))


def _by_param(cluster) -> dict:
    import numpy as np

    blocks = cluster.params()
    plan = cluster.servers[0].state.plan
    return {name: np.concatenate([blocks[b.key] for b in plan.blocks if b.param == name]) for name in plan.params}


# ------------------------------------------------------------------------------- N workers (DDP)
def _concat(parts):
    import numpy as np

    return tuple(np.concatenate(arrays) for arrays in zip(*parts))


@pytest.mark.parametrize("framework, name", [pytest.param("torch", "adamw_amsgrad", marks=pytest.mark.torch),
                                             pytest.param("paddle", "momentum_nesterov", marks=pytest.mark.paddle)])
def test_two_workers_bsp_match_one_process_on_the_concatenated_batches(shards, framework, name):
    # Prepare: one process on both workers' batches together (equal batch sizes: the mean of means)
    f, hf = _framework(framework)
    steps = 20
    ref = f.model()
    opt, sched = f.make(name, ref)
    f.train(ref, opt, sched, map(_concat, zip(h.batches(1, steps), h.batches(2, steps))))
    cluster = shards(framework, workers=2, shards=2)
    lock = threading.Lock()  # workers are threads here: one forward/backward at a time (paddle's autograd)

    def worker(rank):
        with lock:
            m = f.model()
            opt, sched = f.make(name, m)
        ps = hf.connect(m, opt, config=cluster.config(rank))
        f.train(m, opt, sched, h.batches(1 + rank, steps), ps=ps, lock=lock)
        ps.close()
        return f.values(m)

    # Execute
    got = h.run_workers(worker, 2)
    # Assert
    h.assert_close(got[0], f.values(ref))
    h.assert_close(got[1], f.values(ref))


# ---------------------------------------------------------------------------- freezing, unfreezing
UNFREEZE_AT = 10


@pytest.mark.torch
def test_torch_frozen_stay_bit_identical_and_unfreezing_at_step_k_matches_the_plain_script(shards):
    # Prepare: cnn.0 frozen throughout; mlp frozen until step k, then unfrozen with its own group
    import numpy as np

    import hybridfleet.torch as hf
    import script_optim_torch as t

    def build():
        m = t.model()
        for p in [*m.mlp.parameters(), *m.cnn[0].parameters()]:
            p.requires_grad_(False)
        return m, *t.make("adam", m)

    def unfreezer(sched):
        def unfreeze(i, m, opt):
            if i == UNFREEZE_AT:  # the new group follows the schedule too
                m.mlp.requires_grad_(True)
                opt.add_param_group({"params": list(m.mlp.parameters()), "lr": 0.01, "weight_decay": 0.0,
                                     "initial_lr": 0.01})
                sched.base_lrs.append(0.01)
                sched.lr_lambdas.append(h.warmup_cosine)
        return unfreeze

    ref, opt, sched = build()
    frozen = {n: v for n, v in t.values(ref).items() if n.startswith("cnn.0.")}
    t.train(ref, opt, sched, h.batches(3, 30), on_step=unfreezer(sched))
    cluster = shards("torch", shards=2)
    m, opt, sched = build()
    unfreeze = unfreezer(sched)
    # Execute
    ps = hf.connect(m, opt, config=cluster.config(0))
    t.train(m, opt, sched, h.batches(3, 30), ps=ps, on_step=unfreeze)
    ps.close()
    # Assert: the plain script's result; frozen tensors bit for bit, on the worker and on the shards
    got = t.values(m)
    h.assert_close(got, t.values(ref))
    on_shards = _by_param(cluster)
    for n, v in frozen.items():
        assert np.array_equal(got[n], v) and np.array_equal(on_shards[n].reshape(v.shape), v), n
    assert not np.array_equal(got["mlp.0.weight"], t.values(t.model())["mlp.0.weight"])  # it did train


@pytest.mark.paddle
def test_paddle_frozen_stay_bit_identical_and_unfreezing_at_step_k_matches_the_plain_script(shards):
    import numpy as np

    import hybridfleet.paddle as hf
    import script_optim_paddle as p

    def build():
        m = p.model()
        for q in [*m.mlp.parameters(), *m.cnn[0].parameters()]:
            q.stop_gradient = True
        return m, *p.make("adamw_decay_fun", m)

    def unfreeze(i, m, opt):
        if i == UNFREEZE_AT:
            for q in m.mlp.parameters():
                q.stop_gradient = False

    ref, opt, sched = build()
    frozen = {n: v for n, v in p.values(ref).items() if n.startswith("cnn.0.")}
    p.train(ref, opt, sched, h.batches(3, 30), on_step=unfreeze)
    cluster = shards("paddle", shards=2)
    m, opt, sched = build()
    ps = hf.connect(m, opt, config=cluster.config(0))
    p.train(m, opt, sched, h.batches(3, 30), ps=ps, on_step=unfreeze)
    ps.close()
    got = p.values(m)
    h.assert_close(got, p.values(ref))
    on_shards = _by_param(cluster)
    for n, v in frozen.items():
        assert np.array_equal(got[n], v) and np.array_equal(on_shards[n].reshape(v.shape), v), n
    assert not np.array_equal(got["mlp.0.weight"], p.values(p.model())["mlp.0.weight"])


# ------------------------------------------------------------------------------------- refusals
def _raw_clients(cluster, n: int = 2):
    """Joined clients of workers a-0 .. a-(n-1) on a model of two tensors, initialised by a-0."""
    import numpy as np

    from hybridfleet.ps.worker.client import PSClient
    from hybridfleet.ps.wire.sharding import ParamSpec

    clients = []
    for rank in range(n):
        cfg = cluster.config(rank)
        c = PSClient(cfg.servers, cfg.security, cfg.worker_id, "a", rank, retry_timeout_s=2.0)
        c.join([ParamSpec("fc.weight", (4, 3)), ParamSpec("fc.bias", (4,))], cluster.spec.ps.block_size_bytes,
               "none", "torch")
        clients.append(c)
    init = {"fc.weight": np.arange(12, dtype="<f4") / 10, "fc.bias": np.ones(4, "<f4")}
    clients[0].push({k: v.tobytes() for k, v in init.items()}, codec="none", kind="INIT")
    for c in clients:
        c.pull(full=True)
    return clients


def _torch_description(lr: float) -> str:
    import torch

    from hybridfleet.ps.worker.optim_spec import encode, reader_for

    params = {"fc.weight": torch.nn.Parameter(torch.zeros(4, 3)), "fc.bias": torch.nn.Parameter(torch.zeros(4))}
    opt = torch.optim.AdamW([{"params": [params["fc.weight"]]}, {"params": [params["fc.bias"]], "weight_decay": 0}],
                            lr=lr)
    return encode(reader_for(opt, "torch", params).describe())


def _gradient():
    import numpy as np

    from hybridfleet.codec import get_codec

    codec = get_codec("none")
    return {"fc.weight": codec.encode(np.full(12, 0.5, "<f4")), "fc.bias": codec.encode(np.full(4, 0.5, "<f4"))}


@pytest.mark.torch
def test_a_push_whose_hyperparameters_differ_from_the_rounds_is_refused_naming_them_and_nothing_changes(shards):
    # Prepare: a-0 pushed round 0 with lr 0.1
    import grpc

    cluster = shards("torch", workers=2)
    a0, a1 = _raw_clients(cluster)
    a0.push(_gradient(), codec="none", base_versions=[0], optimizer_json=_torch_description(0.1))
    before = cluster.params()
    # Execute: a-1 pushes the same round with lr 0.2
    with pytest.raises(grpc.RpcError) as err:
        a1.push(_gradient(), codec="none", base_versions=[0], optimizer_json=_torch_description(0.2))
    # Assert: the message names the setting and both values; nothing changed
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "groups[0].hyper.lr: 0.2 != 0.1" in err.value.details()
    assert "groups[1].hyper.lr: 0.2 != 0.1" in err.value.details() and "a-0" in err.value.details()
    status = cluster.status()[0]
    assert status["version"] == 0 and status["members"]["a-1"]["clock"] == 0
    assert all((cluster.params()[k] == v).all() for k, v in before.items())
    # and the round still closes once a-1 pushes with the agreed settings
    a1.clock -= 1  # the refused push did not count
    a1.push(_gradient(), codec="none", base_versions=[0], optimizer_json=_torch_description(0.1))
    assert cluster.status()[0]["version"] == 1
    for c in (a0, a1):
        c.close()


def _set(path, value):
    def change(desc):
        target = desc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
    return change


@pytest.mark.torch
@pytest.mark.parametrize("change, message", [
    (_set(["class"], "LBFGS"), "optimizer class 'LBFGS' is not one the shards run"),
    (_set(["groups", 0, "hyper", "lr"], "fast"), "optimizer group 0 'lr': must be a number >= 0 (got 'fast')"),
    (_set(["groups", 0, "hyper", "lr"], -1.0), "optimizer group 0 'lr': must be a number >= 0 (got -1.0)"),
    (_set(["groups", 1, "hyper", "betas"], [0.9, 1.5]), "optimizer group 1: Invalid beta parameter at index 1"),
    (_set(["groups", 0, "hyper", "foreach"], {"x": 1}), "optimizer group 0 'foreach': {'x': 1} is not a plain"),
    (_set(["groups", 0, "params"], ["fc.weight", "fc.other"]), "names parameters the job does not have: fc.other"),
    (_set(["framework"], "paddle"), "optimizer description is for 'paddle'; this job trains with torch"),
    (_set(["ctor", "lr_decay"], 0.1), "optimizer ctor: a torch optimizer sends only initial_accumulator_value "
                                      "(got lr_decay)"),
    (_set(["ctor", "initial_accumulator_value"], -1.0),
     "optimizer ctor 'initial_accumulator_value': must be a number >= 0 (got -1.0)"),
], ids=["class", "lr-type", "lr-negative", "betas", "nested", "unknown-param", "framework", "ctor-key",
        "ctor-negative"])
def test_a_push_with_an_optimizer_the_shards_cannot_run_is_refused_and_nothing_changes(shards, change, message):
    import json

    import grpc

    cluster = shards("torch", workers=1)
    (a0,) = _raw_clients(cluster, 1)
    desc = json.loads(_torch_description(0.1))
    change(desc)
    before = cluster.params()
    with pytest.raises(grpc.RpcError) as err:
        a0.push(_gradient(), codec="none", base_versions=[0], optimizer_json=json.dumps(desc))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    status = cluster.status()[0]
    assert status["version"] == 0 and status["members"]["a-0"]["clock"] == 0
    assert all((cluster.params()[k] == v).all() for k, v in before.items())
    a0.close()


@pytest.mark.torch
def test_connect_refuses_a_torch_optimizer_the_shards_cannot_run_before_joining(shards):
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.ps.worker.optim_spec import UnsupportedOptimizer

    cluster = shards("torch")
    m = torch.nn.Linear(3, 2)
    with pytest.raises(UnsupportedOptimizer, match=r"optimizer torch\.optim\.lbfgs\.LBFGS: the shards run "
                                                   r"torch\.optim\.SGD, .*set ps\.optimizer in the job file"):
        hf.connect(m, torch.optim.LBFGS(m.parameters()), config=cluster.config(0))
    status = cluster.status()[0]
    assert status["members"] == {} and not status["initialized"]


@pytest.mark.paddle
def test_connect_refuses_a_paddle_optimizer_the_shards_cannot_run_before_joining(shards):
    import paddle

    import hybridfleet.paddle as hf
    from hybridfleet.ps.worker.optim_spec import UnsupportedOptimizer

    cluster = shards("paddle")
    m = paddle.nn.Linear(3, 2)
    with pytest.raises(UnsupportedOptimizer, match=r"optimizer paddle\.optimizer\.lamb\.Lamb: the shards run "
                                                   r"paddle\.optimizer\.SGD, .*set ps\.optimizer"):
        hf.connect(m, paddle.optimizer.Lamb(parameters=m.parameters()), config=cluster.config(0))
    status = cluster.status()[0]
    assert status["members"] == {} and not status["initialized"]


@pytest.mark.torch
def test_an_explicit_ps_optimizer_overrides_the_scripts_and_says_so(shards, capsys):
    # Prepare: the job file sets ps.optimizer (sgd, lr 0.5); the script builds Adam
    import numpy as np
    import torch

    import hybridfleet.torch as hf

    cluster = shards("torch", optimizer={"name": "sgd", "lr": 0.5})
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    w0 = m.weight.detach().numpy().copy()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    # Execute
    ps = hf.connect(m, opt, config=cluster.config(0))
    m(torch.ones(1, 3)).sum().backward()
    ps.step()
    ps.close()
    # Assert: plain SGD with the job's lr was applied (d sum / d weight = 1 everywhere), and logged
    np.testing.assert_allclose(m.weight.detach().numpy(), w0 - 0.5, rtol=0, atol=1e-6)
    assert ps.reader is None
    assert "script_optimizer_overridden" in capsys.readouterr().err


@pytest.mark.torch
def test_connect_refuses_the_scripts_adam_with_a_sparse_codec_before_joining(shards):
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.errors import SpecError

    cluster = shards("torch", compression={"codec": "topk", "ratio": 0.1})
    m = torch.nn.Linear(3, 2)
    with pytest.raises(SpecError, match=r"the shards would apply the script's AdamW with codec 'topk'.*sync: local"):
        hf.connect(m, torch.optim.AdamW(m.parameters()), config=cluster.config(0))
    assert cluster.status()[0]["members"] == {}


# ------------------------------------------------------------------------------------ snapshots
@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_the_script_optimizers_state_survives_a_snapshot_round_trip_bit_for_bit(framework):
    # Prepare: three Adam steps on two keys; a second runner loads the first one's state
    import numpy as np

    from hybridfleet.ps.server.groups import ScriptOptimizer

    rng = np.random.default_rng(0)
    keys = {"w#0": "w", "w#1": "w", "b": "b"}
    params = {k: rng.standard_normal(6).astype(np.float32) for k in keys}
    grads = [{k: rng.standard_normal(6).astype(np.float32) for k in keys} for _ in range(4)]
    if framework == "torch":
        desc = json.loads(_torch_description(0.01))
        desc["groups"] = [{"params": ["w"], "hyper": desc["groups"][0]["hyper"]},
                          {"params": ["b"], "hyper": desc["groups"][1]["hyper"]}]
    else:
        desc = {"framework": "paddle", "class": "Adam", "lr": 0.01, "param_attrs": {},
                "ctor": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": False, "weight_decay": None},
                "groups": [{"params": ["w", "b"], "hyper": {}}]}
    first = ScriptOptimizer(framework, keys)
    for g in grads[:3]:
        first.step(params, g, desc)
    second = ScriptOptimizer(framework, keys)
    second.load_state_dict(first.state_dict())
    copy = {k: v.copy() for k, v in params.items()}
    # Execute: the fourth step on both
    first.step(params, grads[3], desc)
    second.step(copy, grads[3], desc)
    # Assert
    assert first.state_dict().keys() == second.state_dict().keys() and first.state_dict()
    for k in keys:
        assert np.array_equal(params[k], copy[k]), k
    with pytest.raises(ValueError, match="not '<key>/<slot>' of this shard's keys"):
        second.load_state_dict({"other/exp_avg": np.zeros(6, np.float32)})


@pytest.mark.torch
def test_a_shard_whose_keys_all_lack_a_gradient_still_closes_the_round_and_steps_nothing(shards):
    # Prepare: two shards, one tensor each; only shard 0's tensor has a gradient
    import numpy as np

    cluster = shards("torch", shards=2)
    (a0,) = _raw_clients(cluster, 1)
    on_shard = {b.shard: b.key for b in a0.plan.blocks}
    assert len(on_shard) == 2
    before = cluster.params()
    # Execute
    a0.push({on_shard[0]: _gradient()[on_shard[0]]}, codec="none", base_versions=[0, 0],
            optimizer_json=_torch_description(0.1))
    a0.pull(wait_for_versions=[1, 1], timeout_s=10)
    # Assert: both rounds closed; only the tensor with a gradient moved
    after = cluster.params()
    assert [s["version"] for s in cluster.status()] == [1, 1]
    assert not np.array_equal(after[on_shard[0]], before[on_shard[0]])
    assert np.array_equal(after[on_shard[1]], before[on_shard[1]])
    a0.close()


@pytest.mark.paddle
def test_paddle_momentum_over_model_parameters_with_batchnorm_matches_the_plain_script(shards):
    # Prepare: a normal paddle script hands model.parameters() to its optimizer, which includes BatchNorm's
    # running statistics (stop_gradient parameters that paddle never steps and the job treats as buffers)
    import paddle

    import hybridfleet.paddle as hf
    from buffer_models import batch, loss, make_model, state

    def momentum(model):
        return paddle.optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=model.parameters(),
                                         weight_decay=1e-3)

    plain = make_model("paddle")
    plain_opt = momentum(plain)
    cluster = shards("paddle")
    model = make_model("paddle")
    ps = hf.connect(model, momentum(model), config=cluster.config(0))
    # Execute: 20 steps each on the same batches
    for step in range(20):
        x, y = batch(step, 16, shift=1.0)
        plain_opt.clear_grad()
        loss("paddle", plain, x, y).backward()
        plain_opt.step()
        ps.zero_grad()
        loss("paddle", model, x, y).backward()
        ps.step()
    ps.close()
    # Assert: parameters and running statistics match the plain script's
    want, got = state("paddle", plain), state("paddle", model)
    assert any(k.endswith("_mean") for k in want)
    h.assert_close(got, want)


STEP_IN_TWO_THREADS = """
import sys, threading
import numpy as np
from hybridfleet.ps.server.groups import ScriptOptimizer, parse_description

desc = parse_description(sys.stdin.read(), "paddle", {"fc.weight", "fc.bias"})
params = {"fc.weight/0": np.arange(12, dtype="<f4") / 10, "fc.bias/0": np.ones(4, "<f4")}
grads = {k: np.full(v.size, 0.5, "<f4") for k, v in params.items()}
made = []


def close_round():  # as the shard does: the optimizer (and paddle) made when the first round closes
    if not made:
        made.append(ScriptOptimizer("paddle", {"fc.weight/0": "fc.weight", "fc.bias/0": "fc.bias"}))
    made[0].step(params, grads, desc)


for round_ in range(2):  # each round in a thread of its own
    t = threading.Thread(target=close_round)
    t.start()
    t.join()
assert "paddle" in sys.modules and not sys.modules["paddle"].in_dynamic_mode()  # this thread never imported it
print(params["fc.bias/0"].tolist())
"""


@pytest.mark.paddle
def test_the_shard_steps_a_paddle_optimizer_in_any_thread_whichever_imported_paddle():
    """A shard imports paddle at its first round, in the thread that closes it, and paddle's
    dynamic-graph mode is then on in that thread alone. Under secure aggregation each round closes
    in a thread of its own: the second round failed ("We only support 'set_lr()' in dynamic graph
    mode") and the job waited for a round that never closed."""
    import subprocess
    import sys
    from pathlib import Path

    import paddle

    from hybridfleet.ps.worker.optim_spec import encode, reader_for

    # Prepare: the description of paddle SGD (lr 0.1), made here; the shard's process imports paddle late
    params = {"fc.weight": paddle.create_parameter([4, 3], "float32"), "fc.bias": paddle.create_parameter([4], "float32")}
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=list(params.values()))
    desc = encode(reader_for(opt, "paddle", params).describe())
    src = Path(__file__).resolve().parents[1] / "src"
    # Execute
    result = subprocess.run([sys.executable, "-c", STEP_IN_TWO_THREADS], input=desc, capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    # Assert: both rounds stepped, 1 - 2 * 0.1 * 0.5
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == pytest.approx([0.9] * 4)
