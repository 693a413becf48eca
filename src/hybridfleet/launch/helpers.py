"""Optional helpers for a training script run by ``hfleet launch`` (torch or paddle).

They read what the launchers put in the environment, so they work the same whichever
framework the script imported, and outside a launcher they describe a single process.
Checkpoints are `hybridfleet.ckpt` checkpoints in ``HFLEET_CKPT_DIR`` (safetensors +
a manifest written last, so a checkpoint without a valid manifest does not exist); it is a
directory or a store URL such as ``s3://bucket/prefix`` (a pod's own disk dies with it).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

KEEP_LAST = 3  # checkpoints kept in HFLEET_CKPT_DIR

# (rank, world size, local rank) variables each launcher sets.
_DIST_ENV = {
    "torch": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "paddle": ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_LOCAL_RANK"),
}


def detect_framework(framework: str | None = None) -> str | None:
    """``framework`` if given, else the one the script imported, else the one ``HFLEET_FRAMEWORK`` names."""
    if framework is not None:
        if framework not in _DIST_ENV:
            raise ValueError(f"framework must be one of {sorted(_DIST_ENV)} (got {framework!r})")
        return framework
    imported = [name for name in _DIST_ENV if name in sys.modules]
    if len(imported) == 1:
        return imported[0]
    return os.environ.get("HFLEET_FRAMEWORK") or None


def dist_info(framework: str | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) of this process; (0, 1, 0) outside a launcher."""
    detected = detect_framework(framework)
    order = sorted(_DIST_ENV, key=lambda name: name != detected)  # the detected one first
    for name in order:
        rank_var, world_var, local_var = _DIST_ENV[name]
        if world_var in os.environ:
            rank = int(os.environ.get(rank_var, "0"))
            return rank, int(os.environ[world_var]), int(os.environ.get(local_var, str(rank)))
    return 0, 1, 0


def is_rank0(framework: str | None = None) -> bool:
    """True on global rank 0 (and in a single process)."""
    return dist_info(framework)[0] == 0


def log_rank0(event: str, **fields: Any) -> None:
    """On rank 0 only, print one JSON line ``{"event": ..., **fields}`` to stdout."""
    if is_rank0():
        print(json.dumps({"event": event, **fields}, default=float), flush=True)


def finish(exit_code: int = 0) -> NoReturn:
    """End this rank now, after the script tore its process group down: flush output, skip interpreter teardown.

    A torch gloo rank that returns normally runs Python's and C++'s exit-time destructors,
    and one of torch's native objects can then find a thread of its still joinable and
    abort the process (SIGABRT, "terminate called without an active exception") after
    the training finished: about one short launch in fourteen here. Everything a
    script writes through hybridfleet (checkpoints, logs) is complete when its calls
    return, so nothing is lost by leaving without that teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def report(step: int, **values: Any) -> None:
    """Publish this rank's metrics (loss, accuracy, ...) at ``step``.

    Every rank sets ``hybridfleet_reported_value{metric=NAME}`` on its metrics endpoint
    (served from the first call when ``HFLEET_METRICS_PORT_BASE`` is set: port base +
    local rank, so ranks of one machine never collide) and writes TensorBoard / VisualDL
    scalars per ``HFLEET_SCALARS`` (see `hybridfleet.obs.scalars`); rank 0 also prints
    the JSON line of `log_rank0` (event ``metrics``).
    """
    from hybridfleet.obs.metrics import ENV_PORT, serve_from_env
    from hybridfleet.obs.scalars import record_report

    base = os.environ.get("HFLEET_METRICS_PORT_BASE", "").strip()
    if base and not os.environ.get(ENV_PORT):
        try:
            os.environ[ENV_PORT] = str(int(base) + dist_info()[2])
        except ValueError:
            raise ValueError(f"HFLEET_METRICS_PORT_BASE must be a port number (got {base!r})") from None
    serve_from_env()
    record_report(step, values, detect_framework())
    log_rank0("metrics", step=step, **values)


def restart_count() -> int:
    """How many times the launcher restarted the group before this attempt (``HFLEET_RESTART_COUNT``)."""
    return int(os.environ.get("HFLEET_RESTART_COUNT", "0"))


def shard_indices(n: int, rank: int, world: int, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
    """This rank's sample indices for one epoch, the same partition under torch and paddle.

    Like torch's ``DistributedSampler`` (drop_last=False): a permutation seeded by
    ``seed + epoch`` (numpy, so both frameworks agree), padded by repeating its head to a
    multiple of ``world``, then every ``world``-th index from ``rank``. Ranks get equal
    counts and together cover every index.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..world-1 with world >= 1 (got rank={rank}, world={world})")
    order = np.random.default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n)
    total = -(-n // world) * world
    padded = np.resize(order, total)  # np.resize repeats from the start
    return padded[rank:total:world]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint found by `latest_checkpoint`."""

    step: int
    state: dict[str, np.ndarray]
    path: Path | str  # a directory, or a URL for a remote store


def _remote(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def ckpt_dir() -> Path | None:
    """``HFLEET_CKPT_DIR`` as a path, or None when unset or a remote URL (see `ckpt_location`)."""
    value = os.environ.get("HFLEET_CKPT_DIR")
    return Path(value) if value and not _remote(value) else None


def ckpt_location() -> str | None:
    """``HFLEET_CKPT_DIR`` as a store URL (a local directory becomes its absolute path), or None when unset."""
    value = os.environ.get("HFLEET_CKPT_DIR")
    if not value:
        return None
    return value if _remote(value) else str(Path(value).resolve())


def save_rank0(model_or_state: Any, step: int) -> Path | None:
    """On rank 0, write a checkpoint of a torch / paddle model (or of numpy arrays) to ``HFLEET_CKPT_DIR``.

    A model is saved with its framework and layer layout, so `hfleet ckpt convert` can
    turn it into the other framework's layout; a dict of numpy arrays is saved as raw
    tensors (no layout: loadable, not convertible). Returns the checkpoint's path, or
    None on other ranks and when ``HFLEET_CKPT_DIR`` is unset (a plain ``python train.py``
    run keeps no checkpoints). Raises ValueError when a dict value is not a numpy array.
    """
    if isinstance(model_or_state, dict):
        for name, value in model_or_state.items():
            if not isinstance(value, np.ndarray):
                raise ValueError(f"state_dict_numpy[{name!r}] must be a numpy array (got {type(value).__name__})")
    location = ckpt_location()
    if location is None or not is_rank0():
        return None
    import time

    from hybridfleet.obs.metrics import observe_checkpoint

    started = time.perf_counter()
    written, size_bytes = _write_checkpoint(location, model_or_state, step)
    observe_checkpoint(time.perf_counter() - started, size_bytes)
    return written


def _write_checkpoint(location: str, model_or_state: Any, step: int) -> tuple[Path | str, int]:
    """A `hybridfleet.ckpt` checkpoint (safetensors + manifest written last) at ``step``, then retention;
    returns its path and size in bytes."""
    from hybridfleet.ckpt import gc, save_checkpoint, save_tensors_checkpoint
    from hybridfleet.ckpt.manifest import step_dir

    if not _remote(location):
        Path(location).mkdir(parents=True, exist_ok=True)
    if isinstance(model_or_state, dict):
        info = save_tensors_checkpoint(location, step, {k: np.ascontiguousarray(v) for k, v in model_or_state.items()})
    else:
        info = save_checkpoint(location, step, model=model_or_state)
    gc(location, keep_last=KEEP_LAST)
    path = f"{location.rstrip('/')}/{step_dir(step)}" if _remote(location) else Path(location) / step_dir(step)
    return path, info.size_bytes


def save_model(model: Any, step: int, metrics: dict[str, float] | None = None, keep_best: str | None = None) -> Path | None:
    """On rank 0, checkpoint the framework ``model`` as the run's model in ``HFLEET_MODEL_DIR``.

    Call it after evaluations (with their ``metrics``) and once at the end; `hfleet launch`
    then writes MODEL.json naming the final checkpoint (the newest) and the best by
    ``keep_best`` (``METRIC`` or ``METRIC:min``), with lineage. The same checkpoints as a PS
    run's model (`hybridfleet.ckpt.run_model`). Returns the checkpoint folder, or None on
    other ranks and when ``HFLEET_MODEL_DIR`` is unset.
    """
    directory = os.environ.get("HFLEET_MODEL_DIR")
    if not directory or not is_rank0():
        return None
    from hybridfleet.ckpt.manifest import step_dir
    from hybridfleet.ckpt.run_model import ModelCheckpointer

    framework = detect_framework()
    if framework is None:
        raise ValueError("save_model: import torch or paddle first (or set HFLEET_FRAMEWORK)")
    ModelCheckpointer(directory, framework, keep_last=KEEP_LAST, keep_best=keep_best).save(step, model, metrics)
    return Path(directory) / step_dir(step)


def latest_checkpoint() -> Checkpoint | None:
    """The newest valid checkpoint in ``HFLEET_CKPT_DIR`` (None when unset or empty).

    ``state`` holds the model's weights as saved (a model's state dict, or the raw arrays).
    """
    from hybridfleet.ckpt.checkpoint import read_newest_valid
    from hybridfleet.ckpt.manifest import step_dir
    from hybridfleet.errors import CheckpointError
    from hybridfleet.store import open_store

    location = ckpt_location()
    if location is None or (not _remote(location) and not Path(location).is_dir()):
        return None
    try:
        manifest, _, groups = read_newest_valid(open_store(location), None)
    except CheckpointError:
        return None
    step = manifest.step
    state = {name: np.array(arr) for name, arr in (groups.get("model") or groups.get("tensors") or {}).items()}
    path = f"{location.rstrip('/')}/{step_dir(step)}" if _remote(location) else Path(location) / step_dir(step)
    return Checkpoint(step=step, state=state, path=path)
