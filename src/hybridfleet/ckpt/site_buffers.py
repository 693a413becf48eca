"""Each site's own buffers of a job trained with ``ps.buffers: local`` (FedBN).

Under ``local`` every site keeps its BatchNorm statistics; the job's model (saved by global
rank 0) carries rank 0's site's. So that every site's model can be served, the first
worker of each site writes its buffers at the end of the run to
``<model root>/site_buffers/<site>.safetensors``, and ``MODEL.json`` lists them under
``site_buffers`` (file, sha256, step). To serve site S: load the model's final checkpoint,
then ``model.load_state_dict(read_site_buffers(root, S), strict=False)`` (torch) or
``model.set_state_dict(...)`` (paddle): the parameters are the job's, the statistics S's.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from hybridfleet.ckpt import safetensors_io
from hybridfleet.errors import CheckpointError
from hybridfleet.store import Store, open_store

SITE_BUFFERS_DIR = "site_buffers"
_SITE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _path(site: str) -> str:
    if not isinstance(site, str) or not _SITE.match(site):
        raise CheckpointError(f"site buffers: {site!r} is not a site name")
    return f"{SITE_BUFFERS_DIR}/{site}.safetensors"


def save_site_buffers(root: str | Store, site: str, step: int, buffers: dict[str, np.ndarray]) -> str:
    """Write ``site``'s buffers (name -> array) at ``step``; returns the file's path under ``root``."""
    path = _path(site)
    open_store(root).put_parts(path, safetensors_io.encode(buffers, {"site": site, "step": str(step)}))
    return path


def site_buffers_index(root: str | Store) -> dict[str, dict]:
    """``{site: {"file", "sha256", "step"}}`` of every site's saved buffers (empty when none)."""
    store = open_store(root)
    out = {}
    for name in store.ls(SITE_BUFFERS_DIR):
        base = name.rsplit("/", 1)[-1]
        if not base.endswith(".safetensors"):
            continue
        data = store.get_bytes(f"{SITE_BUFFERS_DIR}/{base}")
        _, meta = safetensors_io.decode(data, base)
        out[base.removesuffix(".safetensors")] = {"file": f"{SITE_BUFFERS_DIR}/{base}",
                                                  "sha256": hashlib.sha256(data).hexdigest(),
                                                  "step": int(meta.get("step", -1))}
    return out


def read_site_buffers(root: str | Store, site: str) -> dict[str, np.ndarray]:
    """``site``'s buffers; CheckpointError naming the sites that have some when it has none."""
    store = open_store(root)
    path = _path(site)
    if not store.exists(path):
        known = ", ".join(site_buffers_index(store)) or "none"
        raise CheckpointError(f"{store.url}: no buffers of site {site!r} (sites with their own: {known})")
    tensors, _ = safetensors_io.decode(store.get_bytes(path), path)
    return tensors
