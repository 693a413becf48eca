"""Taking a checkpoint's contents into host memory: numpy tensors plus a JSON state.

This is the synchronous half of a save (the training stall of an async save); the
I/O half is `writer.write_snapshot`.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridfleet.frameworks import detect_framework, get_adapter
from hybridfleet.frameworks.base import python_numpy_rng_state

try:  # the C extension built from _stream_copy.c, when a compiler was there at install time
    from hybridfleet.ckpt._stream_copy import copy as _stream_copy
except ImportError:  # pragma: no cover - numpy's copy: the same bytes, ordinary stores
    _stream_copy = None

# Copies at least this large bypass the cache (non-temporal stores): the destination
# would not stay cached anyway, and skipping its read-for-ownership saves a third of
# the memory traffic. Smaller copies likely hit the cache, where ordinary stores win.
STREAM_MIN_BYTES = 4 << 20


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype); releases the GIL."""
    if _stream_copy is not None and dst.nbytes >= STREAM_MIN_BYTES and dst.flags.c_contiguous and src.flags.c_contiguous:
        _stream_copy(dst, src)
    else:
        np.copyto(dst, src)


@dataclass
class Snapshot:
    """Everything one checkpoint will hold, already copied off the training objects."""

    step: int
    framework: str | None
    groups: dict[str, dict[str, np.ndarray]]  # role ("model", "optimizer", "tensors") -> tensors
    state: dict[str, Any]  # the content of state.json
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(a.nbytes for g in self.groups.values() for a in g.values())


class HostBuffers:
    """Reusable host arrays for snapshots: the second and later saves copy into memory
    that is already mapped, which is several times faster than fresh allocations."""

    COPY_SLICE_BYTES = 32 << 20

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, str], np.ndarray] = {}

    def copy(self, role: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copies of ``tensors`` in this pool's buffers (valid until the next `copy` of the same keys)."""
        out: dict[str, np.ndarray] = {}
        jobs = []
        for name, arr in tensors.items():
            buf = self._arrays.get((role, name))
            if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
                buf = self._arrays[(role, name)] = np.empty(arr.shape, dtype=arr.dtype)
            out[name] = buf
            flat_src, flat_dst = arr.reshape(-1), buf.reshape(-1)
            step = max(1, self.COPY_SLICE_BYTES // max(1, arr.itemsize))
            jobs += [(flat_dst[i : i + step], flat_src[i : i + step]) for i in range(0, flat_src.size, step)]
        # the copies release the GIL, so two threads use both cores' memory bandwidth
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda job: copy_into(*job), jobs))
        return out


def _check_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ValueError(f"metric {name!r} must be a number (got {type(value).__name__})")
        out[str(name)] = float(value)
    return out


def _check_json(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be JSON-serialisable (no pickle in checkpoints): {err}") from err


def _check_tensors(tensors: dict[str, Any]) -> None:
    for name, arr in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings (got {name!r})")
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"tensor {name!r} must be a numpy array (got {type(arr).__name__})")


def take_snapshot(
    step: int,
    model: Any = None,
    optimizer: Any = None,
    framework: str | None = None,
    state: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    metrics: dict[str, float] | None = None,
    copy_tensors: bool = False,
    buffers: HostBuffers | None = None,
) -> Snapshot:
    """Copy model/optimizer state, RNG states and ``state`` into a `Snapshot`.

    Model and optimizer tensors are always copied; raw ``tensors`` are copied only
    with ``copy_tensors`` (async saves need it, a synchronous save does not). The
    framework is detected from ``model``/``optimizer`` when not given. Raises
    ValueError for a bad step, non-JSON ``state`` or non-numeric metrics, before
    anything is copied. With ``buffers``, copies go into that reusable pool instead of
    fresh memory (the caller must not reuse the pool while a previous snapshot is in use).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int (got {step!r})")
    _check_json("state", state)
    _check_tensors(tensors or {})
    checked_metrics = _check_metrics(metrics)
    owner = model if model is not None else optimizer
    if framework is None and owner is not None:
        framework = detect_framework(owner)
    adapter = get_adapter(framework) if framework else None

    groups: dict[str, dict[str, np.ndarray]] = {}
    full_state: dict[str, Any] = {"step": step, "framework": framework, "created_s": time.time()}
    if adapter is not None:
        full_state["framework_version"] = adapter.version
        full_state["rng"] = adapter.rng_state()
    else:
        full_state["rng"] = python_numpy_rng_state()
    if model is not None:
        if buffers is not None:
            groups["model"] = buffers.copy("model", adapter.model_views(model))
        else:
            groups["model"] = adapter.model_state(model)
        full_state["layouts"] = adapter.module_kinds(model)
    if optimizer is not None:
        groups["optimizer"], optimizer_meta = adapter.optimizer_state(optimizer)
        _check_json("optimizer meta", optimizer_meta)
        full_state["optimizer_meta"] = optimizer_meta
    if tensors:
        if buffers is not None:
            groups["tensors"] = buffers.copy("tensors", tensors)
        else:
            groups["tensors"] = {k: np.array(v, copy=True) if copy_tensors else v for k, v in tensors.items()}
    full_state["metrics"] = checked_metrics
    full_state["user"] = state or {}
    return Snapshot(step=step, framework=framework, groups=groups, state=full_state, metrics=checked_metrics)
