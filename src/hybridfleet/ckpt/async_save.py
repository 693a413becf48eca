"""Asynchronous checkpointing: copy to host memory now, write in a background thread.

At most one save is in flight. A second `save` while one is writing either waits
for it (``if_busy="wait"``, the default; the wait counts as stall) or is skipped
with a warning log and returns None (``if_busy="refuse"``). `close()` (also run at
interpreter exit) waits for the write in flight; if it fails or does not finish
within ``exit_timeout_s``, the lost step is logged as ``checkpoint_lost``.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

import numpy as np

from hybridfleet.ckpt.checkpoint import CheckpointInfo, write_checkpoint
from hybridfleet.ckpt.retention import gc
from hybridfleet.ckpt.snapshot import HostBuffers, Snapshot, take_snapshot
from hybridfleet.ckpt.writer import SHARD_BYTES
from hybridfleet.errors import CheckpointError
from hybridfleet.obs.log import get_logger
from hybridfleet.store import Store, open_store

log = get_logger("ckpt.async")
IF_BUSY = ("wait", "refuse")


class AsyncCheckpointer:
    """Background checkpoint writer for one store URL; optional retention after each save."""

    def __init__(
        self,
        url: str | Store,
        framework: str | None = None,
        if_busy: str = "wait",
        keep_last: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "max",
        exit_timeout_s: float | None = None,
        shard_bytes: int = SHARD_BYTES,
        **store_options: Any,
    ):
        if if_busy not in IF_BUSY:
            raise ValueError(f"if_busy must be one of {IF_BUSY} (got {if_busy!r})")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last})")
        self.store = open_store(url, **store_options)
        self.framework = framework
        self.if_busy = if_busy
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.exit_timeout_s = exit_timeout_s
        self.shard_bytes = shard_bytes
        self.last_info: CheckpointInfo | None = None
        self.last_stall_s: float | None = None
        self._thread: threading.Thread | None = None
        self._pending_step: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._buffers = HostBuffers()  # reused: at most one snapshot is in flight
        atexit.register(self._at_exit)

    @property
    def busy(self) -> bool:
        """True while a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        step: int,
        model: Any = None,
        optimizer: Any = None,
        state: dict[str, Any] | None = None,
        tensors: dict[str, np.ndarray] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> float | None:
        """Snapshot now, write in the background; returns the stall in seconds (None if refused)."""
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed")
        start = time.perf_counter()
        if self.busy:
            if self.if_busy == "refuse":
                log.warning("checkpoint_refused_busy", step=step, in_flight_step=self._pending_step)
                return None
            self._join()
        self._report_failure()
        snapshot = take_snapshot(step, model, optimizer, self.framework, state, tensors, metrics, copy_tensors=True, buffers=self._buffers)
        self._pending_step = step
        self._thread = threading.Thread(target=self._write, args=(snapshot,), name=f"ckpt-write-{step}", daemon=True)
        self._thread.start()
        self.last_stall_s = time.perf_counter() - start
        return self.last_stall_s

    def _write(self, snapshot: Snapshot) -> None:
        try:
            info = write_checkpoint(self.store, snapshot, self.shard_bytes)
            info.stall_s = self.last_stall_s
            self.last_info = info
            if self.keep_last is not None or self.best_metric is not None:
                gc(self.store, keep_last=self.keep_last, best_metric=self.best_metric, best_mode=self.best_mode)
        except BaseException as err:  # reported by the caller's thread
            self._error = err

    def _join(self, timeout_s: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def _report_failure(self) -> BaseException | None:
        err, self._error = self._error, None
        if err is not None:
            log.error("checkpoint_lost", step=self._pending_step, reason=str(err))
        return err

    def raise_failure(self) -> None:
        """Raise CheckpointError when a background write has failed since the last check (without
        waiting for a write in flight); the failure is reported once."""
        if self.busy:
            return
        err = self._report_failure()
        if err is not None:
            raise CheckpointError(f"background checkpoint write of step {self._pending_step} failed: {err}") from err

    def wait(self) -> CheckpointInfo | None:
        """Block until the write in flight is done; re-raise its error as CheckpointError."""
        self._join()
        err = self._report_failure()
        if err is not None:
            raise CheckpointError(f"background checkpoint write of step {self._pending_step} failed: {err}") from err
        return self.last_info

    def close(self) -> None:
        """Wait for the write in flight (see `wait`) and stop accepting saves. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self.wait()

    def _at_exit(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._join(self.exit_timeout_s):
            log.error("checkpoint_lost", step=self._pending_step, reason=f"still writing after {self.exit_timeout_s} s at exit")
            return
        self._report_failure()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
