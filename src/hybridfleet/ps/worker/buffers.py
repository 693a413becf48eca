"""A worker's side of ``ps.buffers``: the model's buffers next to its parameters.

Buffers are the model state that is not trained by gradients: BatchNorm's running mean
and variance (torch ``running_mean``/``running_var``, paddle ``_mean``/``_variance``),
``num_batches_tracked`` and any other buffer in the state dict. The policy:

- ``average`` (default): after every step the shard holds the sample-weighted mean of what
  each worker's forward passes made of the job's values (FedAvg over the state dict; see
  `hybridfleet.ps.wire.buffers`). A worker's weight is the samples its step saw: the
  batch size counted in the training-mode forward passes since the last step, or
  ``ps.step(samples=n)``. Integer buffers (``num_batches_tracked``) are averaged the same
  way and rounded to the nearest integer; in BSP every worker counts the same batches,
  so the job's counter is the steps taken.
- ``broadcast``: rank 0's buffers, as DDP's ``broadcast_buffers`` (every other worker
  pushes weight 0 and trains on rank 0's statistics).
- ``local`` (FedBN): buffers never leave the worker; each site keeps its own statistics.

Without shards (training alone) buffers stay the model's, as in the plain script.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.errors import SpecError
from hybridfleet.ps.wire.buffers import DTYPE, buffer_name, is_buffer, wire_name

POLICIES = ("average", "local", "broadcast")


class BufferSync:
    """Turns the model's buffers into plan tensors to push and back into buffer values."""

    def __init__(self, policy: str, values: dict[str, np.ndarray], rank: int):
        """``values``: each buffer's current value (its numpy dtype is the one loaded back)."""
        if policy not in POLICIES or policy == "local":
            raise ValueError(f"ps.buffers: BufferSync carries average or broadcast (got {policy!r})")
        self.policy = policy
        self.rank = rank
        self.shapes = {k: tuple(v.shape) for k, v in values.items()}
        self.dtypes = {k: np.asarray(v).dtype for k, v in values.items()}
        self.base: dict[str, np.ndarray] = {}  # the job's values this worker last loaded (float32, flat)

    @staticmethod
    def check_job(job, site: str, has_buffers: bool, mixed_frameworks: bool) -> None:
        """SpecError when the job cannot average or broadcast this model's buffers, with the fix."""
        ps = job.ps
        if not has_buffers or ps.buffers == "local":
            return
        why = None
        if ps.secure_aggregation is not None:
            why = "secure aggregation masks gradients only: the shard would see each site's statistics"
        elif ps.privacy is not None:
            why = "differential privacy noises gradients only: each site's statistics would leave it unprotected"
        elif ps.aggregate.rule != "mean":
            why = f"the robust rule {ps.aggregate.rule!r} does not give the sample-weighted mean of statistics"
        elif mixed_frameworks:
            why = f"site {site!r} trains with another framework than the job's and buffers map by name only"
        if why:
            raise SpecError(f"ps.buffers: {ps.buffers} with this model's buffers (e.g. BatchNorm statistics): {why}; "
                            f"set ps.buffers: local (each site keeps its own statistics)")

    def wire_shapes(self) -> dict[str, tuple[int, ...]]:
        """Plan tensors: ``buffer:<name>`` with the buffer's elements and one sample weight."""
        return {wire_name(k): (int(np.prod(s)) + 1,) for k, s in self.shapes.items()}

    def initial(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The plan tensors holding ``values`` (weight 0): what the initialising worker pushes."""
        self._check(values)
        return {wire_name(k): np.append(np.asarray(v, dtype=DTYPE).reshape(-1), DTYPE.type(0)) for k, v in values.items()}

    def update(self, values: dict[str, np.ndarray], samples: int) -> dict[str, np.ndarray]:
        """This step's push: ``[w * (job - local)..., w]`` per buffer, ``w`` = ``samples`` under
        ``average``; under ``broadcast`` rank 0 pushes weight ``max(samples, 1)``, every other worker 0.
        ValueError (nothing pushed, nothing changed) when a buffer's name or shape differs from the job's."""
        self._check(values)
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
            raise ValueError(f"ps.step(samples=...): a number of samples >= 0 (got {samples!r})")
        weight = int(samples)
        if self.policy == "broadcast":
            weight = max(weight, 1) if self.rank == 0 else 0
        out = {}
        for k, v in values.items():
            local = np.asarray(v, dtype=np.float64).reshape(-1)
            moved = self.base[k].astype(np.float64) - local
            if weight == 0 and self.policy == "average" and np.any(moved):
                weight = 1  # the script changed a buffer outside a counted forward pass: it still counts
            out[k] = moved
        return {wire_name(k): np.append(weight * d, weight).astype(DTYPE) for k, d in out.items()}

    def load(self, wire: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The job's buffer values from plan tensors (remembered as the base of the next push),
        in each buffer's own shape and dtype (integers rounded to the nearest)."""
        out = {}
        for w, arr in wire.items():
            name = buffer_name(w)
            flat = np.asarray(arr, dtype=DTYPE).reshape(-1)[:-1]
            self.base[name] = flat.copy()
            dtype = self.dtypes[name]
            value = np.rint(flat).astype(dtype) if dtype.kind in "iub" else flat.astype(dtype)
            out[name] = value.reshape(self.shapes[name])
        return out

    def _check(self, values: dict[str, np.ndarray]) -> None:
        if set(values) != set(self.shapes):
            missing, extra = sorted(set(self.shapes) - set(values)), sorted(set(values) - set(self.shapes))
            raise ValueError(f"model buffers differ from the job's: missing {missing[:3]}, unexpected {extra[:3]}; "
                             "nothing was sent")
        for k, v in values.items():
            if tuple(np.shape(v)) != self.shapes[k]:
                raise ValueError(f"buffer {k!r} has shape {tuple(np.shape(v))}, the job's is {self.shapes[k]}; "
                                 "nothing was sent")
            if not np.isfinite(np.asarray(v, dtype=np.float64)).all():
                raise ValueError(f"buffer {k!r} has non-finite values (NaN or Inf); nothing was sent")


def split(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(parameters, buffer plan tensors) of a session's arrays."""
    params = {k: v for k, v in arrays.items() if not is_buffer(k)}
    return params, {k: v for k, v in arrays.items() if is_buffer(k)}
