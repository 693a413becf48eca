"""Public checkpoint API: save, load (newest valid), list, verify; raw-tensor snapshots."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridfleet.ckpt.manifest import FileEntry, Manifest
from hybridfleet.ckpt.reader import list_steps, read_checkpoint, read_manifest
from hybridfleet.ckpt.snapshot import Snapshot, take_snapshot
from hybridfleet.ckpt.writer import SHARD_BYTES, write_snapshot
from hybridfleet.errors import CheckpointError
from hybridfleet.frameworks import detect_framework, get_adapter
from hybridfleet.frameworks.base import set_python_numpy_rng_state
from hybridfleet.frameworks.layout import convert_state
from hybridfleet.obs.log import get_logger
from hybridfleet.store import Store, open_store

log = get_logger("ckpt")


@dataclass
class CheckpointInfo:
    """What a checkpoint holds, as seen by `save_checkpoint`, `load_checkpoint` and `list_checkpoints`."""

    url: str
    step: int
    framework: str | None
    created_s: float
    metrics: dict[str, float]
    size_bytes: int
    files: list[FileEntry]
    state: dict[str, Any] = field(default_factory=dict)  # the caller's `state` (epoch, sampler, ...)
    framework_version: str | None = None
    rng: dict[str, Any] | None = None
    tensors: dict[str, np.ndarray] | None = None  # the raw `tensors=` group, when loaded
    uploaded_bytes: int = 0  # payload bytes this save actually wrote
    stall_s: float | None = None  # time the caller was blocked (async saves)


def _info(store: Store, manifest: Manifest, state: dict[str, Any] | None = None) -> CheckpointInfo:
    state = state or {}
    return CheckpointInfo(
        url=store.url, step=manifest.step, framework=manifest.framework, created_s=manifest.created_s,
        metrics=manifest.metrics, size_bytes=manifest.size_bytes, files=manifest.files,
        state=state.get("user", {}), framework_version=state.get("framework_version"), rng=state.get("rng"),
    )  # fmt: skip


def write_checkpoint(store: Store, snapshot: Snapshot, shard_bytes: int = SHARD_BYTES) -> CheckpointInfo:
    """Write an already-taken snapshot (the I/O half of a save) and log it."""
    start = time.perf_counter()
    manifest, uploaded = write_snapshot(store, snapshot, shard_bytes=shard_bytes)
    info = _info(store, manifest, snapshot.state)
    info.uploaded_bytes = uploaded
    log.info("checkpoint_saved", url=store.url, step=snapshot.step, size_bytes=manifest.size_bytes,
             uploaded_bytes=uploaded, write_s=round(time.perf_counter() - start, 6))  # fmt: skip
    return info


def save_checkpoint(
    store_url: str | Store,
    step: int,
    model: Any = None,
    optimizer: Any = None,
    framework: str | None = None,
    state: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    metrics: dict[str, float] | None = None,
    shard_bytes: int = SHARD_BYTES,
    **store_options: Any,
) -> CheckpointInfo:
    """Save a checkpoint of ``step`` durably and return what was written.

    ``model``/``optimizer`` are torch or paddle objects (framework detected unless
    given); ``tensors`` are raw numpy arrays; ``state`` is any JSON-able dict
    (e.g. ``{"epoch": 3, "sampler": {...}, "env_lock_hash": "..."}``). RNG states of python, numpy and the
    framework are captured. The manifest is written last, so an interrupted save is
    invisible to readers. ``store_options`` (endpoint_url, key, secret) go to `open_store`.
    """
    snapshot = take_snapshot(step, model, optimizer, framework, state, tensors, metrics)
    return write_checkpoint(open_store(store_url, **store_options), snapshot, shard_bytes)


def read_newest_valid(store: Store, step: int | None) -> tuple[Manifest, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """(manifest, state, tensors by role) of the newest fully verified checkpoint, or of ``step``.

    Invalid newer checkpoints are skipped with a warning log; CheckpointError when none is valid.
    """
    if step is not None:
        return read_checkpoint(store, step)
    steps = list_steps(store)
    for candidate in reversed(steps):
        try:
            return read_checkpoint(store, candidate)
        except CheckpointError as err:
            log.warning("checkpoint_invalid_skipped", url=store.url, step=candidate, reason=str(err))
    raise CheckpointError(f"no valid checkpoint under {store.url} (steps found: {steps or 'none'})")


def _apply(framework_of_ckpt: str | None, state: dict[str, Any], groups: dict[str, dict[str, np.ndarray]],
           model: Any, optimizer: Any, restore_rng: bool) -> None:  # fmt: skip
    owner = model if model is not None else optimizer
    target = detect_framework(owner)
    adapter = get_adapter(target)
    # every check that can fail comes before anything is loaded, so a refused load changes nothing
    if model is not None and "model" not in groups:
        raise CheckpointError("the checkpoint has no model tensors (it was saved with tensors= only)")
    if optimizer is not None:
        if framework_of_ckpt != target:
            raise CheckpointError(f"optimizer state saved with {framework_of_ckpt} cannot be loaded into a {target} optimizer")
        if "optimizer" not in groups and not state.get("optimizer_meta"):
            raise CheckpointError("the checkpoint has no optimizer state")
    previous = None
    if model is not None:
        weights = groups["model"]
        if framework_of_ckpt and framework_of_ckpt != target:
            weights, _ = convert_state(weights, state.get("layouts", {}), framework_of_ckpt, target)
        if optimizer is not None:
            previous = adapter.model_state(model)
        adapter.load_model_state(model, weights)
    if optimizer is not None:
        try:
            adapter.load_optimizer_state(optimizer, groups.get("optimizer", {}), state.get("optimizer_meta", {}))
        except Exception:
            if previous is not None:  # put the model back as it was
                adapter.load_model_state(model, previous)
            raise
    if restore_rng and state.get("rng"):
        if framework_of_ckpt == target:
            adapter.set_rng_state(state["rng"])
        else:
            set_python_numpy_rng_state(state["rng"])


def load_checkpoint(
    url: str | Store,
    model: Any = None,
    optimizer: Any = None,
    step: int | None = None,
    restore_rng: bool = True,
    **store_options: Any,
) -> CheckpointInfo:
    """Load the newest valid checkpoint (or exactly ``step``) and return its info.

    Every file is verified by size and CRC-32 (sha256 for manifests without one; `verify`
    always checks sha256); a corrupt or truncated newest
    checkpoint is skipped with a warning log and the previous valid one is used.
    Model weights load strictly (a model of the other framework gets converted via
    the recorded layer layouts); the optimizer and RNG states are restored when given.
    ``info.tensors`` holds raw tensors saved with ``tensors=``. Raises CheckpointError
    when no valid checkpoint exists (or ``step`` is invalid).
    """
    store = open_store(url, **store_options)
    manifest, state, groups = read_newest_valid(store, step)
    if model is not None or optimizer is not None:
        _apply(manifest.framework, state, groups, model, optimizer, restore_rng)
    info = _info(store, manifest, state)
    info.tensors = groups.get("tensors")
    log.info("checkpoint_loaded", url=store.url, step=manifest.step)
    return info


def list_checkpoints(url: str | Store, **store_options: Any) -> list[CheckpointInfo]:
    """Checkpoints with a readable manifest, oldest first (bytes are not verified; see `verify`)."""
    store = open_store(url, **store_options)
    infos = []
    for step in list_steps(store):
        try:
            infos.append(_info(store, read_manifest(store, step)))
        except CheckpointError:
            continue
    return infos


@dataclass
class VerifyResult:
    step: int
    ok: bool
    problem: str = ""


def verify(url: str | Store, step: int | None = None, **store_options: Any) -> list[VerifyResult]:
    """Verify every byte of every checkpoint folder (or only ``step``) by sha256, oldest first."""
    store = open_store(url, **store_options)
    results = []
    for candidate in [step] if step is not None else list_steps(store):
        try:
            read_checkpoint(store, candidate, check_sha256=True)
            results.append(VerifyResult(candidate, True))
        except CheckpointError as err:
            results.append(VerifyResult(candidate, False, str(err)))
    return results


def save_tensors_checkpoint(
    url: str | Store, step: int, tensors: dict[str, np.ndarray], state: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None, **store_options: Any,
) -> CheckpointInfo:  # fmt: skip
    """Save raw numpy ``tensors`` (e.g. PS parameters + optimizer slots) and a JSON ``state`` at ``step``."""
    return save_checkpoint(url, step, tensors=tensors, state=state, metrics=metrics, **store_options)


def load_tensors_checkpoint(
    url: str | Store, step: int | None = None, **store_options: Any
) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
    """(step, tensors, state) of the newest valid checkpoint (or ``step``); arrays are writable."""
    info = load_checkpoint(url, step=step, **store_options)
    return info.step, dict(info.tensors or {}), info.state
