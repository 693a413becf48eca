"""Framework adapters: the same contract for torch and paddle (tensors, state dicts, RNG)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from hybridfleet.errors import CheckpointError, FrameworkMissingError
from hybridfleet.frameworks import get_adapter

FRAMEWORKS = ["torch", "paddle"]


def make_model(framework: str, seed: int = 0):
    """A tiny Linear-BatchNorm-Linear model of ``framework``, seeded."""
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    import paddle

    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.BatchNorm1D(8), paddle.nn.Linear(8, 3))


def make_trained_optimizer(framework: str, model):
    """An Adam optimizer of ``model`` after one step, so it has state."""
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    if framework == "torch":
        import torch

        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.from_numpy(x)).pow(2).mean().backward()
    else:
        import paddle

        opt = paddle.optimizer.Adam(learning_rate=1e-2, parameters=model.parameters())
        model(paddle.to_tensor(x)).pow(2).mean().backward()
    opt.step()
    return opt


@pytest.fixture(params=FRAMEWORKS)
def framework(request) -> str:
    return request.param


def test_importing_frameworks_package_imports_neither_framework():
    code = "import sys, hybridfleet.frameworks, hybridfleet.ckpt, hybridfleet.store; print('torch' in sys.modules, 'paddle' in sys.modules)"

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert out.split() == ["False", "False"]


def test_unknown_framework_name_is_rejected_listing_known_ones():
    with pytest.raises(ValueError, match="unknown framework 'jax'.*'paddle', 'torch'"):
        get_adapter("jax")


def test_missing_framework_raises_install_hint(monkeypatch):
    # Simulate an environment without torch (it is installed here).
    monkeypatch.setitem(sys.modules, "torch", None)

    with pytest.raises(FrameworkMissingError, match=r"pip install 'hybridfleet\[torch\]'"):
        get_adapter("torch")


def test_numpy_round_trip_keeps_values_dtype_and_shape(framework):
    adapter = get_adapter(framework)
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)

    back = adapter.to_numpy(adapter.from_numpy(arr))

    assert back.dtype == arr.dtype and back.shape == arr.shape and back.flags.c_contiguous
    np.testing.assert_array_equal(back, arr)


def test_model_state_round_trip_is_bitwise(framework):
    adapter = get_adapter(framework)
    source, target = make_model(framework, seed=1), make_model(framework, seed=2)

    adapter.load_model_state(target, adapter.model_state(source))

    after = adapter.model_state(target)
    for name, arr in adapter.model_state(source).items():
        np.testing.assert_array_equal(after[name], arr, err_msg=name)


def test_model_state_is_a_snapshot_not_a_view(framework):
    adapter = get_adapter(framework)
    model = make_model(framework)
    state = adapter.model_state(model)
    before = {k: v.copy() for k, v in state.items()}

    make_trained_optimizer(framework, model)

    for name in before:
        np.testing.assert_array_equal(state[name], before[name])


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape"])
def test_mismatched_state_is_rejected_naming_tensor_and_model_unchanged(framework, problem):
    adapter = get_adapter(framework)
    model = make_model(framework)
    before = adapter.model_state(model)
    state = {k: np.zeros_like(v) for k, v in before.items()}
    first = sorted(state)[0]
    if problem == "missing":
        del state[first]
        expected = f"missing tensors: {first}"
    elif problem == "unexpected":
        state["extra.weight"] = np.zeros(3, np.float32)
        expected = "unexpected tensors: extra.weight"
    else:
        state[first] = np.zeros((99,), np.float32)
        expected = f"shape mismatch: {first} \\(checkpoint \\[99\\]"

    with pytest.raises(CheckpointError, match=expected):
        adapter.load_model_state(model, state)

    for name, arr in adapter.model_state(model).items():
        np.testing.assert_array_equal(arr, before[name])


def test_optimizer_state_round_trip_through_json(framework):
    adapter = get_adapter(framework)
    model = make_model(framework)
    opt = make_trained_optimizer(framework, model)
    tensors, meta = adapter.optimizer_state(opt)
    meta = json.loads(json.dumps(meta))
    fresh_model = make_model(framework)
    adapter.load_model_state(fresh_model, adapter.model_state(model))
    fresh_opt = make_trained_optimizer(framework, fresh_model)

    adapter.load_optimizer_state(fresh_opt, tensors, meta)

    again, again_meta = adapter.optimizer_state(fresh_opt)
    assert sorted(again) == sorted(tensors) and len(tensors) > 0
    for name in tensors:
        np.testing.assert_array_equal(again[name], tensors[name], err_msg=name)
    assert json.loads(json.dumps(again_meta)) == meta


def test_rng_state_round_trip_reproduces_python_numpy_and_framework_draws(framework):
    adapter = get_adapter(framework)
    saved = json.loads(json.dumps(adapter.rng_state()))

    def draws():
        if framework == "torch":
            import torch

            fw = torch.rand(4).numpy()
        else:
            import paddle

            fw = paddle.rand([4]).numpy()
        return random.random(), np.random.rand(3).tolist(), fw.tolist()

    first = draws()
    adapter.set_rng_state(saved)
    second = draws()

    assert first == second


def test_module_kinds_records_layer_kind_per_tensor(framework):
    kinds = get_adapter(framework).module_kinds(make_model(framework))

    assert kinds["0.weight"] == "linear" and kinds["2.bias"] == "linear"
    assert kinds["1.weight"] == "batchnorm"
