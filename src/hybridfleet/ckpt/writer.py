"""Writing a `Snapshot` to a store: sharded safetensors blobs, state.json, then the manifest."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.manifest import MANIFEST_NAME, STATE_NAME, FileEntry, Manifest, step_dir
from hybridfleet.ckpt.snapshot import Snapshot
from hybridfleet.store import Store, blob_path, put_blob, sha256_parts

SHARD_BYTES = 512 << 20
# Tensors at least this large get a file of their own, so an unchanged tensor is an
# unchanged blob and is never uploaded again; smaller ones are packed into shards.
OWN_FILE_BYTES = 1 << 20
WRITE_WORKERS = 4


def plan_files(
    role: str, tensors: dict[str, np.ndarray], shard_bytes: int = SHARD_BYTES, own_file_bytes: int = OWN_FILE_BYTES
) -> list[tuple[str, dict[str, np.ndarray]]]:
    """Group ``tensors`` into files: one per large tensor, small ones packed up to ``shard_bytes``."""
    if shard_bytes <= 0 or own_file_bytes <= 0:
        raise ValueError(f"shard_bytes and own_file_bytes must be > 0 (got {shard_bytes}, {own_file_bytes})")
    groups: list[dict[str, np.ndarray]] = []
    packed: dict[str, np.ndarray] = {}
    packed_bytes = 0
    for name in sorted(tensors):
        arr = tensors[name]
        if arr.nbytes >= own_file_bytes:
            groups.append({name: arr})
            continue
        if packed and packed_bytes + arr.nbytes > shard_bytes:
            groups.append(packed)
            packed, packed_bytes = {}, 0
        packed[name] = arr
        packed_bytes += arr.nbytes
    if packed or not groups:
        groups.append(packed)
    total = len(groups)
    return [(f"{role}-{i + 1:05d}-of-{total:05d}.safetensors", g) for i, g in enumerate(groups)]


def _write_file(store: Store, role: str, name: str, tensors: dict[str, np.ndarray]) -> tuple[FileEntry, int]:
    parts = safetensors_io.encode(tensors, metadata={"role": role})
    digest, size = sha256_parts(parts)
    uploaded = put_blob(store, parts, digest)
    return FileEntry(name=name, path=blob_path(digest), role=role, size_bytes=size, sha256=digest), uploaded


def write_snapshot(
    store: Store, snapshot: Snapshot, shard_bytes: int = SHARD_BYTES, own_file_bytes: int = OWN_FILE_BYTES
) -> tuple[Manifest, int]:
    """Write ``snapshot`` under ``store``; returns (manifest, payload bytes uploaded).

    state.json is written first, then the tensor files as content-addressed blobs
    (hashed once, uploaded only when absent), then MANIFEST.json. An existing manifest for the same
    step is removed first, so readers never see a mix of two saves.
    """
    folder = step_dir(snapshot.step)
    store.rm(f"{folder}/{MANIFEST_NAME}")
    # state.json goes first: its folder marks a save in flight, which keeps `gc` off new blobs.
    state_bytes = json.dumps(snapshot.state, sort_keys=True).encode("utf-8")
    state_path = f"{folder}/{STATE_NAME}"
    store.put_bytes(state_path, state_bytes)
    digest, size = sha256_parts([state_bytes])
    state_entry = FileEntry(name=STATE_NAME, path=state_path, role="state", size_bytes=size, sha256=digest)

    jobs = [(role, name, group) for role, tensors in snapshot.groups.items() for name, group in plan_files(role, tensors, shard_bytes, own_file_bytes)]
    with ThreadPoolExecutor(max_workers=max(1, min(WRITE_WORKERS, len(jobs)))) as pool:
        results = list(pool.map(lambda job: _write_file(store, *job), jobs))
    entries = [entry for entry, _ in results] + [state_entry]
    uploaded = sum(n for _, n in results) + len(state_bytes)

    manifest = Manifest(step=snapshot.step, framework=snapshot.framework, created_s=time.time(), files=entries, metrics=snapshot.metrics)
    store.put_bytes(f"{folder}/{MANIFEST_NAME}", manifest.to_json())
    return manifest, uploaded
