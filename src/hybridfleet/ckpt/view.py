"""A streaming, verified view of a checkpoint's tensors: each file is checked before any of its tensors is handed out.

`load_checkpoint` verifies every byte of every file before it returns anything (and
falls back to the previous checkpoint when one fails). That costs one full pass over
the bytes before the first tensor is used. `open_tensors` instead returns a
`VerifiedTensors` mapping at once and verifies the files in background threads, in
manifest order, while the caller uses the tensors of files already verified: the
checksum pass of file i+1 overlaps the caller's work on file i (the CRC-32 and sha256
routines release the GIL). A tensor is returned only after the size and CRC-32 (or
sha256) of the whole file holding it matched the manifest; a flipped byte or a
truncated file raises `CheckpointError` when the caller reaches that file, and none of
its tensors is ever returned. Tensors at least 1 MiB have a file of their own
(`hybridfleet.ckpt.writer.OWN_FILE_BYTES`), so for them this is per-tensor verification.

There is no fallback: tensors handed out before a corrupt file was reached have been
used already. Use `load_checkpoint` for all-or-nothing loads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.manifest import FileEntry, Manifest
from hybridfleet.ckpt.reader import list_steps, read_manifest, read_verified
from hybridfleet.errors import CheckpointError
from hybridfleet.store import Store, open_store

# Verifying is memory-bound; a few threads saturate memory bandwidth on most hosts.
VERIFY_WORKERS = max(1, min(4, os.cpu_count() or 1))


class VerifiedTensors(Mapping):
    """name -> numpy array of one role of one checkpoint, each file verified before its tensors are returned.

    Iteration yields names file by file in manifest order, each file as soon as it is
    verified; ``view[name]`` waits for the file holding ``name`` (and the files before it,
    since names are only known from verified bytes). Arrays are writable private
    views (copy-on-write memory maps for local files). Raises CheckpointError naming the
    first missing, truncated or corrupt file the caller reaches. Close it (or use it as a
    context manager) to stop verifying files the caller no longer needs.
    """

    def __init__(self, store: Store, manifest: Manifest, role: str, check_sha256: bool = False, workers: int = VERIFY_WORKERS):
        self.store = store
        self.manifest = manifest
        self.role = role
        self._entries = manifest.files_of(role)
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hfleet-verify")
        self._futures: list[Future] = [self._pool.submit(self._verify_file, e, check_sha256) for e in self._entries]
        self._lock = threading.Lock()
        self._tensors: dict[str, np.ndarray] = {}
        self._done = 0  # files whose tensors are in self._tensors

    def _verify_file(self, entry: FileEntry, check_sha256: bool) -> dict[str, np.ndarray]:
        buffer = read_verified(self.store, entry, check_sha256)
        tensors, _ = safetensors_io.decode(buffer, f"{self.store.url}/{entry.path} ({entry.name})")
        return tensors

    def _take(self, index: int) -> list[str]:
        """Wait for file ``index`` to verify and add its tensors; returns their names."""
        tensors = self._futures[index].result()
        with self._lock:
            if index < self._done:
                return list(tensors)
            for name in tensors:
                if name in self._tensors:
                    raise CheckpointError(f"{self.store.url}: tensor {name!r} appears in two {self.role} files")
            self._tensors.update(tensors)
            self._done = index + 1
        return list(tensors)

    def __iter__(self) -> Iterator[str]:
        for index in range(len(self._entries)):
            yield from self._take(index)

    def __getitem__(self, name: str) -> np.ndarray:
        index = self._done
        while name not in self._tensors and index < len(self._entries):
            self._take(index)
            index += 1
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(name) from None

    def __len__(self) -> int:
        for index in range(self._done, len(self._entries)):
            self._take(index)
        return len(self._tensors)

    def close(self) -> None:
        """Stop verifying files not yet started; tensors already returned stay valid."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "VerifiedTensors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_tensors(
    url: str | Store, step: int | None = None, role: str = "tensors", check_sha256: bool = False, **store_options: Any
) -> VerifiedTensors:
    """A `VerifiedTensors` view of ``role`` ("tensors", "model" or "optimizer") of ``step`` (default: the newest
    step with a manifest), verifying files in the background while the caller uses verified ones.

    Files are checked by size and CRC-32, or by sha256 with ``check_sha256`` (or when the
    manifest has no CRC-32). Raises CheckpointError when there is no such checkpoint;
    corrupt files raise when the caller reaches them (see `VerifiedTensors`).
    """
    store = open_store(url, **store_options)
    if step is None:
        steps = list_steps(store)
        for candidate in reversed(steps):
            try:
                manifest = read_manifest(store, candidate)
                break
            except CheckpointError:
                continue
        else:
            raise CheckpointError(f"no checkpoint with a manifest under {store.url} (steps found: {steps or 'none'})")
    else:
        manifest = read_manifest(store, step)
    if not manifest.files_of(role):
        roles = sorted({f.role for f in manifest.files if f.role != "state"})
        raise CheckpointError(f"{store.url} step {manifest.step}: no {role!r} tensors (roles saved: {roles or 'none'})")
    return VerifiedTensors(store, manifest, role, check_sha256)
