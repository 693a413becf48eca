"""The job's own model code: a factory named ``FILE.py:FUNC`` or ``package.module:FUNC``.

A factory returns the framework model (a ``torch.nn.Module`` or ``paddle.nn.Layer``) with
fresh weights; the registered version's weights are then loaded into it strictly. The
factory's module may offer ``sample_inputs()`` returning real inputs on which an export is
verified: floating-point rows (taken as float32) or integer ones such as token ids (taken
as int64). It receives those of the factory's arguments it names (a shrunk model's
``context``, say), so the sample always fits the model built.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np

from hybridfleet.errors import UsageError

SAMPLE_FUNC = "sample_inputs"


@dataclass
class Factory:
    """A resolved model factory: its text, module and callable."""

    text: str
    module: ModuleType
    build: Callable[..., Any]

    def sample_inputs(self, kwargs: dict[str, str] | None = None) -> np.ndarray | None:
        """The module's ``sample_inputs(...)`` (given the entries of ``kwargs`` it names) as a model
        input array (`as_model_input`), or None when it offers none."""
        func = getattr(self.module, SAMPLE_FUNC, None)
        if func is None:
            return None
        accepted = inspect.signature(func).parameters
        return as_model_input(func(**{k: v for k, v in (kwargs or {}).items() if k in accepted}), f"{SAMPLE_FUNC}()")


def as_model_input(array: object, what: str) -> np.ndarray:
    """``array`` as the dtype an exported model takes: float32 for real values, int64 for integers (token ids)."""
    a = np.asarray(array)
    if a.dtype.kind == "f":
        return np.ascontiguousarray(a, dtype=np.float32)
    if a.dtype.kind in "iu":
        return np.ascontiguousarray(a, dtype=np.int64)
    raise UsageError(f"{what}: sample inputs must be floating-point or integer numbers (got dtype {a.dtype})")


def load_factory(text: str) -> Factory:
    """Import ``FILE.py:FUNC`` (its folder goes first on sys.path, as when the script runs) or ``module:FUNC``.

    UsageError names what is missing: the separator, the file, the module or the function.
    """
    where, sep, func_name = text.rpartition(":")
    if not sep or not where or not func_name.isidentifier():
        raise UsageError(f"--model {text!r}: expected FILE.py:FUNC or package.module:FUNC (e.g. examples/digits/digits_model.py:build_torch)")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"--model {text!r}: no file {path}")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        name = f"hfleet_model_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise UsageError(f"--model {text!r}: cannot import {where}: {err}") from err
    build = getattr(module, func_name, None)
    if not callable(build):
        raise UsageError(f"--model {text!r}: {where} has no function {func_name}")
    return Factory(text, module, build)


def build_model(factory: Factory, kwargs: dict[str, str]) -> tuple[Any, str]:
    """(model in eval mode, its framework) from the factory called with ``kwargs``."""
    model = factory.build(**kwargs)
    framework = framework_of(model)
    if framework is None:
        raise UsageError(f"--model {factory.text}: returned {type(model).__name__}, not a torch.nn.Module or paddle.nn.Layer")
    model.eval()
    return model, framework


def framework_of(model: Any) -> str | None:
    """"torch" or "paddle" for a model of an imported framework; None otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    paddle = sys.modules.get("paddle")
    if paddle is not None and isinstance(model, paddle.nn.Layer):
        return "paddle"
    return None


def load_sample(path: str | None, factory: Factory, limit: int, kwargs: dict[str, str] | None = None) -> np.ndarray:
    """Real inputs for verification: ``path`` (.npy), else the factory module's ``sample_inputs()`` (given the
    factory arguments ``kwargs`` it names); float32 or int64 (`as_model_input`); at most ``limit`` rows."""
    if path:
        try:
            loaded = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise UsageError(f"--sample {path}: not a readable .npy array ({err})") from err
        sample = as_model_input(loaded, f"--sample {path}")
    else:
        sample = factory.sample_inputs(kwargs)
        if sample is None:
            raise UsageError(f"--model {factory.text}: its module has no {SAMPLE_FUNC}(); give real inputs with --sample FILE.npy")
    if sample.ndim < 2 or len(sample) == 0:
        raise UsageError(f"sample inputs must be a batch (N, ...) with N >= 1 (got shape {list(sample.shape)})")
    return sample[:limit]
