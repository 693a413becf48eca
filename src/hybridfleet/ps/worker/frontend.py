"""The user-facing handle shared by the torch and paddle adapters.

A training script adds three lines::

    import hybridfleet.torch as hf        # or hybridfleet.paddle
    ps = hf.connect(model)                # joins the job, loads the job's current parameters
    ...; loss.backward(); ps.step()       # replaces optimizer.step(): push gradients, pull parameters

Subclasses only say how to list parameters, read gradients and assign values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from hybridfleet.ps.worker.session import PSSession, WorkerConfig


class ParameterServerHandle(ABC):
    """Binds a model to a `PSSession`; the same API in every framework."""

    framework: str = ""

    def __init__(self, model: Any, config: WorkerConfig | None = None):
        self.model = model
        self.config = config or WorkerConfig.from_env()
        params = self._named_parameters()
        self.session = PSSession({k: tuple(p.shape) for k, p in params.items()}, self.config, self.framework)
        self._assign(self.session.start({k: self._to_numpy(p) for k, p in params.items()}))

    # framework specifics --------------------------------------------------
    @abstractmethod
    def _named_parameters(self) -> dict[str, Any]: ...

    @abstractmethod
    def _to_numpy(self, tensor: Any) -> np.ndarray: ...

    def _grad(self, param: Any) -> np.ndarray | None:
        """The parameter's gradient as float32 numpy, or None before the first backward."""
        return None if param.grad is None else self._to_numpy(param.grad)

    @abstractmethod
    def _assign(self, values: dict[str, np.ndarray]) -> None: ...

    @abstractmethod
    def zero_grad(self) -> None: ...

    # the API ----------------------------------------------------------------
    def step(self) -> None:
        """Push this step's gradients (zeros for parameters without one) and load the new parameters."""
        grads = {}
        for name, p in self._named_parameters().items():
            g = self._grad(p)
            grads[name] = np.zeros(tuple(p.shape), dtype=np.float32) if g is None else g
        self._assign(self.session.step(grads))

    @property
    def job(self):
        return self.config.job

    @property
    def site(self) -> str:
        return self.config.site

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def site_rank(self) -> int:
        return self.config.site_rank

    @property
    def workers_at_site(self) -> int:
        """Workers sharing this site's data (1 when training alone, without servers)."""
        return 1 if self.session.local else self.config.job.sites[self.config.site].workers

    @property
    def step_count(self) -> int:
        return self.session.step_count

    def report(self, **metrics: Any) -> None:
        """Record metrics (loss, accuracy, ...) with the worker's byte counters."""
        self.session.report(**metrics)

    def close(self) -> None:
        """Leave the job (so synchronous rounds stop waiting for this worker)."""
        self.session.close()

    def __enter__(self) -> "ParameterServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
