"""Retention: keep the last N and the best by a metric; remove the rest and unreferenced blobs.

`gc` never removes the newest valid checkpoint. Blobs are removed only when no
save is visibly in flight (a step folder without a manifest newer than the newest
valid step); run gc from the process that saves (AsyncCheckpointer does) or when
no save is running, because a save that has not yet created its folder is invisible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridfleet.ckpt.manifest import MANIFEST_NAME, Manifest, step_dir
from hybridfleet.ckpt.reader import list_steps, read_checkpoint, read_manifest
from hybridfleet.errors import CheckpointError
from hybridfleet.obs.log import get_logger
from hybridfleet.store import BLOB_PREFIX, Store, open_store

log = get_logger("ckpt.gc")
BEST_MODES = ("max", "min")


@dataclass
class GcResult:
    kept_steps: list[int] = field(default_factory=list)
    removed_steps: list[int] = field(default_factory=list)
    removed_blobs: int = 0
    freed_bytes: int = 0


def _best_step(manifests: dict[int, Manifest], metric: str, mode: str) -> int | None:
    scored = [(m.metrics[metric], step) for step, m in manifests.items() if metric in m.metrics]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored)[1]


def gc(
    url: str | Store,
    keep_last: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "max",
    dry_run: bool = False,
    **store_options: Any,
) -> GcResult:
    """Remove checkpoints outside the last ``keep_last`` and the best by ``best_metric``.

    With neither given, only leftovers are removed (folders without a manifest older
    than the newest valid checkpoint, and blobs no manifest references). The newest
    valid checkpoint is always kept. ``dry_run`` reports without removing.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (got {keep_last})")
    if best_mode not in BEST_MODES:
        raise ValueError(f"best_mode must be one of {BEST_MODES} (got {best_mode!r})")
    store = open_store(url, **store_options)
    steps = list_steps(store)
    manifests: dict[int, Manifest] = {}
    for step in steps:
        try:
            manifests[step] = read_manifest(store, step)
        except CheckpointError:
            pass
    newest_valid = None
    for step in sorted(manifests, reverse=True):
        try:
            read_checkpoint(store, step)
            newest_valid = step
            break
        except CheckpointError:
            continue

    keep = set(manifests) if keep_last is None and best_metric is None else set()
    if keep_last is not None:
        keep.update(sorted(manifests)[-keep_last:])
    if best_metric is not None:
        best = _best_step(manifests, best_metric, best_mode)
        if best is not None:
            keep.add(best)
    if newest_valid is not None:
        keep.add(newest_valid)
    in_flight = [s for s in steps if s not in manifests and (newest_valid is None or s > newest_valid)]
    keep.update(s for s in manifests if newest_valid is not None and s > newest_valid)  # unverified newer ones stay for `verify`
    doomed = [s for s in steps if s not in keep and s not in in_flight]

    result = GcResult(kept_steps=sorted(keep), removed_steps=doomed)
    if not dry_run:
        for step in doomed:
            store.rm(f"{step_dir(step)}/{MANIFEST_NAME}")  # invisible first, then removed
            store.rm(step_dir(step), recursive=True)
    if in_flight:
        log.info("gc_blobs_skipped", url=store.url, reason="save in flight", steps=in_flight)
        return result
    referenced = {f.path for step, m in manifests.items() if step in keep for f in m.files}
    for path in store.ls(BLOB_PREFIX):
        if path not in referenced:
            result.removed_blobs += 1
            result.freed_bytes += store.size(path)
            if not dry_run:
                store.rm(path)
    log.info("gc_done", url=store.url, kept=result.kept_steps, removed=doomed, removed_blobs=result.removed_blobs, dry_run=dry_run)
    return result
