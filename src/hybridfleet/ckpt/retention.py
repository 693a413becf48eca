"""Retention: keep the last N and the best by a metric; remove the rest and unreferenced blobs.

`gc` never removes the newest valid checkpoint. Blobs are removed only when no
save is visibly in flight (a step folder without a manifest newer than the newest
valid step); run gc from the process that saves (AsyncCheckpointer does) or when
no save is running, because a save that has not yet created its folder is invisible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridfleet.ckpt.manifest import MANIFEST_NAME, FileEntry, Manifest, step_dir
from hybridfleet.ckpt.reader import list_steps, read_manifest, read_verified
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


class _Validity:
    """Whether a checkpoint's files all pass their size and CRC-32 checks, each file read once."""

    def __init__(self, store: Store, manifests: dict[int, Manifest]):
        self.store, self.manifests = store, manifests
        self.known: dict[int, bool] = {}
        self._files: dict[tuple[str, int, str | None, str], bool] = {}

    def _file_ok(self, entry: FileEntry) -> bool:
        key = (entry.path, entry.size_bytes, entry.crc32, entry.sha256)
        if key not in self._files:
            try:
                read_verified(self.store, entry)
                self._files[key] = True
            except CheckpointError:
                self._files[key] = False
        return self._files[key]

    def __call__(self, step: int) -> bool:
        if step not in self.known:
            self.known[step] = all(self._file_ok(f) for f in self.manifests[step].files)
        return self.known[step]


def gc(
    url: str | Store,
    keep_last: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "max",
    dry_run: bool = False,
    **store_options: Any,
) -> GcResult:
    """Remove checkpoints outside the last ``keep_last`` and the best by ``best_metric``.

    Only valid checkpoints (every file passes its size and CRC-32 check) are kept or
    counted among the last N; an invalid one is removed. With neither given, only
    leftovers are removed (invalid checkpoints, folders without a manifest older than
    the newest valid checkpoint, and blobs no kept manifest references). The newest
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
    is_valid = _Validity(store, manifests)
    newest_first = sorted(manifests, reverse=True)
    newest_valid = next((s for s in newest_first if is_valid(s)), None)

    if keep_last is None and best_metric is None:
        keep = {s for s in manifests if is_valid(s)}
    else:
        keep = set()
    if keep_last is not None:
        keep.update([s for s in newest_first if is_valid(s)][:keep_last])
    if best_metric is not None:
        best = _best_step({s: m for s, m in manifests.items() if is_valid(s)}, best_metric, best_mode)
        if best is not None:
            keep.add(best)
    if newest_valid is not None:
        keep.add(newest_valid)
    invalid = sorted(s for s in is_valid.known if not is_valid.known[s])
    if invalid:
        log.warning("gc_invalid_checkpoints", url=store.url, steps=invalid, reason="failed size/CRC-32 checks; never kept")
    in_flight = [s for s in steps if s not in manifests and (newest_valid is None or s > newest_valid)]
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
