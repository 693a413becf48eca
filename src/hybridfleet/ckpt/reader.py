"""Reading checkpoints back: listing steps, parsing manifests, verifying every byte.

Loads check each file's size and CRC-32; `verify` checks sha256 (see `manifest`).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.manifest import MANIFEST_NAME, FileEntry, Manifest, parse_step_dir, step_dir
from hybridfleet.errors import CheckpointError, StoreError
from hybridfleet.store import Store, crc32_parts, sha256_parts
from hybridfleet.store.base import Buffer

READ_WORKERS = max(2, min(4, os.cpu_count() or 1))  # checksums release the GIL and are memory-bound


def list_steps(store: Store) -> list[int]:
    """Steps that have a folder under ``store`` (with or without a manifest), ascending."""
    steps = [parse_step_dir(p) for p in store.ls("")]
    return sorted(s for s in steps if s is not None)


def read_manifest(store: Store, step: int) -> Manifest:
    """The parsed manifest of ``step``; CheckpointError when it is missing or malformed."""
    path = f"{step_dir(step)}/{MANIFEST_NAME}"
    try:
        data = store.get_bytes(path)
    except StoreError as err:
        raise CheckpointError(f"{store.url}/{path}: no manifest, so step {step} is not a checkpoint") from err
    manifest = Manifest.from_json(data, f"{store.url}/{path}")
    if manifest.step != step:
        raise CheckpointError(f"{store.url}/{path}: manifest says step {manifest.step}, folder says {step}")
    return manifest


def read_verified(store: Store, entry: FileEntry, check_sha256: bool = False) -> Buffer:
    """The bytes of one manifest entry, checked against its size and its CRC-32.

    With ``check_sha256`` (or when the manifest has no CRC-32 for it) the sha256 is checked instead.
    """
    source = f"{store.url}/{entry.path} ({entry.name})"
    try:
        buffer = store.read_buffer(entry.path)
    except StoreError as err:
        raise CheckpointError(f"{source}: missing") from err
    size = memoryview(buffer).nbytes
    if size != entry.size_bytes:
        raise CheckpointError(f"{source}: size {size} bytes, manifest says {entry.size_bytes} (truncated or replaced)")
    if entry.crc32 is not None and not check_sha256:
        if crc32_parts([buffer])[0] != entry.crc32:
            raise CheckpointError(f"{source}: crc32 mismatch (corrupt file)")
    elif sha256_parts([buffer])[0] != entry.sha256:
        raise CheckpointError(f"{source}: sha256 mismatch (corrupt file)")
    return buffer


def read_checkpoint(
    store: Store, step: int, check_sha256: bool = False
) -> tuple[Manifest, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """(manifest, state.json content, role -> tensors) of ``step`` after verifying every file.

    Every file's size and CRC-32 are checked, or its sha256 with ``check_sha256``.
    Raises CheckpointError naming the first missing, truncated or corrupt file.
    """
    manifest = read_manifest(store, step)
    largest_first = sorted(range(len(manifest.files)), key=lambda i: -manifest.files[i].size_bytes)  # workers end together
    with ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
        futures = {i: pool.submit(read_verified, store, manifest.files[i], check_sha256) for i in largest_first}
    buffers = [futures[i].result() for i in range(len(manifest.files))]
    state: dict[str, Any] = {}
    groups: dict[str, dict[str, np.ndarray]] = {}
    for entry, buffer in zip(manifest.files, buffers):
        if entry.role == "state":
            state = json.loads(bytes(buffer))
            continue
        tensors, _ = safetensors_io.decode(buffer, f"{store.url}/{entry.path} ({entry.name})")
        group = groups.setdefault(entry.role, {})
        for name in tensors:
            if name in group:
                raise CheckpointError(f"{store.url}/{step_dir(step)}: tensor {name!r} appears in two {entry.role} files")
        group.update(tensors)
    return manifest, state, groups
