"""`hfleet env lock`: the environment fingerprint, written as ``hfleet.lock.json``.

A lock records the Python version, platform, glibc, each installed framework
with its CUDA/cuDNN, the GPU driver (null without one), every installed
distribution with its version, and the container image when known. Its
``hash`` (sha256, hex) covers only what decides whether training behaves the
same: the Python minor version, the frameworks with their CUDA/cuDNN, and the
sorted distributions; never the hostname, the CPU or the time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from hybridfleet.env import host
from hybridfleet.env.probe import FRAMEWORKS, framework_installed, probe_framework
from hybridfleet.errors import FrameworkMissingError, HfleetError

LOCK_SCHEMA = 1
DEFAULT_LOCK_FILE = "hfleet.lock.json"
REQUIRED_KEYS = ("schema", "python", "platform", "frameworks", "distributions", "hash")


class LockFileError(HfleetError, ValueError):
    """A lock file is missing, truncated, malformed or edited after it was written."""

    kind = "lock"


def normalize_name(name: str) -> str:
    """A distribution name in PEP 503 form (``Foo_Bar`` -> ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> dict[str, str]:
    """Every installed distribution as ``{normalized name: version}``, sorted by name."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.setdefault(normalize_name(name), dist.version)
    return dict(sorted(found.items()))


def local_distributions() -> list[str]:
    """Names of distributions installed from a local directory (editable or ``pip install .``)."""
    names = []
    for dist in importlib.metadata.distributions():
        direct = dist.read_text("direct_url.json")
        if direct and dist.metadata and dist.metadata["Name"]:
            try:
                if "dir_info" in json.loads(direct):
                    names.append(normalize_name(dist.metadata["Name"]))
            except json.JSONDecodeError:
                continue
    return sorted(set(names))


def parse_image_ref(ref: str | None) -> dict[str, str | None] | None:
    """``repo:tag`` or ``repo@sha256:...`` as ``{"ref", "digest"}``; None for no reference."""
    if not ref:
        return None
    digest = ref.split("@", 1)[1] if "@" in ref else None
    if digest is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ValueError(f"image: digest must be sha256:<64 hex> (got {digest!r} in {ref!r})")
    return {"ref": ref, "digest": digest}


def lock_hash(lock: dict[str, Any]) -> str:
    """The sha256 (hex) over python minor, frameworks (version, CUDA, cuDNN) and distributions."""
    frameworks = {
        name: {k: facts.get(k) for k in ("version", "cuda", "cudnn")}
        for name, facts in sorted(lock.get("frameworks", {}).items())
    }
    content = {
        "python_minor": lock["python"]["minor"],
        "frameworks": frameworks,
        "distributions": sorted(lock.get("distributions", {}).items()),
    }
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def make_lock(image: str | None = None) -> dict[str, Any]:
    """This machine's lock (hash filled in); ``image`` or $HFLEET_IMAGE names the container image."""
    image_info = parse_image_ref(image or os.environ.get("HFLEET_IMAGE"))
    py = host.python_facts()
    cpu = host.cpu_facts()
    frameworks: dict[str, Any] = {}
    for name in sorted(FRAMEWORKS):
        if not framework_installed(name):
            continue
        try:
            facts = probe_framework(name)
        except FrameworkMissingError:
            continue
        frameworks[name] = {"version": facts["version"], "cuda": facts["cuda"], "cudnn": facts["cudnn"],
                            "nccl": facts["nccl"]}
    lock: dict[str, Any] = {
        "schema": LOCK_SCHEMA,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"hostname": host.hostname(), "cpu_model": cpu["model"], "cpu_count": cpu["logical_cores"]},
        "platform": host.platform_facts(),
        "python": {k: py[k] for k in ("version", "minor", "implementation")},
        "frameworks": frameworks,
        "gpu_driver": host.nvidia_gpus()["driver"],
        "distributions": installed_distributions(),
        "local_distributions": local_distributions(),
        "image": image_info,
    }
    lock["hash"] = lock_hash(lock)
    return lock


def write_lock(lock: dict[str, Any], path: str | Path) -> Path:
    """Write ``lock`` (hash recomputed) as indented JSON; return the path."""
    out = Path(path)
    lock = {**lock, "hash": lock_hash(lock)}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    tmp.replace(out)  # never leave a half-written lock behind
    return out


def read_lock(path: str | Path) -> dict[str, Any]:
    """Read and verify a lock file; LockFileError names the file, the problem and the fix."""
    p = Path(path)
    fix = f"regenerate it with `hfleet env lock -o {p}`"
    if not p.is_file():
        raise LockFileError(f"{p}: no such lock file; create one with `hfleet env lock -o {p}`",
                            hint=f"check the path, or write the lock first with `hfleet env lock -o {p}`")
    try:
        lock = json.loads(p.read_text())
    except UnicodeDecodeError:
        raise LockFileError(f"{p}: not a lock file (not UTF-8 text); {fix}") from None
    except json.JSONDecodeError as err:
        raise LockFileError(
            f"{p}: not a valid lock file (truncated or malformed JSON at line {err.lineno}, "
            f"column {err.colno}: {err.msg}); {fix}"
        ) from None
    if not isinstance(lock, dict):
        raise LockFileError(f"{p}: a lock file is a JSON object (got {type(lock).__name__}); {fix}")
    missing = [k for k in REQUIRED_KEYS if k not in lock]
    if missing:
        raise LockFileError(f"{p}: missing key(s) {', '.join(missing)}; {fix}")
    if lock["schema"] != LOCK_SCHEMA:
        raise LockFileError(f"{p}: lock schema {lock['schema']!r} is not supported (expected {LOCK_SCHEMA}); {fix}")
    try:
        expected = lock_hash(lock)
    except (KeyError, TypeError, AttributeError) as err:
        raise LockFileError(f"{p}: malformed content ({type(err).__name__}: {err}); {fix}") from None
    if lock["hash"] != expected:
        raise LockFileError(f"{p}: hash {str(lock['hash'])[:12]}... does not match the content "
                            f"({expected[:12]}...); the file was edited after it was written; {fix}")
    return lock
