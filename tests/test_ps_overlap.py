"""Gradients copied and encoded during backward() (``ps.overlap: on``; ``auto`` turns it on for parameters on an accelerator) give bit for bit what
``ps.overlap: off`` gives, whatever the script does to ``.grad`` between backward() and ps.step().

Real TLS shards on 127.0.0.1 started in this process, a worker as a thread of it, real torch /
paddle training with the script's own optimizer. Each case trains twice from the same seed,
once per overlap setting, and compares every parameter exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

import script_optim_helpers as h
from hybridfleet.ps.worker.overlap import overlap_blocker

STEPS = 6
TOPK = {"codec": "topk", "ratio": 0.1, "error_feedback": True}


def _batches(seed: int = 0, n: int = 8):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        yield rng.standard_normal((n, 32)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)


# ---------------------------------------------------------------- torch
def _torch_run(tmp_path, overlap: str, case: str, compression: dict | None = None):
    import torch

    import hybridfleet.torch as hf

    cluster = h.start_shards(tmp_path / overlap, h.job("torch", overlap=overlap, **(
        {"compression": compression} if compression else {})))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3),
                                    torch.nn.Linear(3, 3))
        model[3].requires_grad_(False)  # frozen: no hook, no push, unchanged
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        ps = hf.connect(model, opt, config=cluster.config(0))
        loss_of = lambda x, y: torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        for step, (x, y) in enumerate(_batches()):
            opt.zero_grad()
            if case == "accumulate":  # two micro-batches, one step
                for half in (slice(0, 4), slice(4, 8)):
                    (loss_of(x[half], y[half]) / 2).backward()
            elif case == "nonfinite" and step == 3:  # one gradient NaN: the round is skipped, nothing committed
                (loss_of(x, y) + model[0].bias.sum() * float("nan")).backward()
            else:
                loss_of(x, y).backward()
            if case == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif case == "scale":
                model[0].weight.grad.mul_(0.5)
            elif case == "drop" and step % 2:
                model[0].bias.grad = None  # no gradient this step: not pushed, not stepped
            ps.step()
        stats = ps.stage.stats if ps.stage is not None else None
        assert ps.session.skipped_nonfinite == (case == "nonfinite")
        ps.close()
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, stats
    finally:
        cluster.stop()


def _assert_identical(on: dict, off: dict) -> None:
    assert set(on) == set(off)
    for k in off:
        assert on[k].dtype == off[k].dtype and np.array_equal(on[k].view(np.uint32), off[k].view(np.uint32)), k


@pytest.mark.torch
@pytest.mark.parametrize("case, compression", [("plain", None), ("clip", None), ("accumulate", None),
                                               ("scale", None), ("plain", TOPK), ("drop", TOPK), ("clip", TOPK),
                                               ("nonfinite", TOPK)],
                         ids=["plain", "clip", "accumulate", "scale", "topk-ef", "topk-ef-dropped-grad",
                              "topk-ef-clip", "topk-ef-nonfinite-round"])
def test_torch_overlap_on_and_off_give_bit_identical_parameters(tmp_path, case, compression):
    # Execute: the same script twice, overlap auto then off
    on, stats = _torch_run(tmp_path, "on", case, compression)
    off, none = _torch_run(tmp_path, "off", case, compression)
    # Assert: every parameter bit for bit; the staged work was used where .grad stayed as backward left it
    _assert_identical(on, off)
    assert none is None
    trainable = 4
    if case == "accumulate":
        assert stats.hooked == 2 * trainable * STEPS and stats.used == trainable * STEPS
    elif case in ("clip", "scale"):
        assert stats.redone >= STEPS and stats.used == (0 if case == "clip" else (trainable - 1) * STEPS)
    elif case == "plain":
        assert stats.used == trainable * STEPS and stats.redone == 0


def _tiny(framework: str):
    """(adapter, model, optimizer, backward(x, y)) of a two-layer MLP in ``framework``."""
    if framework == "torch":
        import torch

        import hybridfleet.torch as hf

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        f, tensor = torch.nn.functional, torch.from_numpy
    else:
        import paddle

        import hybridfleet.paddle as hf

        paddle.seed(0)
        model = paddle.nn.Sequential(paddle.nn.Linear(32, 64), paddle.nn.Tanh(), paddle.nn.Linear(64, 3))
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        f, tensor = paddle.nn.functional, paddle.to_tensor
    return hf, model, opt, lambda x, y: f.cross_entropy(model(tensor(x)), tensor(y)).backward()


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
def test_stage_encodes_during_backward_before_step_is_entered(tmp_path, framework):
    # Prepare
    cluster = h.start_shards(tmp_path, h.job(framework, compression=TOPK, overlap="on"))
    try:
        hf, model, opt, backward = _tiny(framework)
        ps = hf.connect(model, opt, config=cluster.config(0))
        # Execute: backward() alone
        backward(*next(_batches()))
        # Assert: the hooks handed every gradient over during backward(); the stage encodes without ps.step()
        assert ps.stage.stats.hooked == 4
        ps.stage.wait()
        assert ps.stage.stats.encoded == 4
        ps.step()
        assert ps.stage.stats.encoded_before_step == 4 and ps.stage.stats.used == 4
        ps.close()
    finally:
        cluster.stop()


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=pytest.mark.torch),
                                       pytest.param("paddle", marks=pytest.mark.paddle)])
@pytest.mark.parametrize("overlap", ["off", "auto"])  # auto: the parameters are on the CPU here
def test_overlap_off_and_auto_on_the_cpu_install_no_stage(tmp_path, framework, overlap):
    cluster = h.start_shards(tmp_path, h.job(framework, overlap=overlap))
    try:
        hf, model, opt, _ = _tiny(framework)
        ps = hf.connect(model, opt, config=cluster.config(0))
        assert ps.stage is None
        ps.close()
    finally:
        cluster.stop()
    assert h.job(framework).ps.overlap == "auto"


def test_paths_that_transform_gradients_before_encoding_stage_nothing():
    plain = h.job("torch", overlap="on")
    assert overlap_blocker(plain, local=False, aggregates=False, layout=False) is None
    auto = h.job("torch")
    assert overlap_blocker(auto, local=False, aggregates=False, layout=False, accelerator=True) is None
    assert overlap_blocker(auto, local=False, aggregates=False, layout=False).startswith(
        "ps.overlap: auto with the parameters on the CPU")
    blocked = {
        "ps.overlap: off": (h.job("torch", overlap="off"), {}),
        "no servers (local training)": (plain, {"local": True}),
        "ps.sync: local": (h.job("torch", sync="local", overlap="on"), {}),
        "site aggregation": (plain, {"aggregates": True}),
        "secure aggregation": (h.job("torch", workers=3, secure_aggregation=True, overlap="on"), {}),
        "differential privacy": (h.job("torch", privacy={"clip_norm": 1.0, "noise_multiplier": 1.0},
                                       overlap="on"), {}),
        "a mixed-framework layout": (plain, {"layout": True}),
        "codec randomk": (h.job("torch", compression={"codec": "randomk", "ratio": 0.1}, overlap="on"), {}),
    }
    for reason, (job, where) in blocked.items():
        args = {"local": False, "aggregates": False, "layout": False, **where}
        assert overlap_blocker(job, **args) == reason


# ---------------------------------------------------------------- paddle
def _paddle_run(tmp_path, overlap: str, case: str, compression: dict | None = None):
    import paddle

    import hybridfleet.paddle as hf

    cluster = h.start_shards(tmp_path / overlap, h.job("paddle", overlap=overlap, **(
        {"compression": compression} if compression else {})))
    try:
        paddle.seed(0)
        model = paddle.nn.Sequential(paddle.nn.Linear(32, 64), paddle.nn.Tanh(), paddle.nn.Linear(64, 3))
        clip = paddle.nn.ClipGradByGlobalNorm(0.05) if case == "grad_clip" else None
        opt = paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters(),
                                        grad_clip=clip)
        ps = hf.connect(model, opt, config=cluster.config(0))
        loss_of = lambda x, y: paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        for step, (x, y) in enumerate(_batches()):
            opt.clear_grad(set_to_zero=False)
            if case == "accumulate":
                for half in (slice(0, 4), slice(4, 8)):
                    (loss_of(x[half], y[half]) / 2).backward()
            elif case == "nonfinite" and step == 3:
                (loss_of(x, y) + model[0].bias.sum() * float("nan")).backward()
            else:
                loss_of(x, y).backward()
            if case == "clip":
                paddle.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif case == "zeroed" and step % 2:
                ps.stage.wait() if ps.stage is not None else None  # staged from the values before zeroing
                model[2].bias.clear_gradient()  # zeroed in place, without a version bump: values compared
            ps.step()
        stats = ps.stage.stats if ps.stage is not None else None
        assert ps.session.skipped_nonfinite == (case == "nonfinite")
        ps.close()
        return {k: v.numpy().copy() for k, v in model.state_dict().items()}, stats
    finally:
        cluster.stop()


@pytest.mark.paddle
@pytest.mark.parametrize("case, compression", [("plain", None), ("clip", None), ("accumulate", None),
                                               ("grad_clip", None), ("zeroed", None), ("plain", TOPK),
                                               ("nonfinite", TOPK)],
                         ids=["plain", "clip", "accumulate", "optimizer-grad-clip", "zeroed-in-place", "topk-ef",
                              "topk-ef-nonfinite-round"])
def test_paddle_overlap_on_and_off_give_bit_identical_parameters(tmp_path, case, compression):
    on, stats = _paddle_run(tmp_path, "on", case, compression)
    off, none = _paddle_run(tmp_path, "off", case, compression)
    _assert_identical(on, off)
    assert none is None
    if case in ("plain", "accumulate"):
        assert stats.used == 4 * STEPS and stats.redone == 0
    elif case in ("clip", "grad_clip"):
        assert stats.redone == 4 * STEPS and stats.used == 0
    elif case == "zeroed":
        assert stats.redone == STEPS // 2
