"""Importing public models: ``hf:ORG/NAME@REV`` and ``modelscope:ORG/NAME@REV`` into the registry.

The real `huggingface_hub.snapshot_download` / `modelscope` `snapshot_download` fetch the
snapshot (or find it in their cache; with ``offline`` nothing touches the network). The
import is pinned to the snapshot the library resolved (Hugging Face names snapshots by
commit; ModelScope by revision), verified complete, then converted:

- Hugging Face: every file of the snapshot must resolve to its cache blob, and each blob's
  name is its content address (sha256 for LFS files, the git blob sha1 otherwise), which is
  checked; a partial download (``*.incomplete`` blob, broken link) is refused. Online, the
  file list and sizes are also compared with the hub's metadata for that commit.
- ModelScope: every file must be present and readable; sizes and sha256 are recorded.

Every file's size and sha256 go into the version's lineage. Weights in safetensors,
``.pdparams`` or ``.pt``/``.bin`` (loaded without pickle code execution: torch's
``weights_only``) become a registry version of framework torch (safetensors, pt) or paddle
(pdparams). Hub files carry no layer layouts, so a pull converts them only within their framework.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridfleet.errors import CheckpointError, RegistryError, RegistryNotFoundError
from hybridfleet.frameworks import import_framework
from hybridfleet.obs.log import get_logger

log = get_logger("registry.hub")
_SOURCE = re.compile(r"(hf|modelscope):([A-Za-z0-9][\w.\-]*/[\w.\-]+)(@([\w.\-/]+))?")  # fullmatch
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
WEIGHT_SUFFIXES = (".safetensors", ".pdparams", ".pt", ".bin")


@dataclass(frozen=True)
class HubSource:
    hub: str
    repo: str
    revision: str | None

    def __str__(self) -> str:
        return f"{self.hub}:{self.repo}" + (f"@{self.revision}" if self.revision else "")


def parse_source(text: str) -> HubSource:
    """``hf:ORG/NAME[@REV]`` or ``modelscope:ORG/NAME[@REV]``."""
    match = _SOURCE.fullmatch(text or "")
    if not match:
        raise RegistryError(f"hub source {text!r}: expected hf:ORG/NAME@REV or modelscope:ORG/NAME@REV")
    parts = match.group(2).split("/") + (match.group(4) or "").split("/")
    if any(part in (".", "..") or ".." in part for part in parts if part) or (match.group(4) or "x").strip("/") != (match.group(4) or "x"):
        raise RegistryError(f"hub source {text!r}: ORG, NAME and REV may not contain '..' or empty path parts")
    return HubSource(match.group(1), match.group(2), match.group(4))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    digest.update(path.read_bytes())
    return digest.hexdigest()


def _files(snapshot: Path) -> list[Path]:
    return sorted(p for p in snapshot.rglob("*") if not any(part.startswith(".") for part in p.relative_to(snapshot).parts)
                  and (p.is_file() or p.is_symlink()))  # fmt: skip


def download(source: HubSource, cache_dir: str | None, offline: bool) -> Path:
    """The snapshot folder the hub library resolves (downloading unless ``offline``)."""
    try:
        if source.hub == "hf":
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import (
                LocalEntryNotFoundError,
                RevisionNotFoundError,
            )

            missing: tuple = (LocalEntryNotFoundError, RevisionNotFoundError)
            return Path(snapshot_download(source.repo, revision=source.revision, cache_dir=cache_dir, local_files_only=offline))
        from modelscope.hub.snapshot_download import snapshot_download as ms_download
        from modelscope_hub.errors import CacheNotFound

        missing = (CacheNotFound,)
        return Path(ms_download(source.repo, revision=source.revision, cache_dir=cache_dir, local_files_only=offline))
    except ImportError as err:
        extra = "huggingface_hub" if source.hub == "hf" else "modelscope"
        raise RegistryError(f"importing from {source.hub} needs {extra}: pip install 'hybridfleet[hub]'") from err
    except Exception as err:
        if "missing" in locals() and isinstance(err, missing):
            raise RegistryNotFoundError(f"{source}: not found{' in the local hub cache (offline)' if offline else ''}: {err}") from err
        raise


def verify_snapshot(source: HubSource, snapshot: Path, offline: bool) -> list[dict[str, Any]]:
    """Every file's path, size and sha256, after checking the snapshot is complete (see module doc)."""
    files = _files(snapshot)
    if not files:
        raise CheckpointError(f"{source}: snapshot {snapshot} is empty")
    out = []
    for path in files:
        rel = str(path.relative_to(snapshot))
        if not path.exists():
            raise CheckpointError(f"{source}: {rel} is missing from the snapshot (incomplete download)")
        sha256 = _sha256(path)
        if source.hub == "hf" and path.is_symlink():
            etag = Path(os.readlink(path)).name
            if _HEX64.fullmatch(etag) and etag != sha256:
                raise CheckpointError(f"{source}: {rel} does not match its content address (sha256 {etag[:12]}...): corrupt")
            if _HEX40.fullmatch(etag) and etag != _git_blob_sha1(path):
                raise CheckpointError(f"{source}: {rel} does not match its git blob id {etag[:12]}...: corrupt")
        out.append({"path": rel, "size_bytes": path.stat().st_size, "sha256": sha256})
    if source.hub == "hf":
        blobs = snapshot.parent.parent / "blobs"
        partial = sorted(p.name for p in blobs.glob("*.incomplete")) if blobs.is_dir() else []
        if partial:
            raise CheckpointError(f"{source}: the hub cache holds unfinished downloads ({', '.join(partial)[:200]}); retry online")
        if not offline:
            _compare_with_hub(source, snapshot.name, out)
    return out


def _compare_with_hub(source: HubSource, commit: str, files: list[dict[str, Any]]) -> None:
    """Online: the hub's file list and sizes for ``commit`` must equal the snapshot's."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(source.repo, revision=commit, files_metadata=True)
    expected = {s.rfilename: s.size for s in info.siblings or []}
    have = {f["path"]: f["size_bytes"] for f in files}
    if expected and expected != have:
        missing = sorted(set(expected) - set(have))
        raise CheckpointError(f"{source}@{commit}: snapshot differs from the hub's file list (missing {missing[:5]})")


def load_weights(snapshot: Path, files: list[dict[str, Any]]) -> tuple[str, dict[str, np.ndarray]]:
    """(framework, tensors) of the snapshot's weight files (safetensors preferred)."""
    by_suffix: dict[str, list[Path]] = {}
    for f in files:
        suffix = Path(f["path"]).suffix
        if suffix in WEIGHT_SUFFIXES:
            by_suffix.setdefault(suffix, []).append(snapshot / f["path"])
    weights: dict[str, np.ndarray] = {}
    if ".safetensors" in by_suffix:
        from safetensors.numpy import load_file

        for path in by_suffix[".safetensors"]:
            weights.update(load_file(str(path)))
        return "torch", weights
    if ".pdparams" in by_suffix:
        paddle = import_framework("paddle")

        for path in by_suffix[".pdparams"]:
            weights.update({k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in paddle.load(str(path)).items()})
        return "paddle", weights
    if ".pt" in by_suffix or ".bin" in by_suffix:
        import torch

        for path in by_suffix.get(".pt", []) + by_suffix.get(".bin", []):
            state = torch.load(str(path), map_location="cpu", weights_only=True)
            weights.update({k: v.detach().cpu().numpy() for k, v in state.items() if hasattr(v, "detach")})
        return "torch", weights
    raise RegistryError(f"no weights in safetensors, pdparams or pt/bin among {[f['path'] for f in files][:10]}")


def import_model(reg: Any, source_text: str, name: str | None = None, cache_dir: str | None = None,
                 offline: bool = False, description: str = "") -> Any:  # fmt: skip
    """Import a hub model as the next version of ``name`` (default: ``hub/<NAME>``); returns its VersionInfo.

    Checks come first (permission, source, download, completeness, weights); nothing is
    registered unless all pass.
    """
    from hybridfleet.ckpt.checkpoint import write_checkpoint
    from hybridfleet.ckpt.snapshot import Snapshot
    from hybridfleet.registry.refs import parse_name
    from hybridfleet.store import open_store

    source = parse_source(source_text)
    target = name or f"hub/{source.repo.split('/')[-1].lower()}"
    namespace, short = parse_name(target)
    if hasattr(reg, "actor"):  # a local registry checks before downloading; a server checks on register
        reg.actor.require("writer", namespace, short, "import a model")
    snapshot = download(source, cache_dir, offline)
    files = verify_snapshot(source, snapshot, offline)
    framework, weights = load_weights(snapshot, files)
    pinned = snapshot.name
    hub = {"source": str(source), "hub": source.hub, "repo": source.repo, "requested_revision": source.revision,
           "resolved_revision": pinned, "files": files}  # fmt: skip
    snap = Snapshot(step=0, framework=framework, groups={"model": weights}, state={"layouts": {}, "hub": hub})
    details = dict(description=description or f"imported from {source}",
                   tags={"hub": source.hub, "repo": source.repo, "revision": pinned},
                   lineage={"hub": hub, "framework": framework})  # fmt: skip
    if hasattr(reg, "engine"):  # the registry's own database: register from a local folder
        work = Path(tempfile.mkdtemp(prefix="hfleet-hub-"))
        try:
            write_checkpoint(open_store(str(work)), snap)
            info = reg.register(f"{namespace}/{short}", str(work), **details)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    else:  # a server reads only its artifact store: stage the checkpoint there, register it, drop the staging copy
        store = open_store(reg.store_url)
        staging = f"imports/{uuid.uuid4().hex}"
        staged_url = f"{store.url.rstrip('/')}/{staging}"
        try:
            write_checkpoint(open_store(staged_url), snap)
            info = reg.register(f"{namespace}/{short}", staged_url, **details)
        finally:
            store.rm(staging, recursive=True)
    log.info("hub_imported", source=str(source), revision=pinned, name=info.name, version=info.version)
    return info
