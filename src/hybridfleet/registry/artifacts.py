"""Model artifacts in the registry's store: content-addressed, verified on every read.

Layout under the registry store root (file:// or s3://)::

    blobs/sha256/<hex>                        every file of every version, by content
    models/<namespace>/<name>/v<N>/MANIFEST-<id>.json   a checkpoint manifest whose entries all name blobs

Registering a checkpoint copies only the blobs the store lacks, so a checkpoint already in
the same store (or sharing tensors with an earlier version) copies no tensor bytes. A blob
already present is reused only after its sha256 matches its name; a copy that does not
(a same-size file planted under a digest, a corrupted upload) is rewritten from the
source and logged (``blob_rewritten``), never referenced by one more version. A checkpoint
in the store's own S3 bucket is copied by the S3 server (CopyObject / UploadPartCopy) after
one verification read. A
version's manifest sha256 is kept in the database; a pull checks it and every file's
sha256 before anything is served.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.ckpt.manifest import FileEntry, Manifest
from hybridfleet.ckpt.reader import list_steps, read_manifest, read_verified
from hybridfleet.errors import CheckpointError, RegistryError, StoreError
from hybridfleet.frameworks import import_framework
from hybridfleet.frameworks.layout import FRAMEWORK_NAMES, convert_state
from hybridfleet.obs.log import get_logger
from hybridfleet.store import Store, blob_path, open_store, prepare_blob_copy, sha256_parts

log = get_logger("registry.artifacts")

COPY_WORKERS = 4  # files copied at once (each S3 one with its own parts in flight), as `s3fs.put` does
FORMATS = {"safetensors": "model.safetensors", "pt": "model.pt", "pdparams": "model.pdparams"}


@dataclass
class Registered:
    """What registering a checkpoint wrote."""

    manifest: Manifest
    manifest_path: str
    manifest_sha256: str
    copied_bytes: int  # payload bytes the store gained
    server_copied_bytes: int = 0  # of those, bytes the storage service copied itself (same S3 bucket)


def version_path(namespace: str, name: str, version: int) -> str:
    """A new store path for a version's manifest: unique per registration attempt, so two
    registrations racing for the same number never touch each other's file."""
    return f"models/{namespace}/{name}/v{version}/MANIFEST-{uuid.uuid4().hex[:12]}.json"


def newest_step(store: Store) -> int:
    """The newest step of a checkpoint root that has a readable manifest."""
    for step in reversed(list_steps(store)):
        try:
            read_manifest(store, step)
            return step
        except CheckpointError:
            continue
    raise CheckpointError(f"{store.url}: no checkpoint with a manifest")


def source_manifest(source: Store, step: int | None) -> Manifest:
    """The manifest of ``step`` (default: newest) of a checkpoint root."""
    return read_manifest(source, newest_step(source) if step is None else step)


def copy_into_store(source: Store, manifest: Manifest, target: Store, manifest_path: str) -> Registered:
    """Copy ``manifest``'s files into ``target`` as blobs (only those absent), then write its manifest.

    A blob already in ``target`` counts as present only when its sha256 matches (a copy that
    does not is rewritten and logged). Each copied file streams from ``source`` to ``target`` once (no separate hashing pass;
    ``COPY_WORKERS`` files at a time, S3 targets get parallel multipart uploads) and is checked against its size and CRC-32
    (sha256 without one) on the way; a file that fails is never published as a blob, and
    nothing is written under ``manifest_path`` until every blob is in place. A checkpoint in the
    same S3 bucket as ``target`` is copied server-side after one verification read of each file
    (`hybridfleet.store.s3_copy`): no tensor byte is written through this process, and every
    file is read and checked before the first is copied, so a corrupt file leaves no blob.
    """
    if target.exists(manifest_path):
        raise RegistryError(f"{target.url}/{manifest_path} exists already; versions are immutable")

    def prepare(entry: FileEntry) -> tuple[FileEntry, Callable[[], int] | None]:
        blob = blob_path(entry.sha256)
        copy = None
        if not _sound_blob(target, blob, entry):
            try:
                copy = prepare_blob_copy(source, entry.path, target, entry.sha256, entry.size_bytes, entry.crc32)
            except StoreError as err:
                raise CheckpointError(f"{entry.name}: {err}") from err
        return FileEntry(name=entry.name, path=blob, role=entry.role, size_bytes=entry.size_bytes,
                         sha256=entry.sha256, crc32=entry.crc32), copy  # fmt: skip

    def run(entry: FileEntry, copy: Callable[[], int] | None) -> tuple[FileEntry, int]:
        try:
            return entry, copy() if copy is not None else 0
        except StoreError as err:
            raise CheckpointError(f"{entry.name}: {err}") from err

    # every file is prepared (for server-side copies: read and checked) before any is copied
    with ThreadPoolExecutor(COPY_WORKERS, thread_name_prefix="hfleet-register") as pool:
        prepared = [f.result() for f in [pool.submit(prepare, entry) for entry in manifest.files]]
        futures = [pool.submit(run, entry, copy) for entry, copy in prepared]
    done = [f.result() for f in futures]  # the first failure in manifest order is raised
    entries = [entry for entry, _ in done]
    copied = sum(n for _, n in done)
    in_store = copied if target.can_copy_from(source) else 0
    out = Manifest(step=manifest.step, framework=manifest.framework, created_s=manifest.created_s,
                   files=entries, metrics=dict(manifest.metrics))  # fmt: skip
    data = out.to_json()
    target.put_bytes(manifest_path, data)
    return Registered(out, manifest_path, hashlib.sha256(data).hexdigest(), copied, in_store)


def _sound_blob(store: Store, blob: str, entry: FileEntry) -> bool:
    """True when ``blob`` is in ``store`` with ``entry``'s size and sha256; a present copy that is not is logged."""
    try:
        if not store.exists(blob):
            return False
        size = store.size(blob)
        digest = sha256_parts([store.read_buffer(blob)])[0] if size == entry.size_bytes else None
    except StoreError:
        return False  # removed meanwhile: write it
    if digest == entry.sha256:
        return True
    log.warning("blob_rewritten", url=store.url, path=blob, file=entry.name,
                reason=f"stored copy has {'sha256 ' + str(digest) if digest else f'{size} bytes'}, not its name's content")
    return False


def same_tensors(store: Store, manifest_path: str, manifest: Manifest) -> bool:
    """True when the version manifest at ``manifest_path`` names exactly the tensor files of ``manifest``
    (same names, roles and sha256; state.json aside). False when it cannot be read."""
    try:
        other = Manifest.from_json(store.get_bytes(manifest_path), f"{store.url}/{manifest_path}")
    except (StoreError, CheckpointError):
        return False

    def tensors(m: Manifest) -> set[tuple[str, str, str]]:
        return {(f.role, f.name, f.sha256) for f in m.files if f.role != "state"}

    return tensors(other) == tensors(manifest)


def read_version(store: Store, manifest_path: str, manifest_sha256: str) -> tuple[Manifest, dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """(manifest, state, role -> tensors) of a registered version, every byte verified by sha256.

    CheckpointError names the missing or corrupt file; nothing is returned from a version
    that does not verify completely.
    """
    source = f"{store.url}/{manifest_path}"
    try:
        data = store.get_bytes(manifest_path)
    except StoreError as err:
        raise CheckpointError(f"{source}: the version's manifest is missing from the store") from err
    if hashlib.sha256(data).hexdigest() != manifest_sha256:
        raise CheckpointError(f"{source}: manifest sha256 differs from the registered one (replaced or corrupt)")
    manifest = Manifest.from_json(data, source)
    state: dict[str, Any] = {}
    groups: dict[str, dict[str, np.ndarray]] = {}
    for entry in manifest.files:
        buffer = read_verified(store, entry, check_sha256=True)
        if entry.role == "state":
            state = json.loads(bytes(buffer))
            continue
        tensors, _ = safetensors_io.decode(buffer, f"{store.url}/{entry.path} ({entry.name})")
        groups.setdefault(entry.role, {}).update(tensors)
    return manifest, state, groups


def pull_framework(info: Any, framework: str | None) -> str:
    """The framework a pull writes for: the one asked for, else the version's own."""
    if framework:
        return framework
    if not info.framework:
        raise RegistryError(f"{info.name} v{info.version} records no framework; pass --framework torch or paddle")
    return info.framework


def export_weights(manifest: Manifest, state: dict[str, Any], groups: dict[str, dict[str, np.ndarray]],
                   framework: str, fmt: str, out_dir: str | Path) -> Path:  # fmt: skip
    """Write the model weights laid out for ``framework`` as one ``fmt`` file under ``out_dir``.

    torch <-> paddle conversion uses the layer layouts recorded at save time
    (`hybridfleet.frameworks.layout`); ``pt`` needs torch and ``pdparams`` needs paddle.
    """
    if framework not in FRAMEWORK_NAMES:
        raise RegistryError(f"--framework must be one of {FRAMEWORK_NAMES} (got {framework!r})")
    if fmt not in FORMATS:
        raise RegistryError(f"--format must be one of {sorted(FORMATS)} (got {fmt!r})")
    if (fmt, framework) in (("pt", "paddle"), ("pdparams", "torch")):
        raise RegistryError(f"--format {fmt} is a {'torch' if fmt == 'pt' else 'paddle'} file; use --format safetensors "
                            f"or --format {'pdparams' if fmt == 'pt' else 'pt'} for --framework {framework}")
    if "model" not in groups:
        raise CheckpointError("this version holds raw tensors, not a framework model; nothing to export")
    src = manifest.framework or framework
    weights, _ = convert_state(groups["model"], state.get("layouts", {}), src, framework)
    target = open_store(str(Path(out_dir).expanduser().resolve()))
    if fmt == "safetensors":
        target.put_parts(FORMATS[fmt], safetensors_io.encode(weights, metadata={"framework": framework}))
    elif fmt == "pt":
        import torch

        buf = io.BytesIO()
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}, buf)
        target.put_bytes(FORMATS[fmt], buf.getvalue())
    else:
        paddle = import_framework("paddle")

        buf = io.BytesIO()
        paddle.save({k: paddle.to_tensor(np.ascontiguousarray(v)) for k, v in weights.items()}, buf)
        target.put_bytes(FORMATS[fmt], buf.getvalue())
    return Path(out_dir).expanduser().resolve() / FORMATS[fmt]
