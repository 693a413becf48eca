"""The script's optimizer on a shard: the framework's own optimizer stepping the shard's slices.

A push carries the worker's optimizer description (`hybridfleet.ps.worker.optim_spec`):
class, parameter groups with every hyperparameter and this step's learning rates. The
shard runs that very class (``torch.optim`` / ``paddle.optimizer``) on its blocks, so
every optimizer, schedule and group behaves as in the plain script, numerics included:
the updates are element-wise, so a block of a tensor is stepped exactly as the whole
tensor is. A key without a gradient this round is not stepped (no decay, no moment
update), as the frameworks skip a parameter whose ``grad`` is None.

torch tensors share the shard's numpy buffers (``torch.from_numpy``), so a step costs
no copy; paddle parameters cannot share numpy memory, so each step copies the stepped
blocks in and out. Why the framework's optimizer and not the numpy ones of
`hybridfleet.ps.server.optim` (kept for an explicit ``ps.optimizer``): see
docs/wan-training.md ("The script's optimizer on the shards").
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from hybridfleet.ps.wire.reject import Reject
from hybridfleet.ps.wire.optimizers import CLASSES

MAX_DESCRIPTION_BYTES = 4 << 20
_TOP_KEYS = {"framework", "class", "lr", "ctor", "groups", "param_attrs"}


def parse_description(text: str, flavour: str, known_params: set[str]) -> dict | None:
    """The push's optimizer description, checked; None for an empty one (the job's ``ps.optimizer``).

    Raises Reject (INVALID_ARGUMENT) naming what is wrong: malformed JSON, another
    framework than the job's, a class the shards do not run, an unknown parameter name."""
    if not text:
        return None
    if len(text) > MAX_DESCRIPTION_BYTES:
        raise Reject("INVALID_ARGUMENT", f"optimizer description of {len(text)} bytes exceeds {MAX_DESCRIPTION_BYTES}")
    try:
        desc = json.loads(text)
    except ValueError:
        raise Reject("INVALID_ARGUMENT", "optimizer description is not valid JSON") from None
    if not isinstance(desc, dict) or set(desc) != _TOP_KEYS:
        raise Reject("INVALID_ARGUMENT", f"optimizer description must have exactly the keys {sorted(_TOP_KEYS)}")
    if desc["framework"] != flavour:
        raise Reject("INVALID_ARGUMENT", f"optimizer description is for {desc['framework']!r}; this job trains "
                                         f"with {flavour} (a mixed job applies ps.optimizer)")
    if desc["class"] not in CLASSES[flavour]:
        raise Reject("INVALID_ARGUMENT", f"optimizer class {desc['class']!r} is not one the shards run "
                                         f"({', '.join(CLASSES[flavour])})")
    groups = desc["groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and set(g) == {"params", "hyper"}
                                               and isinstance(g["params"], list) and isinstance(g["hyper"], dict)
                                               for g in groups):
        raise Reject("INVALID_ARGUMENT", "optimizer groups must be a list of {params: [...], hyper: {...}}")
    seen: set[str] = set()
    for i, g in enumerate(groups):
        unknown = sorted(n for n in g["params"] if n not in known_params)
        if unknown:
            raise Reject("INVALID_ARGUMENT", f"optimizer group {i} names parameters the job does not have: "
                                             f"{', '.join(map(str, unknown[:5]))}")
        twice = seen.intersection(g["params"])
        if twice:
            raise Reject("INVALID_ARGUMENT", f"parameter(s) {', '.join(sorted(twice)[:5])} in more than one group")
        seen.update(g["params"])
    if not isinstance(desc["ctor"], dict) or not isinstance(desc["param_attrs"], dict):
        raise Reject("INVALID_ARGUMENT", "optimizer ctor and param_attrs must be objects")
    if flavour == "paddle" and not _is_number(desc["lr"]):
        raise Reject("INVALID_ARGUMENT", f"optimizer lr: must be a number >= 0 (got {desc['lr']!r})")
    for where, settings in [("ctor", desc["ctor"]), *((f"group {i}", g["hyper"]) for i, g in enumerate(groups)),
                            *((f"parameter {n}", a) for n, a in desc["param_attrs"].items())]:
        _check_settings(where, settings)
    if flavour == "torch":
        extra = sorted(set(desc["ctor"]) - _TORCH_CTOR_KEYS)
        if extra:
            raise Reject("INVALID_ARGUMENT", f"optimizer ctor: a torch optimizer sends only "
                                             f"{', '.join(sorted(_TORCH_CTOR_KEYS))} (got {', '.join(extra[:5])})")
        _trial_torch(desc["class"], groups)
    return desc


_RATES = {"lr", "learning_rate", "lr_mult", "lr_ratio", "weight_decay", "eps", "epsilon", "momentum",
          "dampening", "rho", "alpha", "lr_decay", "initial_lr", "beta1", "beta2", "initial_accumulator_value"}
# the torch constructor defaults a worker sends: those torch reads when it creates a parameter's state
_TORCH_CTOR_KEYS = {"initial_accumulator_value"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_settings(where: str, settings: Any) -> None:
    """Hyperparameters are plain values: numbers, flags, None, short lists of numbers; rates are >= 0."""
    if not isinstance(settings, dict):
        raise Reject("INVALID_ARGUMENT", f"optimizer {where}: settings must be an object")
    for key, value in settings.items():
        if key in _RATES and not (_is_number(value) or (key == "weight_decay" and _is_regularizer(value))):
            raise Reject("INVALID_ARGUMENT", f"optimizer {where} {key!r}: must be a number >= 0 (got {value!r})")
        plain = value is None or isinstance(value, (bool, str)) or _is_number(value) or _is_regularizer(value)
        numbers = isinstance(value, list) and len(value) <= 8 and all(_is_number(v) for v in value)
        if not (plain or numbers or (isinstance(value, float) and math.isfinite(value))):
            raise Reject("INVALID_ARGUMENT", f"optimizer {where} {key!r}: {value!r} is not a plain setting")


def _is_regularizer(value: Any) -> bool:
    return (value is None or (isinstance(value, list) and len(value) == 2 and value[0] in ("l1", "l2")
                              and _is_number(value[1])))


def _trial_torch(name: str, groups: list) -> None:
    """torch's own checks of each group's settings (ranges of lr, betas, eps ...), on a scratch tensor."""
    import inspect

    import torch

    cls = getattr(torch.optim, name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    for i, g in enumerate(groups):
        try:
            cls([torch.zeros(1)], **{k: v for k, v in _torch_hyper(g["hyper"]).items() if k in accepted})
        except (TypeError, ValueError, RuntimeError) as err:
            raise Reject("INVALID_ARGUMENT", f"optimizer group {i}: {err}") from None


def differences(a: dict, b: dict) -> list[str]:
    """Where two descriptions differ, as ``path: a != b`` lines (empty when they agree)."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else str(k))
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and not path.endswith("params"):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        elif x != y:
            out.append(f"{path}: {x!r} != {y!r}")

    walk(a, b, "")
    return out


class ScriptOptimizer:
    """The framework's optimizer over one shard's keys; state kept per key across steps."""

    def __init__(self, flavour: str, block_param: dict[str, str]):
        self.flavour = flavour
        self.block_param = block_param  # key -> parameter name, for this shard's keys
        self._runner = _TorchRunner() if flavour == "torch" else _PaddleRunner()

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], desc: dict) -> None:
        """Step the keys of ``grads`` (this round's gradients) with ``desc``'s optimizer, in place."""
        by_param: dict[str, list[str]] = {}
        for key in sorted(params):
            by_param.setdefault(self.block_param[key], []).append(key)
        groups = [[k for name in g["params"] for k in by_param.get(name, [])] for g in desc["groups"]]
        self._runner.step(params, grads, desc, groups, self.block_param)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The optimizer's state per key, ``"<key>/<slot>"`` -> array (for the shard's snapshots)."""
        return self._runner.state_dict()

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """State from a snapshot; it is put in place on the next step, when the optimizer is built."""
        pending: dict[str, dict[str, np.ndarray]] = {}
        for name, value in state.items():
            key, _, slot = name.rpartition("/")
            if key not in self.block_param or not slot:
                raise ValueError(f"script optimizer state entry {name!r}: not '<key>/<slot>' of this shard's keys")
            pending.setdefault(key, {})[slot] = np.array(value, copy=True)
        self._runner.pending = pending


def _torch_hyper(hyper: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}


class _TorchRunner:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.tensors: dict[str, Any] = {}
        self.opt = None
        self.cls = None
        self.pending: dict[str, dict[str, np.ndarray]] = {}  # state from a snapshot, per key

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {}
        for key, t in sorted(self.tensors.items()):
            for slot, value in (self.opt.state.get(t, {}) if self.opt is not None else {}).items():
                if isinstance(value, self.torch.Tensor):
                    out[f"{key}/{slot}"] = value.detach().numpy().copy()
        return out

    def step(self, params, grads, desc, groups, block_param) -> None:
        torch = self.torch
        cls = getattr(torch.optim, desc["class"])
        if self.cls is not cls:  # the first step; its groups are replaced below, step after step
            self.opt, self.cls = cls([torch.zeros(1)]), cls
        self.opt.defaults.update(desc["ctor"])  # what torch reads when it creates a parameter's state
        for key, arr in params.items():
            t = self.tensors.get(key)
            if t is None or t.data_ptr() != arr.ctypes.data:
                t = self.tensors[key] = torch.from_numpy(arr)  # shares the shard's buffer
            g = grads.get(key)
            t.grad = None if g is None else torch.from_numpy(g if g.flags.writeable else g.copy())
        self.opt.param_groups = [{**_torch_hyper(g["hyper"]), "params": [self.tensors[k] for k in keys]}
                                 for g, keys in zip(desc["groups"], groups)]
        for key, slots in self.pending.items():
            self.opt.state[self.tensors[key]] = {slot: torch.from_numpy(v) for slot, v in slots.items()}
        self.pending = {}
        with torch.no_grad():
            self.opt.step()
        for t in self.tensors.values():
            t.grad = None


class _PaddleRunner:
    def __init__(self) -> None:
        import paddle

        self.paddle = paddle
        self.tensors: dict[str, Any] = {}
        self.opt = None
        self.structure: str | None = None
        self.pending: dict[str, dict[str, np.ndarray]] = {}  # state from a snapshot, per key

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.opt is None:
            return {}
        by_name = {p.name: key for key, p in self.tensors.items()}
        return {f"{by_name[name]}/{slot}": t.numpy().copy()
                for slot, per_param in sorted(self.opt._accumulators.items())
                for name, t in sorted(per_param.items()) if name in by_name}

    def _restore_pending(self) -> None:
        from paddle.base import framework

        params = [self.tensors[k] for k in sorted(self.pending)]
        self.opt._create_accumulators(framework.default_main_program().global_block(), params)
        for key, slots in self.pending.items():
            name = self.tensors[key].name
            for slot, value in slots.items():
                self.opt._accumulators[slot][name].set_value(value)
        self.pending = {}

    def _param(self, key: str, arr: np.ndarray):
        p = self.tensors.get(key)
        if p is None:
            p = self.tensors[key] = self.paddle.create_parameter([arr.size], "float32")
        return p

    def _regularizer(self, spec):
        from paddle.regularizer import L1Decay, L2Decay

        if spec is None:
            return None
        return (L2Decay if spec[0] == "l2" else L1Decay)(spec[1])

    def _build(self, desc, groups, block_param) -> None:
        paddle = self.paddle
        cls = getattr(paddle.optimizer, desc["class"])
        ctor = dict(desc["ctor"])
        if desc["class"] != "AdamW":
            ctor["weight_decay"] = self._regularizer(ctor.get("weight_decay"))
        attrs = desc["param_attrs"]
        by_name = {p.name: key for key, p in self.tensors.items()}
        if desc["class"] == "AdamW":
            ctor["apply_decay_param_fun"] = lambda n: attrs.get(block_param[by_name[n]], {}).get("decay", True)
            if any(a.get("lr_ratio", 1.0) != 1.0 for a in attrs.values()):
                ctor["lr_ratio"] = lambda p: attrs[block_param[by_name[p.name]]]["lr_ratio"]
        ctor = {k: v for k, v in ctor.items() if k in _paddle_args(cls)}
        plain = len(desc["groups"]) == 1 and not desc["groups"][0]["hyper"]
        tensors = [[self.tensors[k] for k in keys] for keys in groups]
        if plain:
            parameters = tensors[0]
        else:
            parameters = []
            for g, ts in zip(desc["groups"], tensors):
                hyper = dict(g["hyper"])
                if "weight_decay" in hyper and desc["class"] != "AdamW":
                    hyper["weight_decay"] = self._regularizer(hyper["weight_decay"])
                if hyper.pop("regularization_method", None) == "l2_decay":
                    # Momentum folds L2 into its kernel and rebuilds these two from the group's weight_decay
                    hyper["weight_decay"] = float(hyper["regularization_coeff"])
                hyper.pop("regularization_coeff", None)
                parameters.append({**hyper, "params": ts})
        old = self.opt
        self.opt = cls(learning_rate=float(desc["lr"]), parameters=parameters, grad_clip=None, **ctor)
        if old is not None:  # a new parameter set: keep every accumulator the old one had
            for attr in ("_accumulators", "_master_weights", "_already_create_accumulator"):
                if hasattr(old, attr):
                    setattr(self.opt, attr, getattr(old, attr))
        for key, p in self.tensors.items():
            a = attrs.get(block_param[key])
            if a is not None:
                p.optimize_attr["learning_rate"] = a["lr_mult"]
                p.regularizer = self._regularizer(a["regularizer"])

    def step(self, params, grads, desc, groups, block_param) -> None:
        paddle = self.paddle
        # paddle's dynamic-graph mode is per thread, and only the thread that first imported paddle has
        # it on its own: a round may close in any thread (a pool thread, secure aggregation's unmask thread)
        if not paddle.in_dynamic_mode():
            paddle.disable_static()
        for key, arr in params.items():
            self._param(key, arr)
        # everything but the learning rate (set every step) fixes the optimizer; a change rebuilds it
        structure = json.dumps([desc["class"], desc["ctor"], desc["param_attrs"],
                                [[g["hyper"], keys] for g, keys in zip(desc["groups"], groups)]], sort_keys=True)
        if structure != self.structure:
            self._build(desc, groups, block_param)
            self.structure = structure
        if self.pending:
            self._restore_pending()
        self.opt.set_lr(float(desc["lr"]))
        stepped = [k for k in params if k in grads]
        for key, p in self.tensors.items():
            p.clear_gradient(False)
            p.stop_gradient = key not in grads
        if not stepped:
            return
        for key in stepped:
            self.tensors[key].set_value(params[key])
        # the gradient of sum(p * g) with respect to p is exactly g
        total = None
        for key in stepped:
            term = (self.tensors[key] * paddle.to_tensor(np.ascontiguousarray(grads[key]))).sum()
            total = term if total is None else total + term
        total.backward()
        self.opt.step()
        for key in stepped:
            np.copyto(params[key], self.tensors[key].numpy())
            self.tensors[key].clear_gradient(False)


def _paddle_args(cls) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters)
