"""The script's optimizer, read so the shards can apply exactly its update.

At connect the worker checks that the optimizer's class is one the shards run
(`TORCH_CLASSES`, `PADDLE_CLASSES`); at every step it reads the optimizer again,
so a learning-rate scheduler, a changed hyperparameter or a group added with
``add_param_group`` (progressive unfreezing) reaches the shards on that very step.

The description is plain JSON (see `describe`)::

    {"framework": "torch", "class": "AdamW", "lr": null, "ctor": {},
     "groups": [{"params": ["fc.weight", ...], "hyper": {"lr": 0.001, "betas": [0.9, 0.999], ...}}],
     "param_attrs": {}}

For paddle, ``lr`` is the optimizer's current learning rate (``get_lr()``, any
``paddle.optimizer.lr`` schedule), ``ctor`` the constructor's hyperparameters and
``param_attrs`` each parameter's own settings: its learning-rate multiplier
(``optimize_attr``), its regularizer, whether AdamW's ``apply_decay_param_fun``
decays it and AdamW's ``lr_ratio`` for it (both functions are evaluated here, on
the worker, with the parameter the script's optimizer would see). Paddle's
``grad_clip`` runs on the worker (`PaddleOptimizerReader.clip`) before the
gradients are pushed, exactly as ``optimizer.step()`` clips before it regularises.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hybridfleet.ps.wire.optimizers import ADAPTIVE_CLASSES, CLASSES, PADDLE_CLASSES, TORCH_CLASSES

__all__ = ["ADAPTIVE_CLASSES", "CLASSES", "PADDLE_CLASSES", "TORCH_CLASSES", "UnsupportedOptimizer", "encode",
           "reader_for"]


class UnsupportedOptimizer(ValueError):
    """The script's optimizer (or one of its settings) cannot be run by the shards."""


def _plain(value: Any, where: str) -> Any:
    """A JSON value for a hyperparameter (0-d tensors become floats); refuses what cannot travel."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise UnsupportedOptimizer(f"{where}: {value!r} is not a finite number")
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", getattr(value, "dim", lambda: 1)) in (0, ()):
        return _plain(float(value.item()), where)
    if hasattr(value, "numel") and callable(value.numel) and int(value.numel()) == 1:
        return _plain(float(value.item()), where)
    raise UnsupportedOptimizer(f"{where}: a {type(value).__name__} cannot be sent to the shards; "
                               "use plain numbers, or set ps.optimizer in the job to let the shards choose")


def _checked_class(optimizer: Any, framework: str) -> str:
    cls = type(optimizer)
    module = "torch.optim" if framework == "torch" else "paddle.optimizer"
    name = cls.__name__
    if name not in CLASSES[framework] or not cls.__module__.startswith(module):
        raise UnsupportedOptimizer(
            f"optimizer {cls.__module__}.{name}: the shards run {', '.join(f'{module}.{c}' for c in CLASSES[framework])}; "
            "use one of them, or set ps.optimizer in the job file to have the shards apply that one instead")
    return name


_TORCH_STATE_DEFAULTS = ("initial_accumulator_value",)


class TorchOptimizerReader:
    """Reads a ``torch.optim`` optimizer's class and parameter groups (every hyperparameter)."""

    def __init__(self, optimizer: Any, names_of: dict[int, str]):
        self.optimizer = optimizer
        self.names_of = names_of
        self.name = _checked_class(optimizer, "torch")
        self.describe()  # refuse a setting that cannot travel now, at connect

    def describe(self) -> dict:
        """The optimizer as it stands now (current learning rate of each group included)."""
        groups = []
        for i, group in enumerate(self.optimizer.param_groups):
            names = [self._name(p, i) for p in group["params"]]
            hyper = {k: _plain(v, f"optimizer group {i} {k!r}") for k, v in sorted(group.items()) if k != "params"}
            groups.append({"params": names, "hyper": hyper})
        # the constructor's defaults that torch reads when it creates a parameter's state (Adagrad's
        # initial_accumulator_value: the group's own value is not used for it)
        ctor = {k: _plain(self.optimizer.defaults[k], f"optimizer {k!r}") for k in _TORCH_STATE_DEFAULTS
                if k in self.optimizer.defaults}
        return {"framework": "torch", "class": self.name, "lr": None, "ctor": ctor, "groups": groups,
                "param_attrs": {}}

    def _name(self, param: Any, group: int) -> str:
        name = self.names_of.get(id(param))
        if name is None:
            raise UnsupportedOptimizer(f"optimizer group {group} holds a tensor of shape {tuple(param.shape)} that is "
                                       "not a parameter of the connected model")
        return name

    def clip(self, grads: dict[str, Any]) -> dict[str, Any]:
        """torch optimizers do not clip: a script clips ``.grad`` itself before ``ps.step()``."""
        return grads


# the constructor argument of each entry of a paddle optimizer's _default_dict
_PADDLE_CTOR_KEYS = {"beta1", "beta2", "epsilon", "lazy_mode", "momentum", "use_nesterov", "rescale_grad",
                     "rho", "centered", "initial_accumulator_value"}


def _regularizer(reg: Any, where: str) -> list | None:
    """A paddle regularizer as ``["l2" | "l1", coeff]`` (a float weight_decay is L2)."""
    if reg is None:
        return None
    if isinstance(reg, (int, float)):
        return ["l2", float(reg)]
    kind = type(reg).__name__
    coeff = getattr(reg, "_coeff", getattr(reg, "_regularization_coeff", None))
    if kind in ("L2Decay", "L2DecayRegularizer") and coeff is not None:
        return ["l2", float(coeff)]
    if kind in ("L1Decay", "L1DecayRegularizer") and coeff is not None:
        return ["l1", float(coeff)]
    raise UnsupportedOptimizer(f"{where}: regularizer {kind} cannot be run by the shards (L1Decay, L2Decay or a float)")


class PaddleOptimizerReader:
    """Reads a ``paddle.optimizer`` optimizer: class, constructor settings, groups, per-parameter settings."""

    def __init__(self, optimizer: Any, names_of: dict[int, str], params: dict[str, Any]):
        self.optimizer = optimizer
        self.names_of = names_of
        self.params = params  # canonical name -> the script's paddle Parameter
        self.name = _checked_class(optimizer, "paddle")
        if getattr(optimizer, "_use_multi_tensor", False):
            raise UnsupportedOptimizer(f"paddle.optimizer.{self.name}(use_multi_tensor=True): the shards step their "
                                       "slices one by one; drop use_multi_tensor")
        self.describe()

    def _groups(self) -> list[tuple[list, dict]]:
        entries = self.optimizer._param_groups
        if entries and isinstance(entries[0], dict):
            return [(g["params"], {k: v for k, v in g.items() if k != "params"}) for g in entries]
        return [(list(entries), {})]

    def _clips(self) -> list:
        """Each group's grad_clip: paddle clips group by group (a global norm is a group's norm)
        when the optimizer has parameter groups, all parameters at once otherwise."""
        opt = self.optimizer
        clips = [settings.get("grad_clip", opt._grad_clip) if settings else opt._grad_clip
                 for _, settings in self._groups()]
        for clip in clips:
            if clip is not None and type(clip).__name__ not in ("ClipGradByGlobalNorm", "ClipGradByNorm",
                                                                "ClipGradByValue"):
                raise UnsupportedOptimizer(f"grad_clip {type(clip).__name__}: the worker applies "
                                           "ClipGradByGlobalNorm, ClipGradByNorm or ClipGradByValue")
        return clips

    def describe(self) -> dict:
        """The optimizer as it stands now: ``lr`` is ``get_lr()``, the schedule's current value."""
        opt = self.optimizer
        ctor = {k: _plain(v, f"optimizer {k!r}") for k, v in sorted(opt._default_dict.items())
                if k in _PADDLE_CTOR_KEYS}
        if self.name == "AdamW":
            ctor["weight_decay"] = _plain(opt._weight_decay, "optimizer weight_decay")
        elif self.name == "Momentum":  # Momentum folds an L2 weight_decay into its own kernel
            l2 = opt._regularization_method == "l2_decay"
            ctor["weight_decay"] = ["l2", float(opt._regularization_coeff)] if l2 else None
        else:
            ctor["weight_decay"] = _regularizer(getattr(opt, "regularization", None), "optimizer weight_decay")
        for flag in ("_amsgrad", "_multi_precision"):
            if hasattr(opt, flag):
                ctor[flag.lstrip("_")] = bool(getattr(opt, flag))
        self._clips()
        groups, attrs = [], {}
        for i, (params, settings) in enumerate(self._groups()):
            hyper = {}
            for k, v in sorted(settings.items()):
                if k == "grad_clip":
                    continue  # applied on the worker (see clip)
                hyper[k] = (_regularizer(v, f"optimizer group {i} weight_decay")
                            if k == "weight_decay" and self.name != "AdamW" else _plain(v, f"optimizer group {i} {k!r}"))
            names = []
            for p in params:
                name = self.names_of.get(id(p))
                if name is None and p.stop_gradient:
                    # never stepped by paddle either: BatchNorm's running statistics (which follow ps.buffers)
                    # come with model.parameters(), as do tensors the script froze outside the model
                    continue
                if name is None:
                    raise UnsupportedOptimizer(f"optimizer group {i} holds {p.name} that is not a parameter of the "
                                               "connected model")
                names.append(name)
                attrs[name] = self._param_attrs(p, name)
            groups.append({"params": names, "hyper": hyper})
        return {"framework": "paddle", "class": self.name, "lr": float(opt.get_lr()), "ctor": ctor,
                "groups": groups, "param_attrs": attrs}

    def _param_attrs(self, param: Any, name: str) -> dict:
        opt = self.optimizer
        out = {"lr_mult": _plain(param.optimize_attr.get("learning_rate", 1.0), f"parameter {name} learning_rate"),
               "regularizer": _regularizer(getattr(param, "regularizer", None), f"parameter {name}")}
        if self.name == "AdamW":
            decay_fun, ratio = opt._apply_decay_param_fun, opt._lr_ratio
            out["decay"] = True if decay_fun is None else bool(decay_fun(param.name))
            out["lr_ratio"] = 1.0 if ratio is None else _plain(float(ratio(param)), f"lr_ratio({name})")
        return out

    def clip(self, grads: dict[str, Any]) -> dict[str, Any]:
        """Apply the optimizer's ``grad_clip`` to the gradients about to be pushed (name -> paddle tensor),
        group by group and in the optimizer's order, as ``optimizer.step()`` does."""
        out = dict(grads)
        for (params, _), clip in zip(self._groups(), self._clips()):
            names = [self.names_of[id(p)] for p in params if self.names_of.get(id(p)) in grads]
            if clip is None or not names:
                continue
            clipped = clip([(self.params[n], grads[n]) for n in names])
            out.update({n: g for n, (_, g) in zip(names, clipped)})
        return out


def reader_for(optimizer: Any, framework: str, params: dict[str, Any]):
    """The reader of ``optimizer`` over the model's parameters (canonical name -> tensor);
    raises `UnsupportedOptimizer` naming what the shards cannot run and the fix."""
    names_of = {id(p): n for n, p in params.items()}
    if framework == "torch":
        return TorchOptimizerReader(optimizer, names_of)
    return PaddleOptimizerReader(optimizer, names_of, params)


def encode(description: dict) -> str:
    """The description as compact JSON with sorted keys (equal settings give equal strings)."""
    return json.dumps(description, sort_keys=True, separators=(",", ":"))
