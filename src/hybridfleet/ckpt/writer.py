"""Writing a `Snapshot` to a store: sharded safetensors blobs, state.json, then the manifest."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.manifest import MANIFEST_NAME, STATE_NAME, FileEntry, Manifest, step_dir
from hybridfleet.ckpt.snapshot import Snapshot
from hybridfleet.store import Store, blob_path, file_digests, put_blob

SHARD_BYTES = 512 << 20
# Tensors at least this large get a file of their own, so an unchanged tensor is an
# unchanged blob and is never uploaded again; smaller ones are packed into shards.
OWN_FILE_BYTES = 1 << 20
HASH_WORKERS = 2  # sha256 (+ CRC-32) is CPU-bound: one thread per core
WRITE_WORKERS = 4  # writes mostly wait on the disk or the network


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


def _write_files(store: Store, jobs: list[tuple[str, str, dict[str, np.ndarray]]]) -> list[tuple[FileEntry, int]]:
    """Hash and upload files as a pipeline: file i is written while file i+1 is hashed."""
    encoded = [(role, name, safetensors_io.encode(tensors, metadata={"role": role})) for role, name, tensors in jobs]
    with ThreadPoolExecutor(HASH_WORKERS) as hashers, ThreadPoolExecutor(WRITE_WORKERS) as writers:
        digests = [hashers.submit(file_digests, parts) for _, _, parts in encoded]
        uploads = []
        for (role, name, parts), digest_future in zip(encoded, digests):
            digest, crc, size = digest_future.result()
            entry = FileEntry(name=name, path=blob_path(digest), role=role, size_bytes=size, sha256=digest, crc32=crc)
            uploads.append((entry, writers.submit(put_blob, store, parts, digest, crc)))
        return [(entry, future.result()) for entry, future in uploads]


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
    digest, crc, size = file_digests([state_bytes])
    state_entry = FileEntry(name=STATE_NAME, path=state_path, role="state", size_bytes=size, sha256=digest, crc32=crc)

    jobs = [(role, name, group) for role, tensors in snapshot.groups.items() for name, group in plan_files(role, tensors, shard_bytes, own_file_bytes)]
    results = _write_files(store, jobs)
    entries = [entry for entry, _ in results] + [state_entry]
    uploaded = sum(n for _, n in results) + len(state_bytes)

    manifest = Manifest(step=snapshot.step, framework=snapshot.framework, created_s=time.time(), files=entries, metrics=snapshot.metrics)
    store.put_bytes(f"{folder}/{MANIFEST_NAME}", manifest.to_json())
    return manifest, uploaded
