"""The checkpoint manifest: what a checkpoint is, written last.

Layout under a checkpoint root URL::

    blobs/sha256/<hex>               safetensors files, content-addressed, shared by steps
    step-000000000100/state.json     step, RNG states, sampler position, metrics, versions
    step-000000000100/MANIFEST.json  size, sha256 and CRC-32 of every file above; written last

A step without a parseable MANIFEST.json does not exist for readers.

Two checksums per file, for two jobs. The sha256 is the content address (a blob's
name) and is what `hfleet ckpt verify` and verified downloads check: it also stands
against deliberate tampering. Every load checks the size and the CRC-32 (zlib's
polynomial, computed with ISA-L at memory speed): that catches any flipped byte and
any truncation, at a small fraction of sha256's cost. A version-1 manifest (written
before the CRC was recorded) has no ``crc32`` field, and its files are checked by
sha256 on load.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from hybridfleet.errors import CheckpointError

FORMAT_NAME = "hybridfleet.checkpoint"
FORMAT_VERSION = 2  # 2 added FileEntry.crc32
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "MANIFEST.json"
STATE_NAME = "state.json"
ROLES = ("model", "optimizer", "tensors", "state")
_STEP_DIR = re.compile(r"^step-(\d{12})$")


def step_dir(step: int) -> str:
    """The folder name of checkpoint ``step``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int (got {step!r})")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a folder name made by `step_dir`, else None."""
    match = _STEP_DIR.match(name.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its logical name, where it lives, and how to verify it."""

    name: str
    path: str
    role: str
    size_bytes: int
    sha256: str
    crc32: str | None = None  # 8 hex digits; None in version-1 manifests


@dataclass
class Manifest:
    step: int
    framework: str | None
    created_s: float
    files: list[FileEntry]
    metrics: dict[str, float] = field(default_factory=dict)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """The manifest as UTF-8 JSON bytes."""
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, source: str) -> "Manifest":
        """Parse and validate a manifest; CheckpointError naming ``source`` and the problem."""
        try:
            raw: dict[str, Any] = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{source}: manifest is not valid JSON ({err})") from err
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{source}: not a {FORMAT_NAME} manifest")
        if raw.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(f"{source}: manifest version {raw.get('version')!r} is not supported (expected one of {READABLE_VERSIONS})")
        try:
            files = [FileEntry(**entry) for entry in raw["files"]]
            manifest = cls(
                step=int(raw["step"]),
                framework=raw.get("framework"),
                created_s=float(raw["created_s"]),
                files=files,
                metrics=dict(raw.get("metrics") or {}),
                version=int(raw["version"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{source}: manifest is missing or has a malformed field ({err})") from err
        for entry in files:
            if entry.role not in ROLES:
                raise CheckpointError(f"{source}: file {entry.name!r} has unknown role {entry.role!r}")
        return manifest

    def files_of(self, role: str) -> list[FileEntry]:
        """The entries with ``role``, in manifest order."""
        return [f for f in self.files if f.role == role]

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)
