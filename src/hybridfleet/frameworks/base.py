"""The `Adapter` interface every framework implements, plus framework-free RNG helpers.

Tensors cross the boundary as numpy arrays (CPU, C-contiguous) and everything
else as JSON-able values, so checkpoints never need pickle.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from hybridfleet.errors import CheckpointError


class Adapter(ABC):
    """Tensors, state dicts and RNG state of one framework, as numpy + JSON."""

    name: str = ""

    @property
    @abstractmethod
    def version(self) -> str:
        """The framework's version string."""

    @abstractmethod
    def owns(self, obj: Any) -> bool:
        """True when ``obj`` is a model, optimizer or tensor of this framework."""

    def to_numpy(self, tensor: Any) -> np.ndarray:
        """A C-contiguous CPU numpy view or copy of ``tensor`` (detached from autograd).

        torch and paddle tensors both offer ``detach().cpu().numpy()``."""
        arr = tensor.detach().cpu().numpy()
        return arr if arr.flags.c_contiguous else np.array(arr, order="C")  # keeps 0-d shapes

    @abstractmethod
    def from_numpy(self, arr: np.ndarray) -> Any:
        """A CPU tensor holding ``arr``'s values (sharing memory where the framework allows)."""

    @abstractmethod
    def model_state(self, model: Any) -> dict[str, np.ndarray]:
        """A snapshot (independent copies) of every parameter and buffer, by state-dict name."""

    def model_views(self, model: Any) -> dict[str, np.ndarray]:
        """Parameters and buffers as numpy arrays that may share the model's memory (no snapshot)."""
        return self.model_state(model)

    @abstractmethod
    def _expected_state(self, model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, numpy dtype name) of the model's state dict."""

    @abstractmethod
    def _assign_state(self, model: Any, state: dict[str, np.ndarray]) -> None:
        """Copy already-validated arrays into the model."""

    @abstractmethod
    def optimizer_state(self, optimizer: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The optimizer's tensors (copies) and its JSON-able remainder (hyper-parameters, steps)."""

    @abstractmethod
    def load_optimizer_state(self, optimizer: Any, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Restore what `optimizer_state` returned."""

    @abstractmethod
    def _framework_rng_state(self) -> Any:
        """The framework's CPU RNG state as a JSON-able value."""

    @abstractmethod
    def _set_framework_rng_state(self, state: Any) -> None:
        """Restore what `_framework_rng_state` returned."""

    @abstractmethod
    def module_kinds(self, model: Any) -> dict[str, str]:
        """state-dict name -> layer kind ("linear", "conv", "embedding", "batchnorm",
        "layernorm", "groupnorm") for tensors of known layers; others are absent."""

    def load_model_state(self, model: Any, state: dict[str, np.ndarray]) -> None:
        """Load ``state`` into ``model`` strictly.

        Every model tensor must be present with the same shape, and no extra tensor may
        be given; otherwise CheckpointError names the offending tensors and the model is
        left unchanged. Dtypes are cast to the model's.
        """
        expected = self._expected_state(model)
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        mismatched = [
            f"{k} (checkpoint {list(np.shape(state[k]))}, model {list(expected[k][0])})"
            for k in sorted(set(expected) & set(state))
            if tuple(np.shape(state[k])) != tuple(expected[k][0])
        ]
        problems = []
        if missing:
            problems.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {', '.join(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatch: {', '.join(mismatched)}")
        if problems:
            raise CheckpointError(f"{self.name} model state does not match the checkpoint; " + "; ".join(problems))
        self._assign_state(model, state)

    def rng_state(self) -> dict[str, Any]:
        """The python, numpy and framework (CPU) RNG states, JSON-able."""
        return {**python_numpy_rng_state(), self.name: self._framework_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what `rng_state` returned (each part that is present)."""
        set_python_numpy_rng_state(state)
        if self.name in state:
            self._set_framework_rng_state(state[self.name])


def python_numpy_rng_state() -> dict[str, Any]:
    """The python `random` and numpy global RNG states, JSON-able."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def set_python_numpy_rng_state(state: dict[str, Any]) -> None:
    """Restore the "python" and "numpy" parts of `python_numpy_rng_state` that are present."""
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
