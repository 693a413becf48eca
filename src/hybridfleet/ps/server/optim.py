"""Server-side optimizers: a parameter-server shard applies aggregated gradients itself.

SGD (momentum, Nesterov, L2 weight decay), Adam (L2 weight decay, bias correction) and
AdamW (decoupled weight decay) on float32 numpy arrays, in two flavours that reproduce
the job's framework:

* ``torch``: ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` (dampening 0, no amsgrad).
* ``paddle``: ``paddle.optimizer.SGD`` (momentum 0) or ``Momentum`` (``use_nesterov``),
  ``Adam`` and ``AdamW``, with Paddle's own conventions: Adam folds bias correction into
  ``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`` and scales epsilon by ``sqrt(1 - b2^t)``,
  keeps ``b1^t`` / ``b2^t`` as float32 accumulators multiplied once per step, applies a
  float ``weight_decay`` as L2 regularisation (Adam, SGD, Momentum) or as
  ``p -= lr * coeff * p`` (AdamW).

All arithmetic is float32, rounded where the frameworks' CPU kernels round: both
frameworks' vectorised kernels use fused multiply-adds for some steps (torch's
``add(alpha=)``, ``lerp`` and ``addcmul``; Paddle's AVX-512 Adam/AdamW kernels), so
`_fma` reproduces a single rounding there. Keeping state in float64 instead drifts
further from both frameworks, not closer. One framework choice is not followed: Paddle's
plain SGD uses its vector kernel (separate multiply and subtract, as here) only for
tensors whose size is a multiple of 8 and a fused loop otherwise; following that would
make results depend on how a tensor is cut into blocks, so those tensors may differ from
Paddle by one float32 rounding per step.

State is per key and element-wise, so a parameter split into blocks (``"fc.weight#0"``,
``"fc.weight#1"``) is updated exactly as the whole tensor would be.

Where the C extension ``_optim`` is built, SGD, Adam and AdamW step a float32 C-contiguous
tensor in place in one vectorized pass (`ServerOptimizer._step_native`) instead of the
numpy passes below: the same float32 operations in the same order, each `_fma` the same
two roundings, compiled without contraction, so the two paths agree to the bit
(tests/test_ps_optim.py, each instruction set's copy); per 64 MiB tensor here 3-5x less CPU. ``HFLEET_NATIVE_OPTIM=0``
selects the numpy path.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hybridfleet.switches import switched_on

try:  # SGD's and Adam's step in one pass in C (_optim.c), when a compiler was there at install time
    from hybridfleet.ps.server import _optim
except ImportError:  # pragma: no cover - depends on the install
    _optim = None

NATIVE_SWITCH = "HFLEET_NATIVE_OPTIM"  # "0": step with numpy even where the C step is built
FLAVOURS = ("torch", "paddle")
OPTIMIZER_NAMES = ("adam", "adamw", "sgd")
STEP_SLOT = "step"

_F32 = np.float32
_ONE = np.float32(1.0)


_FMA_BLOCK = 1 << 16  # elements per pass: the float64 scratch stays in cache, nothing large is allocated
# Elements per piece of a large tensor's step (`ServerOptimizer._step_in_blocks`): an update's
# temporaries are a few arrays of this size instead of several copies of the tensor.
_STEP_BLOCK = 1 << 16


def _fma(a: Any, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a * b + c`` rounded once to float32, as a fused multiply-add does.

    The product of two float32 values is exact in float64, so only the final sum is
    rounded (twice, 64 then 32 bits, which differs from a true FMA only on exact ties).
    Large tensors go through a small float64 scratch block by block, with the same result.
    """
    arrays = [x for x in (a, b, c) if isinstance(x, np.ndarray) and x.ndim]
    shape = arrays[0].shape if arrays else ()
    if not arrays or any(x.shape != shape for x in arrays) or arrays[0].size <= _FMA_BLOCK:
        acc = np.asarray(np.multiply(a, b, dtype=np.float64))  # asarray: 0-d params give scalars
        np.add(acc, c, out=acc)
        return acc.astype(_F32)
    flat = [x.reshape(-1) if isinstance(x, np.ndarray) and x.ndim else x for x in (a, b, c)]
    out = np.empty(shape, dtype=_F32)
    out_flat = out.reshape(-1)
    scratch = np.empty(_FMA_BLOCK, dtype=np.float64)
    for i in range(0, out_flat.size, _FMA_BLOCK):
        j = min(i + _FMA_BLOCK, out_flat.size)
        fa, fb, fc = (x[i:j] if isinstance(x, np.ndarray) and x.ndim else x for x in flat)
        acc = scratch[: j - i]
        np.multiply(fa, fb, out=acc, dtype=np.float64)
        np.add(acc, fc, out=acc)
        out_flat[i:j] = acc
    return out


def _check_finite_number(field: str, value: float, *, low: float, high: float | None = None,
                         low_inclusive: bool = True) -> float:
    value = float(value)
    too_low = value < low if low_inclusive else value <= low
    if not math.isfinite(value) or too_low or (high is not None and value >= high):
        bound = f"{'>=' if low_inclusive else '>'} {low:g}" + (f" and < {high:g}" if high is not None else "")
        raise ValueError(f"{field}: must be a finite number {bound} (got {value!r})")
    return value


class ServerOptimizer(ABC):
    """Applies gradients to float32 parameters in place, keeping its state per key.

    Subclasses define the tensor-shaped slots they keep (`_tensor_slots`), the
    scalar slots (`_scalar_slots`) and the update itself (`_update`); this base
    validates input, counts steps and (de)serialises the state.
    """

    name: ClassVar[str]

    def __init__(self, *, lr: float, weight_decay: float, flavour: str) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour: must be one of {', '.join(FLAVOURS)} (got {flavour!r})")
        self._flavour = flavour
        self.lr = lr
        self.weight_decay = _check_finite_number("weight_decay", weight_decay, low=0.0)
        self._state: dict[str, dict[str, np.ndarray]] = {}

    @property
    def flavour(self) -> str:
        """The framework whose optimizer this one reproduces: ``torch`` or ``paddle``."""
        return self._flavour

    @property
    def lr(self) -> float:
        """The learning rate used by the next `step` (schedules set it between steps)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = _check_finite_number("lr", value, low=0.0)

    # -- what a subclass provides -------------------------------------------------------

    @abstractmethod
    def _tensor_slots(self) -> tuple[str, ...]:
        """Names of the state arrays shaped like the parameter."""

    def _scalar_slots(self) -> tuple[str, ...]:
        """Names of 0-d float32 state values (besides the step count)."""
        return ()

    def _fresh_scalars(self) -> dict[str, np.ndarray]:
        """The scalar slots of a key that has not been stepped yet."""
        return {}

    @abstractmethod
    def _update(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                step: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The new parameter and state after step number ``step`` (1-based).

        Must not modify ``param``, ``grad`` or the arrays in ``state``.
        """

    # -- public interface ---------------------------------------------------------------

    def step(self, key: str, param: np.ndarray, grad: np.ndarray) -> None:
        """Apply ``grad`` to ``param`` in place and advance the state kept for ``key``.

        Raises ValueError naming the key and the problem (wrong dtype, shape mismatch,
        non-finite gradient, state of another shape) and then leaves both the parameter
        and the optimizer state exactly as they were.
        """
        grad32 = self._validated_grad(key, param, grad)
        state = self._state.get(key)
        if state is None:
            state = self._fresh_state(param.shape)
        else:
            for slot in self._tensor_slots():
                if state[slot].shape != param.shape:
                    raise ValueError(
                        f"{self.name} step for key {key!r}: param has shape {param.shape} but its "
                        f"optimizer state {slot!r} has shape {state[slot].shape}"
                    )
        step = int(state[STEP_SLOT]) + 1
        if native_step_available() and self._step_native(key, param, grad32, state, step):
            return
        if param.size > _STEP_BLOCK and all(a.flags.c_contiguous for a in (param, grad32, *self._tensors(state))):
            self._step_in_blocks(key, param, grad32, state, step)
            return
        new_param, new_state = self._update(param, grad32, state, step)
        new_state[STEP_SLOT] = np.array(step, dtype=np.int64)
        # Commit only once everything is computed, so a failure leaves nothing half-done.
        param[...] = new_param
        self._state[key] = new_state

    def _step_native(self, key: str, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                     step: int) -> bool:
        """`step` in C, in place, for an optimizer that has a one-pass kernel (`SGD`, `Adam`): True when it
        ran. The input was checked whole before; the kernel does not fail on any float32 input, so
        nothing is left half-stepped."""
        return False

    def _commit(self, key: str, state: dict[str, np.ndarray], step: int, scalars: dict[str, np.ndarray]) -> None:
        committed = {**state, **scalars}
        committed[STEP_SLOT] = np.array(step, dtype=np.int64)
        self._state[key] = committed

    def _tensors(self, state: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [state[slot] for slot in self._tensor_slots()]

    def _step_in_blocks(self, key: str, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                        step: int) -> None:
        """`step` for a large tensor: the update runs over ``_STEP_BLOCK`` elements at a time and
        writes each piece's new parameter and slots in place, so its temporaries are a few pieces,
        not several copies of the tensor. Every element's arithmetic is the same as in one pass
        (the update is element-wise), so the result is identical to the bit. The input was
        checked whole before the first piece is written, and what runs after that (float32
        arithmetic on piece-sized arrays) does not fail on any input, so no key is left half-stepped
        by a refusal. The scalar slots every piece reads (Paddle's ``beta1_pow``/``beta2_pow``)
        change once, after the last piece."""
        flat_param, flat_grad = param.reshape(-1), grad.reshape(-1)
        slots = self._tensor_slots()
        flat_slots = {slot: state[slot].reshape(-1) for slot in slots}
        new_state: dict[str, np.ndarray] = {}
        for i in range(0, flat_param.size, _STEP_BLOCK):
            j = min(i + _STEP_BLOCK, flat_param.size)
            piece = {**state, **{slot: flat_slots[slot][i:j] for slot in slots}}
            new_param, new_state = self._update(flat_param[i:j], flat_grad[i:j], piece, step)
            flat_param[i:j] = new_param
            for slot in slots:
                flat_slots[slot][i:j] = new_state[slot]
        self._commit(key, state, step, {slot: value for slot, value in new_state.items() if slot not in slots})

    def state_dict(self) -> dict[str, np.ndarray]:
        """A flat copy of the state: ``"<key>/<slot>"`` -> numpy array (safetensors-ready)."""
        return {f"{key}/{slot}": value.copy()
                for key in sorted(self._state)
                for slot, value in sorted(self._state[key].items())}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the whole state with ``state`` (as returned by `state_dict`).

        After loading, steps continue bit-identically to an optimizer that was never
        interrupted. Raises ValueError naming the entry at fault (unknown or missing
        slot, wrong dtype or shape) and then keeps the current state.
        """
        grouped: dict[str, dict[str, np.ndarray]] = {}
        for name, value in state.items():
            if not isinstance(name, str) or "/" not in name:
                raise ValueError(f"optimizer state entry {name!r}: names are '<key>/<slot>'")
            key, slot = name.rsplit("/", 1)
            if not isinstance(value, np.ndarray):
                raise ValueError(f"optimizer state entry {name!r}: must be a numpy array "
                                 f"(got {type(value).__name__})")
            grouped.setdefault(key, {})[slot] = value
        loaded = {key: self._validated_key_state(key, slots) for key, slots in grouped.items()}
        self._state = loaded

    # -- helpers ------------------------------------------------------------------------

    def _fresh_state(self, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        state = {slot: np.zeros(shape, dtype=_F32) for slot in self._tensor_slots()}
        state.update(self._fresh_scalars())
        state[STEP_SLOT] = np.array(0, dtype=np.int64)
        return state

    def _validated_grad(self, key: str, param: np.ndarray, grad: np.ndarray) -> np.ndarray:
        where = f"{self.name} step for key {key!r}"
        if not isinstance(key, str) or not key:
            raise ValueError(f"{self.name} step: key must be a non-empty string (got {key!r})")
        if not isinstance(param, np.ndarray) or param.dtype != _F32:
            got = param.dtype if isinstance(param, np.ndarray) else type(param).__name__
            raise ValueError(f"{where}: param must be a float32 numpy array (got {got})")
        if not param.flags.writeable:
            raise ValueError(f"{where}: param is read-only; it is updated in place")
        if not isinstance(grad, np.ndarray) or grad.dtype.kind != "f":
            got = grad.dtype if isinstance(grad, np.ndarray) else type(grad).__name__
            raise ValueError(f"{where}: grad must be a floating-point numpy array (got {got})")
        if grad.shape != param.shape:
            raise ValueError(f"{where}: grad shape {grad.shape} does not match param shape {param.shape}")
        with np.errstate(over="ignore"):  # overflow to inf is reported just below
            grad32 = grad.astype(_F32, copy=False)
        flat = grad32.reshape(-1)
        bad = sum(int(flat[i:i + _STEP_BLOCK].size - np.count_nonzero(np.isfinite(flat[i:i + _STEP_BLOCK])))
                  for i in range(0, flat.size, _STEP_BLOCK))  # in pieces: no tensor-sized mask
        if bad:
            raise ValueError(f"{where}: grad has {bad} non-finite value(s) (NaN or inf, "
                             f"in float32); the update was not applied")
        return grad32

    def _validated_key_state(self, key: str, slots: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        where = f"optimizer state for key {key!r}"
        expected = {STEP_SLOT, *self._tensor_slots(), *self._scalar_slots()}
        if set(slots) != expected:
            missing = sorted(expected - set(slots))
            extra = sorted(set(slots) - expected)
            raise ValueError(
                f"{where}: {self.name} ({self.flavour}) keeps slots {sorted(expected)}; "
                f"missing {missing}, unexpected {extra} (was it saved by another optimizer or flavour?)"
            )
        step = slots[STEP_SLOT]
        if step.shape != () or step.dtype.kind not in "iu" or int(step) < 1:
            raise ValueError(f"{where}: slot 'step' must be a 0-d integer array >= 1 "
                             f"(got dtype {step.dtype}, shape {step.shape})")
        shapes = {slots[s].shape for s in self._tensor_slots()}
        if len(shapes) > 1:
            raise ValueError(f"{where}: tensor slots disagree on shape ({sorted(shapes)})")
        for slot in (*self._tensor_slots(), *self._scalar_slots()):
            value = slots[slot]
            if value.dtype != _F32:
                raise ValueError(f"{where}: slot {slot!r} must be float32 (got {value.dtype})")
            if slot in self._scalar_slots() and value.shape != ():
                raise ValueError(f"{where}: slot {slot!r} must be 0-d (got shape {value.shape})")
        out = {slot: np.array(value, copy=True) for slot, value in slots.items()}
        out[STEP_SLOT] = out[STEP_SLOT].astype(np.int64)
        return out


class SGD(ServerOptimizer):
    """Stochastic gradient descent with optional momentum, Nesterov and L2 weight decay.

    torch flavour: ``torch.optim.SGD`` with dampening 0. paddle flavour:
    ``paddle.optimizer.SGD`` when momentum is 0, else ``paddle.optimizer.Momentum``.
    """

    name = "sgd"

    def __init__(self, *, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, flavour: str = "torch") -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, flavour=flavour)
        self.momentum = _check_finite_number("momentum", momentum, low=0.0, high=1.0)
        if nesterov and self.momentum == 0:
            raise ValueError("nesterov: needs momentum > 0")
        self.nesterov = bool(nesterov)

    def _tensor_slots(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum > 0 else ()

    def _update(self, param, grad, state, step):
        if self.flavour == "torch":
            return self._update_torch(param, grad, state, step)
        return self._update_paddle(param, grad, state)

    def _step_native(self, key, param, grad, state, step):
        buf = state.get("momentum_buffer")
        if not all(a.dtype == _F32 and a.flags.c_contiguous for a in (param, grad, *([buf] if buf is not None else []))):
            return False
        flags = ((1 if self.weight_decay else 0) | (2 if self.momentum > 0 else 0) | (4 if self.nesterov else 0)
                 | (8 if self.momentum > 0 and step == 1 and self.flavour == "torch" else 0))
        # the float32 scalars `_update_torch` / `_update_paddle` use
        _optim.sgd(param, grad, buf, self.flavour, flags, float(_F32(self.lr)), float(_F32(self.momentum)),
                   float(_F32(self.weight_decay)))
        self._commit(key, state, step, {})
        return True

    def _update_torch(self, param, grad, state, step):
        mu = _F32(self.momentum)
        if self.weight_decay:
            grad = _fma(_F32(self.weight_decay), param, grad)
        new_state = {}
        if self.momentum > 0:
            # torch starts the buffer as a copy of the first gradient.
            buf = grad.copy() if step == 1 else state["momentum_buffer"] * mu + grad
            new_state["momentum_buffer"] = buf
            grad = _fma(mu, buf, grad) if self.nesterov else buf
        return _fma(-_F32(self.lr), grad, param), new_state

    def _update_paddle(self, param, grad, state):
        lr, mu = _F32(self.lr), _F32(self.momentum)
        if self.weight_decay:
            grad = param * _F32(self.weight_decay) + grad
        if self.momentum == 0:
            return param - lr * grad, {}
        velocity = state["momentum_buffer"] * mu + grad
        if self.nesterov:
            new_param = param - (grad + velocity * mu) * lr
        else:
            new_param = param - lr * velocity
        return new_param, {"momentum_buffer": velocity}


class Adam(ServerOptimizer):
    """Adam with bias correction; ``weight_decay`` is L2 added to the gradient.

    torch flavour: ``torch.optim.Adam``. paddle flavour: ``paddle.optimizer.Adam``
    (epsilon scaled by ``sqrt(1 - b2^t)``, float32 ``beta1_pow``/``beta2_pow`` state).
    """

    name = "adam"
    decoupled_weight_decay: ClassVar[bool] = False

    def __init__(self, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, flavour: str = "torch") -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, flavour=flavour)
        if len(betas) != 2:
            raise ValueError(f"betas: must be two numbers (got {betas!r})")
        self.beta1 = _check_finite_number("betas[0]", betas[0], low=0.0, high=1.0)
        self.beta2 = _check_finite_number("betas[1]", betas[1], low=0.0, high=1.0)
        self.eps = _check_finite_number("eps", eps, low=0.0, low_inclusive=False)

    def _tensor_slots(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _scalar_slots(self) -> tuple[str, ...]:
        return ("beta1_pow", "beta2_pow") if self.flavour == "paddle" else ()

    def _fresh_scalars(self) -> dict[str, np.ndarray]:
        if self.flavour != "paddle":
            return {}
        # Paddle's accumulators start at beta (= beta^1, the power used by step 1).
        return {"beta1_pow": np.array(self.beta1, dtype=_F32),
                "beta2_pow": np.array(self.beta2, dtype=_F32)}

    def _update(self, param, grad, state, step):
        if self.flavour == "torch":
            return self._update_torch(param, grad, state, step)
        return self._update_paddle(param, grad, state)

    def _step_native(self, key, param, grad, state, step):
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if not all(a.dtype == _F32 and a.flags.c_contiguous for a in (param, grad, exp_avg, exp_avg_sq)):
            return False
        decay = (2 if self.decoupled_weight_decay else 1) if self.weight_decay else 0
        if self.flavour == "torch":
            values, scalars = self._torch_scalars(step), {}
        else:
            values, scalars = self._paddle_scalars(state)
        _optim.adam(param, grad, exp_avg, exp_avg_sq, self.flavour, decay, tuple(float(v) for v in values))
        self._commit(key, state, step, scalars)
        return True

    def _torch_scalars(self, step: int) -> tuple[np.float32, ...]:
        """The float32 scalars of torch's step number ``step``, for both paths: weight decay, the decoupled
        decay's factor, 1 - beta1 (lerp's weight), 1 - beta2, beta2, -step size, sqrt(bias correction 2), eps."""
        lr, wd = self.lr, self.weight_decay
        step_size = lr / (1 - self.beta1 ** step)
        return (_F32(wd), _F32(1 - lr * wd), _F32(1 - self.beta1), _F32(1 - self.beta2), _F32(self.beta2),
                _F32(-step_size), _F32((1 - self.beta2 ** step) ** 0.5), _F32(self.eps))

    def _paddle_scalars(self, state) -> tuple[tuple[np.float32, ...], dict[str, np.ndarray]]:
        """Paddle's float32 scalars for the next step, for both paths (weight decay, -lr * coeff, beta1,
        1 - beta1, beta2, 1 - beta2, -lr_t, eps_t), and the new ``beta1_pow`` / ``beta2_pow`` slots."""
        beta1, beta2 = _F32(self.beta1), _F32(self.beta2)
        beta1_pow, beta2_pow = _F32(state["beta1_pow"]), _F32(state["beta2_pow"])
        lr = _F32(self.lr)
        coeff = lr * _ONE * _F32(self.weight_decay)  # old_lr * lr_ratio * coeff
        lr_t = lr * (np.sqrt(_ONE - beta2_pow) / (_ONE - beta1_pow))
        eps_t = _F32(self.eps) * np.sqrt(_ONE - beta2_pow)
        values = (_F32(self.weight_decay), -coeff, beta1, _ONE - beta1, beta2, _ONE - beta2, -lr_t, eps_t)
        return values, {"beta1_pow": np.array(beta1_pow * beta1, dtype=_F32),
                        "beta2_pow": np.array(beta2_pow * beta2, dtype=_F32)}

    def _update_torch(self, param, grad, state, step):
        wd, keep, weight, c2, b2, neg_step, bc2, eps = self._torch_scalars(step)
        if self.weight_decay and self.decoupled_weight_decay:
            param = param * keep
        elif self.weight_decay:
            grad = _fma(wd, param, grad)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # exp_avg.lerp_(grad, 1 - beta1), as torch's vectorised lerp computes it.
        if weight < 0.5:
            exp_avg = _fma(weight, grad - exp_avg, exp_avg)
        else:
            exp_avg = _fma(weight - _ONE, grad - exp_avg, grad)
        exp_avg_sq = _fma(c2 * grad, grad, exp_avg_sq * b2)
        denom = np.sqrt(exp_avg_sq) / bc2 + eps
        new_param = param + (neg_step * exp_avg) / denom
        return new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def _update_paddle(self, param, grad, state):
        (wd, neg_coeff, beta1, one_minus_b1, beta2, one_minus_b2, neg_lr_t, eps_t), pows = self._paddle_scalars(state)
        if self.weight_decay and self.decoupled_weight_decay:
            param = _fma(neg_coeff, param, param)
        elif self.weight_decay:
            grad = grad + param * wd
        exp_avg = _fma(beta1, state["exp_avg"], one_minus_b1 * grad)
        exp_avg_sq = _fma(beta2, state["exp_avg_sq"], one_minus_b2 * (grad * grad))
        new_param = _fma(neg_lr_t, exp_avg / (np.sqrt(exp_avg_sq) + eps_t), param)
        return new_param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, **pows}


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW`` / ``paddle.optimizer.AdamW``)."""

    name = "adamw"
    decoupled_weight_decay = True


def native_step_available() -> bool:
    """True when the C step (`_optim`) is built and ``HFLEET_NATIVE_OPTIM`` does not switch it off."""
    return _optim is not None and switched_on(NATIVE_SWITCH)


def make_optimizer(spec: Any, flavour: str = "torch") -> ServerOptimizer:
    """The server optimizer an `OptimizerSpec` describes, reproducing ``flavour``'s framework.

    ``spec`` needs ``name`` (sgd, adam, adamw), ``lr``, ``momentum``, ``nesterov``,
    ``weight_decay``, ``betas`` and ``eps``. Raises ValueError for an unknown name or
    flavour, listing the valid ones.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour: must be one of {', '.join(FLAVOURS)} (got {flavour!r})")
    name = getattr(spec, "name", None)
    if name == "sgd":
        return SGD(lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                   weight_decay=spec.weight_decay, flavour=flavour)
    if name in ("adam", "adamw"):
        cls = Adam if name == "adam" else AdamW
        return cls(lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps,
                   weight_decay=spec.weight_decay, flavour=flavour)
    raise ValueError(f"optimizer name: unknown {name!r}; valid names: {', '.join(OPTIMIZER_NAMES)}")
