"""Reading checkpoints back: listing steps, parsing manifests, verifying every byte."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.manifest import MANIFEST_NAME, FileEntry, Manifest, parse_step_dir, step_dir
from hybridfleet.errors import CheckpointError, StoreError
from hybridfleet.store import Store, sha256_parts
from hybridfleet.store.base import Buffer

READ_WORKERS = 2


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


def read_verified(store: Store, entry: FileEntry) -> Buffer:
    """The bytes of one manifest entry, checked against its size and sha256."""
    source = f"{store.url}/{entry.path} ({entry.name})"
    try:
        buffer = store.read_buffer(entry.path)
    except StoreError as err:
        raise CheckpointError(f"{source}: missing") from err
    digest, size = sha256_parts([buffer])
    if size != entry.size_bytes:
        raise CheckpointError(f"{source}: size {size} bytes, manifest says {entry.size_bytes} (truncated or replaced)")
    if digest != entry.sha256:
        raise CheckpointError(f"{source}: sha256 mismatch (corrupt file)")
    return buffer


def read_checkpoint(store: Store, step: int) -> tuple[Manifest, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """(manifest, state.json content, role -> tensors) of ``step`` after verifying every file.

    Raises CheckpointError naming the first missing, truncated or corrupt file.
    """
    manifest = read_manifest(store, step)
    with ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
        buffers = list(pool.map(lambda e: read_verified(store, e), manifest.files))
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
