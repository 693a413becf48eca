"""A training run's model: periodic, best and final checkpoints, and the card that says where it came from.

One path for every kind of job: a PS worker (global rank 0, see `hybridfleet.ps.worker.frontend`)
and a collective script (rank 0, through `hybridfleet.launch.helpers.save_model`) drive a
`ModelCheckpointer` rooted at ``HFLEET_MODEL_DIR`` (``<run_dir>/model``). Checkpoints are
ordinary `hybridfleet.ckpt` checkpoints of the framework model (weights + layer layouts,
so they convert between torch and paddle). At the end of the run the launcher writes
``MODEL.json`` (`write_model_card`): the final and the best step, each manifest's sha256,
and the lineage (job, run id, git commit and dirty flag, env lock hash, image, framework
and version, dataset names, metrics from summary.json). A run without ``MODEL.json`` has
no model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridfleet.ckpt.async_save import AsyncCheckpointer
from hybridfleet.ckpt.checkpoint import save_checkpoint
from hybridfleet.ckpt.manifest import MANIFEST_NAME, step_dir
from hybridfleet.ckpt.reader import list_steps, read_checkpoint, read_manifest
from hybridfleet.ckpt.retention import gc
from hybridfleet.ckpt.site_buffers import site_buffers_index
from hybridfleet.errors import CheckpointError, SpecError
from hybridfleet.obs.log import get_logger
from hybridfleet.store import Store, open_store

if TYPE_CHECKING:
    from hybridfleet.spec.models import CheckpointSpec, JobSpec

log = get_logger("ckpt.run_model")

MODEL_DIR_ENV = "HFLEET_MODEL_DIR"
CARD_NAME = "MODEL.json"
CARD_FORMAT = "hybridfleet.model"
CARD_VERSION = 1


@dataclass(frozen=True)
class BestRule:
    """Which checkpoint is the best: the max (or min) of one metric."""

    metric: str
    mode: str = "max"

    def better(self, value: float, than: float | None) -> bool:
        """True when ``value`` beats ``than`` (None: nothing to beat)."""
        if than is None:
            return True
        return value > than if self.mode == "max" else value < than


def parse_keep_best(text: str | None) -> BestRule | None:
    """``checkpoint.keep_best``: ``METRIC`` (higher is better) or ``METRIC:min`` / ``METRIC:max``."""
    if not text:
        return None
    metric, _, mode = text.partition(":")
    mode = mode or "max"
    if not metric or mode not in ("max", "min"):
        raise SpecError(f"checkpoint.keep_best: expected METRIC, METRIC:max or METRIC:min (got {text!r})")
    return BestRule(metric, mode)


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class ModelCheckpointer:
    """Saves a framework model under one root: every N steps / seconds, at each new best, and at the end.

    Every save is followed by retention (`gc`): the newest ``keep_last``, the best by
    ``keep_best`` and the final checkpoint stay. A checkpoint carries only the metrics
    measured at its own step, so "best" never credits weights with an older evaluation.

    With ``background=True`` the periodic and best saves copy the model's values once and
    write them (and apply retention) in a background thread (`AsyncCheckpointer`, at most
    one write in flight), so the training step does not wait for the disk; the files and
    retention are the same as a synchronous save's. A failed background write is raised as
    CheckpointError at the next `after_step` / `on_metrics` / `final` / `save` / `close`;
    `final`, `save` and `close` return only once every write is done.
    """

    def __init__(self, root: str | Store, framework: str, every_steps: int | None = None,
                 every_s: float | None = None, keep_last: int = 3, keep_best: str | None = None,
                 background: bool = False):  # fmt: skip
        self.store = open_store(root)
        self.framework = framework
        self.every_steps = every_steps
        self.every_s = every_s
        self.keep_last = keep_last
        self.best = parse_keep_best(keep_best)
        self.best_value: float | None = None
        self.last_saved_step: int | None = None
        self.final_saved = False
        self._last_save_time = time.monotonic()
        self._writer = AsyncCheckpointer(self.store, framework, keep_last=keep_last,
                                         best_metric=self.best.metric if self.best else None,
                                         best_mode=self.best.mode if self.best else "max") if background else None

    @classmethod
    def from_env(cls, job: JobSpec | None, framework: str, env: dict[str, str] | None = None,
                 background: bool = False) -> ModelCheckpointer | None:
        """The checkpointer ``HFLEET_MODEL_DIR`` asks for, with the job's ``checkpoint`` cadence; None when unset."""
        env = os.environ if env is None else env
        root = env.get(MODEL_DIR_ENV)
        if not root:
            return None
        if job is None:
            return cls(root, framework, background=background)
        cadence: CheckpointSpec = job.checkpoint
        return cls(root, framework, cadence.every_steps, cadence.every_s, cadence.keep_last, cadence.keep_best,
                   background=background)

    def after_step(self, step: int, model: Any) -> bool:
        """Save when ``every_steps`` or ``every_s`` says so; True when a checkpoint was written
        (with ``background``: snapshotted, its write under way)."""
        self.raise_failed_write()
        due = bool(self.every_steps and step % self.every_steps == 0)
        due = due or bool(self.every_s and time.monotonic() - self._last_save_time >= self.every_s)
        if due and step != self.last_saved_step:
            self._save(step, model, {})
        return due

    def on_metrics(self, step: int, model: Any, metrics: dict[str, Any]) -> bool:
        """Save when ``metrics`` hold a new best of ``keep_best``; True when a checkpoint was written."""
        self.raise_failed_write()
        if self.best is None:
            return False
        value = _numeric(metrics).get(self.best.metric)
        if value is None or not self.best.better(value, self.best_value):
            return False
        self.best_value = value
        self._save(step, model, metrics)
        return True

    def final(self, step: int, model: Any, metrics: dict[str, Any] | None = None) -> None:
        """Save the model as the run ends (replacing a save of the same step, now with its final metrics);
        returns once it and every earlier save are written."""
        self._save(step, model, metrics or {})
        self.wait()
        self.final_saved = True

    def save(self, step: int, model: Any, metrics: dict[str, Any] | None = None) -> None:
        """Save ``model`` at ``step`` now (with the metrics measured at this step), then apply retention;
        returns once it is written."""
        self._save(step, model, metrics or {})
        self.wait()

    def wait(self) -> None:
        """Block until the background write in flight (if any) is done; CheckpointError if one failed."""
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        """Wait for the write in flight (see `wait`) and stop writing. Idempotent."""
        if self._writer is not None:
            self._writer.close()

    def raise_failed_write(self) -> None:
        """Raise CheckpointError when a background write has failed (without waiting for one in flight)."""
        if self._writer is not None:
            self._writer.raise_failure()

    def _save(self, step: int, model: Any, metrics: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.wait()  # one write in flight; a failed one is raised here, never dropped
            self._writer.save(step, model=model, metrics=_numeric(metrics), state={"model_checkpoint": True})
        else:
            save_checkpoint(self.store, step, model=model, framework=self.framework, metrics=_numeric(metrics),
                            state={"model_checkpoint": True})  # fmt: skip
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
        if self._writer is None:  # a background write applies retention itself, once written
            gc(self.store, keep_last=self.keep_last, best_metric=self.best.metric if self.best else None,
               best_mode=self.best.mode if self.best else "max")  # fmt: skip


# ------------------------------------------------------------------------------------ the card
def manifest_sha256(store: Store, step: int) -> str:
    """sha256 of the MANIFEST.json bytes of ``step`` (what the registry records for a version)."""
    return hashlib.sha256(store.get_bytes(f"{step_dir(step)}/{MANIFEST_NAME}")).hexdigest()


def git_state(cwd: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the git work tree at ``cwd``."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def env_lock_hash(lock_path: str | None, image: str | None) -> str:
    """The job's lock hash (``environment.lock``), else the hash of this machine's lock."""
    from hybridfleet.env.lock import make_lock, read_lock

    if lock_path:
        return str(read_lock(lock_path)["hash"])
    return str(make_lock(image)["hash"])


def _best_step(store: Store, steps: list[int], rule: BestRule | None) -> tuple[int | None, float | None]:
    if rule is None:
        return None, None
    scored = []
    for step in steps:
        value = read_manifest(store, step).metrics.get(rule.metric)
        if value is not None:
            scored.append((value, step))
    if not scored:
        return None, None
    value, step = (max if rule.mode == "max" else min)(scored)
    return step, value


# Figures a worker reports for its own share of the data, whose job-wide value is the sum over
# the workers (summary.json): MODEL.json and the registry record the job's.
JOB_TOTALS = ("train_rows",)


def write_model_card(model_root: str | Store, lineage: dict[str, Any], keep_best: str | None = None) -> dict[str, Any] | None:
    """Write ``MODEL.json`` under ``model_root``: final and best checkpoint plus ``lineage``.

    The final model is the newest checkpoint whose every file verifies; None (and no card)
    when the run saved no valid model checkpoint.
    """
    store = open_store(model_root)
    steps = list_steps(store)
    final_step = None
    framework = framework_version = None
    final_metrics: dict[str, float] = {}
    for step in reversed(steps):
        try:
            manifest, state, _ = read_checkpoint(store, step)
        except CheckpointError as err:
            log.warning("model_checkpoint_invalid", url=store.url, step=step, reason=str(err))
            continue
        final_step, framework, framework_version = step, manifest.framework, state.get("framework_version")
        # the job's totals (the run's summary) replace the one worker's share the checkpoint recorded
        final_metrics = {**manifest.metrics, **{k: v for k, v in lineage.get("metrics", {}).items() if k in JOB_TOTALS}}
        break
    if final_step is None:
        return None
    rule = parse_keep_best(keep_best)
    best_step, best_value = _best_step(store, [s for s in steps if s <= final_step], rule)
    card = {
        "format": CARD_FORMAT, "version": CARD_VERSION, "url": store.url, "created_s": time.time(),
        "final": {"step": final_step, "manifest_sha256": manifest_sha256(store, final_step), "metrics": final_metrics},
        "best": None if best_step is None else {
            "step": best_step, "manifest_sha256": manifest_sha256(store, best_step),
            "metric": rule.metric, "mode": rule.mode, "value": best_value},  # type: ignore[union-attr]
        "lineage": {**lineage, "framework": framework, "framework_version": framework_version},
        "site_buffers": site_buffers_index(store),  # ps.buffers: local: each site's statistics
    }  # fmt: skip
    store.put_bytes(CARD_NAME, json.dumps(card, indent=2, sort_keys=True).encode())
    return card


def read_model_card(model_root: str | Store) -> dict[str, Any]:
    """The parsed ``MODEL.json`` of a run's model root; CheckpointError when absent or not a card."""
    store = open_store(model_root)
    if not store.exists(CARD_NAME):
        raise CheckpointError(f"{store.url}: no {CARD_NAME}, so this run has no model (did it save one?)")
    try:
        card = json.loads(store.get_bytes(CARD_NAME))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{store.url}/{CARD_NAME}: not valid JSON ({err})") from err
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT:
        raise CheckpointError(f"{store.url}/{CARD_NAME}: not a {CARD_FORMAT} card")
    return card


def launch_lineage(script: str, run_dir: Path, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """The lineage of a collective `hfleet launch` run (no job file: the script names the job)."""
    return {"job": Path(script).stem, "run_id": run_dir.name, "run_dir": str(run_dir), "git": git_state(),
            "env_lock_hash": env_lock_hash(None, os.environ.get("HFLEET_IMAGE")), "image": os.environ.get("HFLEET_IMAGE"),
            "datasets": {}, "metrics": _numeric(metrics or {}), "status": "completed"}  # fmt: skip


def run_lineage(spec: Any, run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The lineage of a job's run: job, run id, git, env lock hash, image, datasets, summary metrics."""
    metrics = _numeric({k: v for k, v in summary.items() if k not in ("shards", "workers", "restarts", "wall_s")})
    return {
        "job": spec.name, "run_id": run_dir.name, "run_dir": str(run_dir),
        "git": git_state(), "env_lock_hash": env_lock_hash(spec.environment.lock, spec.environment.image),
        "image": spec.environment.image, "datasets": {site: s.data for site, s in spec.sites.items()},
        "metrics": metrics, "status": summary.get("status"),
    }  # fmt: skip
