"""Server-side optimizers: each flavour reproduces its framework's optimizer; bad input is refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from hybridfleet.ps.server import optim
from hybridfleet.ps.server.optim import SGD, Adam, AdamW, ServerOptimizer, make_optimizer
from hybridfleet.spec.models import OptimizerSpec
from tests.needs import skip_outside_ci

# big.weight has more elements than one piece of a large tensor's step (optim._STEP_BLOCK), so the
# comparisons with the frameworks cover the piecewise update too
SHAPES = {"fc.weight": (16, 9), "fc.bias": (37,), "conv.weight": (3, 4, 5), "emb.weight": (1000,),
          "big.weight": (2, 65536 + 389)}
NUM_STEPS = 24
LR_CHANGE_AT_STEP = 12  # a schedule halves lr here; both sides must follow

# rtol=1e-6 is the requirement. The atol is for elements that end near zero: each update
# rounds at the scale of its operands (|param| ~ 1 here, where one float32 ulp is 1.2e-7),
# so a parameter that cancelled to ~0.01 may carry a last-bit difference of its inputs
# (torch's MKL sqrt, a CPU without FMA) that is large relative to itself. Two ulps of 1.0:
ATOL = 2 * float(np.finfo(np.float32).eps)
RTOL = 1e-6

CONFIGS = {
    "sgd": dict(name="sgd", lr=0.05),
    "sgd-wd": dict(name="sgd", lr=0.05, weight_decay=0.01),
    "momentum": dict(name="sgd", lr=0.02, momentum=0.9),
    "momentum-wd": dict(name="sgd", lr=0.02, momentum=0.8, weight_decay=0.05),
    "nesterov-wd": dict(name="sgd", lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.05),
    "adam": dict(name="adam", lr=0.01),
    "adam-wd": dict(name="adam", lr=0.01, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.05),
    "adamw-wd": dict(name="adamw", lr=0.01, weight_decay=0.1),
}


def _initial_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def _gradient_sequence() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        {name: (rng.standard_normal(shape) * rng.uniform(0.1, 3.0)).astype(np.float32)
         for name, shape in SHAPES.items()}
        for _ in range(NUM_STEPS)
    ]


def _run_server(opt: ServerOptimizer, params: dict[str, np.ndarray], grads, lr_after: float | None = None):
    for step, grads_now in enumerate(grads, start=1):
        if lr_after is not None and step == LR_CHANGE_AT_STEP:
            opt.lr = lr_after
        for name, grad in grads_now.items():
            opt.step(name, params[name], grad)
    return params


def _assert_close(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.torch
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_torch_flavour_matches_torch_optim_over_a_gradient_sequence(config):
    torch = pytest.importorskip("torch")
    # Prepare
    spec = OptimizerSpec(**CONFIGS[config])
    params0, grads = _initial_params(), _gradient_sequence()
    torch_params = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in params0.items()}
    group = list(torch_params.values())
    if spec.name == "sgd":
        torch_opt = torch.optim.SGD(group, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                                    weight_decay=spec.weight_decay)
    else:
        cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
        torch_opt = cls(group, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    server = make_optimizer(spec, flavour="torch")

    # Execute
    for step, grads_now in enumerate(grads, start=1):
        if step == LR_CHANGE_AT_STEP:
            torch_opt.param_groups[0]["lr"] = spec.lr / 2
        for name, grad in grads_now.items():
            torch_params[name].grad = torch.from_numpy(grad.copy())
        torch_opt.step()
    ours = _run_server(server, {n: p.copy() for n, p in params0.items()}, grads, lr_after=spec.lr / 2)

    # Assert: parameters and the optimizer state agree with torch's
    _assert_close(ours, {n: p.detach().numpy() for n, p in torch_params.items()})
    state = server.state_dict()
    for name, param in torch_params.items():
        for slot, value in torch_opt.state[param].items():
            if slot == "step":
                assert int(state[f"{name}/step"]) == int(value) == NUM_STEPS
            else:
                np.testing.assert_allclose(state[f"{name}/{slot}"], value.numpy(), rtol=RTOL, atol=ATOL)


def _paddle_optimizer(paddle, spec: OptimizerSpec, parameters):
    wd = spec.weight_decay or None
    if spec.name == "sgd" and spec.momentum == 0:
        return paddle.optimizer.SGD(spec.lr, parameters=parameters, weight_decay=wd)
    if spec.name == "sgd":
        return paddle.optimizer.Momentum(spec.lr, spec.momentum, parameters=parameters,
                                         use_nesterov=spec.nesterov, weight_decay=wd)
    beta1, beta2 = spec.betas
    if spec.name == "adam":
        return paddle.optimizer.Adam(spec.lr, beta1, beta2, spec.eps, parameters=parameters, weight_decay=wd)
    return paddle.optimizer.AdamW(spec.lr, beta1, beta2, spec.eps, parameters=parameters,
                                  weight_decay=spec.weight_decay)


@pytest.mark.paddle
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_paddle_flavour_matches_paddle_optimizer_over_a_gradient_sequence(config):
    paddle = pytest.importorskip("paddle")
    # Prepare
    spec = OptimizerSpec(**CONFIGS[config])
    params0, grads = _initial_params(), _gradient_sequence()
    paddle_params = {
        n: paddle.create_parameter(list(p.shape), "float32",
                                   default_initializer=paddle.nn.initializer.Assign(p.copy()))
        for n, p in params0.items()
    }
    paddle_opt = _paddle_optimizer(paddle, spec, list(paddle_params.values()))
    server = make_optimizer(spec, flavour="paddle")

    # Execute
    for step, grads_now in enumerate(grads, start=1):
        if step == LR_CHANGE_AT_STEP:
            paddle_opt.set_lr(spec.lr / 2)
        for name, grad in grads_now.items():
            paddle_params[name].grad = paddle.to_tensor(grad.copy())
        paddle_opt.step()
    ours = _run_server(server, {n: p.copy() for n, p in params0.items()}, grads, lr_after=spec.lr / 2)

    # Assert
    _assert_close(ours, {n: p.numpy() for n, p in paddle_params.items()})


@pytest.mark.parametrize("flavour", ["torch", "paddle"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_stepping_a_tensor_in_two_blocks_equals_stepping_it_whole(config, flavour):
    # Prepare
    spec = OptimizerSpec(**CONFIGS[config])
    whole, split = make_optimizer(spec, flavour), make_optimizer(spec, flavour)
    param_whole = _initial_params()["emb.weight"]
    param_split = param_whole.copy()
    cut = 389  # deliberately not a multiple of any vector width

    # Execute
    for grads_now in _gradient_sequence():
        grad = grads_now["emb.weight"]
        whole.step("emb.weight", param_whole, grad)
        split.step("emb.weight#0", param_split[:cut], grad[:cut])
        split.step("emb.weight#1", param_split[cut:], grad[cut:])

    # Assert: bit-identical, parameters and state
    np.testing.assert_array_equal(param_split, param_whole)
    state_whole, state_split = whole.state_dict(), split.state_dict()
    for entry, value in state_whole.items():
        slot = entry.rsplit("/", 1)[1]
        part0, part1 = state_split[f"emb.weight#0/{slot}"], state_split[f"emb.weight#1/{slot}"]
        joined = np.concatenate([part0, part1]) if value.ndim else part0
        np.testing.assert_array_equal(joined, value, err_msg=entry)


@pytest.mark.parametrize("flavour", ["torch", "paddle"])
@pytest.mark.parametrize("config", ["nesterov-wd", "adam-wd", "adamw-wd"])
def test_resume_from_saved_state_continues_bit_identically(config, flavour):
    # Prepare: one optimizer runs straight through; another stops halfway and is rebuilt
    spec = OptimizerSpec(**CONFIGS[config])
    grads = _gradient_sequence()
    half = NUM_STEPS // 2
    straight = _run_server(make_optimizer(spec, flavour), _initial_params(), grads)
    first = make_optimizer(spec, flavour)
    params = _run_server(first, _initial_params(), grads[:half])

    # Execute: save through safetensors bytes, load into a fresh optimizer, continue
    blob = save_safetensors(first.state_dict())
    resumed = make_optimizer(spec, flavour)
    resumed.load_state_dict(load_safetensors(blob))
    params = _run_server(resumed, params, grads[half:])

    # Assert
    for name in SHAPES:
        np.testing.assert_array_equal(params[name], straight[name], err_msg=name)


def test_state_dict_is_flat_numpy_arrays_named_key_slash_slot():
    # Prepare
    opt = make_optimizer(OptimizerSpec(name="adam", lr=0.1), flavour="paddle")
    param = np.ones((2, 3), dtype=np.float32)

    # Execute
    opt.step("fc.weight", param, np.full((2, 3), 0.5, dtype=np.float32))
    opt.step("fc.weight", param, np.full((2, 3), 0.5, dtype=np.float32))
    state = opt.state_dict()

    # Assert
    assert sorted(state) == ["fc.weight/beta1_pow", "fc.weight/beta2_pow", "fc.weight/exp_avg",
                             "fc.weight/exp_avg_sq", "fc.weight/step"]
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert int(state["fc.weight/step"]) == 2
    assert state["fc.weight/exp_avg"].shape == (2, 3)
    assert state["fc.weight/beta1_pow"] == np.float32(0.9) * np.float32(0.9) * np.float32(0.9)


def test_scalar_parameter_is_updated_in_place():
    # Prepare
    opt = SGD(lr=0.5, momentum=0.5)
    param = np.array(2.0, dtype=np.float32)

    # Execute
    opt.step("scale", param, np.array(1.0, dtype=np.float32))
    opt.step("scale", param, np.array(1.0, dtype=np.float32))

    # Assert: buffer 1 then 1.5; param 2 - 0.5 - 0.75
    assert param == np.float32(0.75)


@pytest.mark.parametrize("flavour", ["torch", "paddle"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_scalar_parameter_steps_like_a_one_element_tensor(config, flavour):
    # Prepare
    spec = OptimizerSpec(**CONFIGS[config])
    opt = make_optimizer(spec, flavour)
    scalar, vector = np.array(0.7, dtype=np.float32), np.array([0.7], dtype=np.float32)

    # Execute
    for i in range(5):
        grad = np.float32(0.3 * i - 0.2)
        opt.step("scalar", scalar, np.array(grad))
        opt.step("vector", vector, np.array([grad]))

    # Assert
    assert scalar.shape == ()
    assert scalar == vector[0]
    assert scalar != np.float32(0.7)


def _stepped_adam() -> tuple[Adam, np.ndarray, dict[str, np.ndarray]]:
    opt = Adam(lr=0.01, weight_decay=0.01)
    param = np.linspace(-1, 1, 6, dtype=np.float32)
    opt.step("fc.bias", param, np.full(6, 0.25, dtype=np.float32))
    return opt, param, opt.state_dict()


def test_shape_mismatch_raises_naming_key_and_leaves_param_and_state_unchanged():
    # Prepare
    opt, param, state_before = _stepped_adam()
    param_before = param.copy()

    # Execute
    with pytest.raises(ValueError) as err:
        opt.step("fc.bias", param, np.zeros(5, dtype=np.float32))

    # Assert
    assert "key 'fc.bias'" in str(err.value)
    assert "grad shape (5,) does not match param shape (6,)" in str(err.value)
    np.testing.assert_array_equal(param, param_before)
    after = opt.state_dict()
    assert sorted(after) == sorted(state_before)
    for entry in state_before:
        np.testing.assert_array_equal(after[entry], state_before[entry])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])
def test_non_finite_grad_raises_naming_key_and_leaves_param_and_state_unchanged(bad):
    # Prepare: 1e300 is finite in float64 but overflows the float32 update
    opt, param, state_before = _stepped_adam()
    param_before = param.copy()
    grad = np.full(6, 0.25, dtype=np.float64)
    grad[3] = bad

    # Execute
    with pytest.raises(ValueError) as err:
        opt.step("fc.bias", param, grad)

    # Assert
    assert "key 'fc.bias'" in str(err.value)
    assert "grad has 1 non-finite value(s)" in str(err.value)
    np.testing.assert_array_equal(param, param_before)
    after = opt.state_dict()
    for entry in state_before:
        np.testing.assert_array_equal(after[entry], state_before[entry])


def test_param_of_another_shape_than_its_state_is_refused():
    # Prepare
    opt, _, _ = _stepped_adam()
    other = np.zeros(4, dtype=np.float32)

    # Execute
    with pytest.raises(ValueError) as err:
        opt.step("fc.bias", other, np.zeros(4, dtype=np.float32))

    # Assert
    assert "param has shape (4,) but its optimizer state 'exp_avg' has shape (6,)" in str(err.value)
    assert not other.any()


def test_param_that_is_not_float32_is_refused():
    # Prepare
    opt = SGD(lr=0.1)
    param = np.zeros(3, dtype=np.float64)

    # Execute
    with pytest.raises(ValueError) as err:
        opt.step("w", param, np.ones(3, dtype=np.float32))

    # Assert
    assert "key 'w': param must be a float32 numpy array (got float64)" in str(err.value)
    assert opt.state_dict() == {}


def test_unknown_optimizer_name_lists_the_valid_names():
    # Prepare: the spec model refuses unknown names, so build one past validation
    spec = OptimizerSpec.model_construct(name="lamb", lr=0.1)

    # Execute
    with pytest.raises(ValueError) as err:
        make_optimizer(spec)

    # Assert
    assert "unknown 'lamb'; valid names: adam, adamw, sgd" in str(err.value)


def test_unknown_flavour_lists_the_valid_flavours():
    with pytest.raises(ValueError) as err:
        make_optimizer(OptimizerSpec(name="sgd"), flavour="jax")
    assert "flavour: must be one of torch, paddle (got 'jax')" in str(err.value)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Adam(lr=0.1, betas=(1.2, 0.999)), "betas[0]: must be a finite number >= 0 and < 1 (got 1.2)"),
        (lambda: AdamW(lr=0.1, eps=0.0), "eps: must be a finite number > 0 (got 0.0)"),
        (lambda: SGD(lr=0.1, nesterov=True), "nesterov: needs momentum > 0"),
        (lambda: SGD(lr=float("nan")), "lr: must be a finite number >= 0 (got nan)"),
    ],
)
def test_bad_hyperparameters_are_refused_with_the_field_named(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert message in str(err.value)


def test_setting_a_negative_lr_is_refused_and_keeps_the_old_lr():
    # Prepare
    opt = SGD(lr=0.1)

    # Execute
    with pytest.raises(ValueError) as err:
        opt.lr = -1.0

    # Assert
    assert "lr: must be a finite number >= 0 (got -1.0)" in str(err.value)
    assert opt.lr == 0.1


def test_loading_state_saved_by_another_flavour_is_refused_and_keeps_current_state():
    # Prepare
    paddle_adam = make_optimizer(OptimizerSpec(name="adam"), flavour="paddle")
    paddle_adam.step("w", np.ones(3, dtype=np.float32), np.ones(3, dtype=np.float32))
    torch_adam, _, state_before = _stepped_adam()

    # Execute
    with pytest.raises(ValueError) as err:
        torch_adam.load_state_dict(paddle_adam.state_dict())

    # Assert
    assert "optimizer state for key 'w'" in str(err.value)
    assert "unexpected ['beta1_pow', 'beta2_pow']" in str(err.value)
    assert sorted(torch_adam.state_dict()) == sorted(state_before)


def test_loading_state_with_a_wrong_dtype_is_refused():
    # Prepare
    opt, _, state = _stepped_adam()
    state["fc.bias/exp_avg"] = state["fc.bias/exp_avg"].astype(np.float64)

    # Execute
    with pytest.raises(ValueError) as err:
        Adam(lr=0.01).load_state_dict(state)

    # Assert
    assert "key 'fc.bias': slot 'exp_avg' must be float32 (got float64)" in str(err.value)


def test_importing_the_optimizers_imports_no_framework():
    # Execute
    code = ("import sys, hybridfleet.ps.server.optim, hybridfleet.ps.wire.sharding; "
            "print(sorted(m for m in ('torch', 'paddle') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    # Assert
    assert out.stdout.strip() == "[]"


def test_blockwise_fma_of_a_large_tensor_equals_the_one_pass_formula():
    # Prepare: more elements than one scratch block, an array and a scalar multiplier
    from hybridfleet.ps.server.optim import _FMA_BLOCK, _fma

    rng = np.random.default_rng(7)
    n = 3 * _FMA_BLOCK + 123
    a, b, c = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))

    # Execute
    got_array, got_scalar = _fma(a, b, c), _fma(np.float32(-0.01), b, c)

    # Assert: bit for bit what a single float64 pass rounded to float32 gives
    one_pass = lambda x: (np.multiply(x, b, dtype=np.float64) + c).astype(np.float32)  # noqa: E731
    assert got_array.dtype == np.float32 and got_array.shape == (n,)
    assert np.array_equal(got_array, one_pass(a))
    assert np.array_equal(got_scalar, one_pass(np.float32(-0.01)))


@pytest.mark.parametrize("flavour", ["torch", "paddle"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_large_tensor_stepped_in_pieces_equals_one_pass_to_the_bit(config, flavour, monkeypatch):
    # Prepare: the same optimizer twice, once stepping in pieces (the default above _STEP_BLOCK
    # elements) and once in a single pass (the piece size raised above the tensor)
    from hybridfleet.ps.server import optim

    spec = OptimizerSpec(**CONFIGS[config])
    rng = np.random.default_rng(3)
    n = 3 * optim._STEP_BLOCK + 389  # the last piece is a partial one
    start = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * (k + 1)).astype(np.float32) for k in range(4)]

    def run(block: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        monkeypatch.setattr(optim, "_STEP_BLOCK", block)
        opt, param = make_optimizer(spec, flavour), start.copy()
        for grad in grads:
            opt.step("w", param, grad)
        return param, opt.state_dict()

    # Execute
    pieces, one_pass = run(optim._STEP_BLOCK), run(2 * n)

    # Assert: parameters and every slot (Paddle's beta powers too) identical
    np.testing.assert_array_equal(pieces[0], one_pass[0])
    assert sorted(pieces[1]) == sorted(one_pass[1])
    for entry, value in one_pass[1].items():
        np.testing.assert_array_equal(pieces[1][entry], value, err_msg=entry)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_stepping_a_large_tensor_allocates_pieces_not_copies_of_it(name):
    # Prepare: a 16 MiB key whose state exists (the second step allocates no new slots)
    import tracemalloc

    spec = OptimizerSpec(**(CONFIGS["adam-wd"] if name == "adam" else CONFIGS["nesterov-wd"]))
    opt = make_optimizer(spec, "torch")
    rng = np.random.default_rng(5)
    param = rng.standard_normal(4 << 20).astype(np.float32)
    grad = rng.standard_normal(param.size).astype(np.float32)
    opt.step("w", param, grad)
    before = param.copy()

    # Execute
    tracemalloc.start()
    try:
        opt.step("w", param, grad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # Assert: the step's temporaries are piece-sized (one pass held several 16 MiB arrays at once)
    assert peak < 4 << 20, f"a step of a 16 MiB tensor allocated {peak / 2**20:.1f} MiB at its peak"
    assert not np.array_equal(param, before)


NATIVE_NOT_BUILT = ("the hybridfleet.ps.server._optim extension is not built (no C compiler at install: "
                    "run .ci/install-build-deps.sh, then pip install -e .)")
NATIVE_CONFIGS = {**CONFIGS,
                  "nesterov": dict(name="sgd", lr=0.03, momentum=0.7, nesterov=True),
                  # 1 - beta1 >= 0.5: torch's lerp takes its other branch
                  "adam-low-beta1": dict(name="adam", lr=0.02, betas=(0.3, 0.6), eps=1e-7, weight_decay=0.02),
                  "adamw-low-beta1": dict(name="adamw", lr=0.02, betas=(0.4, 0.9), weight_decay=0.3)}


def _wide_gradients(shape, steps: int, seed: int) -> list[np.ndarray]:
    """Gradients over float32's range: ordinary, tiny (subnormal squares), huge, exact zeros."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        g = rng.standard_normal(shape).astype(np.float32)
        scale = rng.choice(np.array([1.0, 1e-20, 1e-40, 1e15, 0.0], dtype=np.float64), size=shape, p=[.6, .1, .1, .1, .1])
        out.append(np.array(g * scale, dtype=np.float32))
    return out


ISAS = optim._optim._isas() if optim._optim is not None else []


@skip_outside_ci(None if optim._optim is not None else NATIVE_NOT_BUILT)
@pytest.mark.parametrize("isa", ISAS or ["none"])
@pytest.mark.parametrize("flavour", ["torch", "paddle"])
@pytest.mark.parametrize("config", sorted(NATIVE_CONFIGS))
def test_the_c_step_equals_the_numpy_step_to_the_bit(config, flavour, isa, monkeypatch):
    # Prepare: the same optimizer twice, the same tensors (one element, odd sizes, one above a
    # piece of the numpy path's blockwise step), 12 steps with an lr change after 6
    spec = OptimizerSpec(**NATIVE_CONFIGS[config])
    shapes = {"scalar": (), "odd": (7,), "mid": (3, 333), "big": (65536 + 777,)}
    rng = np.random.default_rng(5)
    params0 = {k: np.array(rng.standard_normal(s), dtype=np.float32) for k, s in shapes.items()}
    grads = {k: _wide_gradients(s, 12, i) for i, (k, s) in enumerate(shapes.items())}
    # a gradient read from the wire may start at any byte (numpy: not aligned, buffer format "=f")
    grads["big"] = [np.frombuffer(bytearray(b"\0" + g.tobytes()), dtype=np.float32, offset=1) for g in grads["big"]]
    assert not grads["big"][0].flags.aligned
    calls = []
    real = getattr(optim._optim, spec.name[:4])  # sgd, adam (AdamW: adam with decoupled decay)
    monkeypatch.setattr(optim._optim, spec.name[:4], lambda *a: calls.append(1) or real(*a))

    def run(native: bool):
        monkeypatch.setenv(optim.NATIVE_SWITCH, "1" if native else "0")
        opt = make_optimizer(spec, flavour)
        params = {k: p.copy() for k, p in params0.items()}
        params["mid"] = np.frombuffer(bytearray(b"\0\0" + params0["mid"].tobytes()), dtype=np.float32,
                                      offset=2).reshape(params0["mid"].shape)  # updated in place, unaligned
        for step in range(12):
            if step == 6:
                opt.lr = spec.lr / 3
            for k in shapes:
                opt.step(k, params[k], grads[k][step])
        return params, opt.state_dict()

    # Execute: with each instruction set's copy of the C step this CPU runs
    numpy_params, numpy_state = run(native=False)
    assert not calls
    before = optim._optim._set_isa(isa)
    try:
        c_params, c_state = run(native=True)
    finally:
        optim._optim._set_isa(before)

    # Assert: every parameter and every slot identical to the bit (NaN-free: the inputs are finite)
    assert len(calls) == 12 * len(shapes)
    for k in shapes:
        assert np.array_equal(c_params[k].view(np.uint32), numpy_params[k].view(np.uint32)), k
    assert c_state.keys() == numpy_state.keys()
    for name, value in numpy_state.items():
        assert value.dtype == c_state[name].dtype and np.array_equal(c_state[name], value), name
        if value.dtype == np.float32:
            assert np.array_equal(c_state[name].view(np.uint32), value.view(np.uint32)), name
