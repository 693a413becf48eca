"""Gradient work that overlaps the backward pass (``ps.overlap: auto``).

As each parameter's gradient is accumulated during ``backward()``, a grad hook (torch's
post-accumulate-grad hook, paddle's backward hook) hands it to `GradientStage`: one
background thread, fed through a bounded queue, copies the gradient to host memory, cuts it
into the sharding plan's blocks and encodes each block with the job's codec (with error
feedback staged, never committed). ``ps.step()`` then waits for the stage and pushes.

The guard that keeps results bit-identical to ``ps.overlap: off``: every staged entry keeps
the gradient tensor it was made from and a token of it taken at hook time (the tensor's
identity and its in-place version counter). At ``ps.step()`` an entry is used only if the
gradient about to be pushed is that very tensor with the same token; a gradient changed after
``backward()`` (``clip_grad_norm_``, ``GradScaler.unscale_``, manual scaling, ``zero_grad``,
a second ``backward()`` accumulating into it, paddle's ``grad_clip``) fails the check and is
redone from the current ``.grad`` in ``ps.step()``, and the staged error-feedback state of
every key not pushed from staged work is discarded before the push. A stage that failed on
a key (a non-finite gradient, say) leaves it to ``ps.step()`` as well, which then behaves
exactly as without overlap.

Where the step's path transforms gradients before encoding (site aggregation, secure
aggregation, differential privacy, a mixed-framework layout, ``ps.sync: local``, no servers)
or the codec draws random numbers on every encode (random-k: the draw order would change),
no hook is installed and nothing is staged.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridfleet.obs.log import get_logger

log = get_logger("ps.worker")

# codecs whose encoding advances a random state: encoding a key early changes every later draw
STATEFUL_CODECS = ("randomk",)
QUEUE_SLOTS = 64  # gradients waiting for the stage; a full queue makes backward() wait (bounded host memory)


def overlap_blocker(job: Any, *, local: bool, aggregates: bool, layout: bool,
                    accelerator: bool = False) -> str | None:
    """Why this worker's steps cannot use staged work (None: they can). ``accelerator``: whether the
    model's trainable parameters live on an accelerator (``ps.overlap: auto`` stages only then)."""
    ps = job.ps
    if ps.overlap == "off":
        return "ps.overlap: off"
    if ps.overlap == "auto" and not accelerator:
        return "ps.overlap: auto with the parameters on the CPU (backward and the stage would share its cores)"
    reasons = [(local, "no servers (local training)"), (ps.sync == "local", "ps.sync: local"),
               (aggregates, "site aggregation"), (ps.secure_aggregation is not None, "secure aggregation"),
               (ps.privacy is not None, "differential privacy"), (layout, "a mixed-framework layout"),
               (ps.compression.codec in STATEFUL_CODECS, f"codec {ps.compression.codec}")]
    return next((why for blocked, why in reasons if blocked), None)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 arrays hold the same bits (-0.0 differs from 0.0)."""
    a, b = np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32))


@dataclass
class Staged:
    """One gradient's host copy and encoded blocks, as made from ``tensor`` at hook time."""

    tensor: Any           # kept alive so its identity (in the token) cannot pass to another tensor
    token: tuple
    array: np.ndarray | None = None       # float32 host copy, the array ps.step() pushes when the entry is used
    payloads: dict[str, bytes] = field(default_factory=dict)
    ok: bool = False


@dataclass
class OverlapStats:
    """Counters of the stage (see `GradientStage.stats`)."""

    hooked: int = 0           # gradients handed to the stage by a grad hook
    encoded: int = 0          # of those, copied and encoded by the stage
    encoded_before_step: int = 0   # encoded by the time ps.step() was entered (summed over steps)
    used: int = 0             # gradients pushed from staged work
    redone: int = 0           # gradients redone in ps.step() because they changed after the hook (or failed)


class GradientStage:
    """One worker thread that copies and encodes gradients as backward() produces them.

    ``to_host(tensor) -> float32 ndarray`` copies a gradient to host memory; ``encode(name,
    array) -> {block key: payload}`` cuts and encodes it; ``token(tensor)`` says which tensor
    and which version of it the work is made from."""

    def __init__(self, to_host: Callable[[Any], np.ndarray], encode: Callable[[str, np.ndarray], dict[str, bytes]],
                 token: Callable[[Any], tuple]):
        self._to_host, self._encode, self._token = to_host, encode, token
        self._queue: queue.Queue = queue.Queue(QUEUE_SLOTS)
        self._entries: dict[str, Staged] = {}
        self._lock = threading.Lock()
        self.stats = OverlapStats()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hfleet-grad-stage", daemon=True)
        self._thread.start()

    # called from the backward pass (autograd's thread) -----------------------------------------
    def submit(self, name: str, tensor: Any) -> None:
        """Stage ``name``'s gradient ``tensor`` (just accumulated); a later submit of the same name
        replaces it (a second backward accumulating into it)."""
        if self._closed or tensor is None:
            return
        entry = Staged(tensor, self._token(tensor))
        with self._lock:
            self._entries[name] = entry
            self.stats.hooked += 1
        self._queue.put((name, entry))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, entry = item
                with self._lock:
                    if self._entries.get(name) is not entry:
                        continue  # replaced by a newer gradient of the same parameter
                try:
                    array = np.array(self._to_host(entry.tensor), dtype=np.float32, copy=True)
                    # a non-finite gradient is refused by the codec here, or found by ps.step(), which then
                    # skips the round and discards whatever was staged for it
                    entry.payloads = self._encode(name, array)
                    entry.array, entry.ok = array, True
                    with self._lock:
                        self.stats.encoded += 1
                except Exception as err:  # noqa: BLE001 - ps.step() redoes the key and raises what is wrong
                    log.debug("overlap_stage_failed", param=name, error=str(err))
            finally:
                self._queue.task_done()

    # called from ps.step() --------------------------------------------------------------------
    def take(self) -> dict[str, Staged]:
        """Wait until every submitted gradient is processed; return the entries and start afresh."""
        with self._lock:
            self.stats.encoded_before_step += sum(1 for e in self._entries.values() if e.ok)
        self.wait()
        with self._lock:
            entries, self._entries = self._entries, {}
        return entries

    def wait(self) -> None:
        """Block until every gradient submitted so far is processed."""
        self._queue.join()

    def valid(self, entry: Staged | None, tensor: Any) -> bool:
        """Whether ``entry`` was made from ``tensor`` as it is now (same tensor, same version)."""
        return entry is not None and entry.ok and self._token(tensor) == entry.token

    def close(self) -> None:
        """Stop the worker thread (pending work is dropped)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(10)
