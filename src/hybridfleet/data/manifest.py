"""The manifest of a packed dataset: schema, shards with row counts and sha256, written last.

A dataset is a folder (or object prefix) holding ``shard-00000.arrow`` ... and
``manifest.json``. The manifest is written after every shard, so a dataset without
one does not exist yet; its own sha256 (`DatasetManifest.digest`) names the exact
rows a run trained on without the rows leaving the site.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from hybridfleet.errors import DataError
from hybridfleet.store import Store

FORMAT = "hybridfleet-dataset/1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    """One Arrow IPC file of the dataset."""

    name: str
    rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ColumnInfo:
    """A column: Arrow type as text, numpy dtype and per-row shape for tensor columns."""

    name: str
    arrow_type: str
    dtype: str | None = None
    shape: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DatasetManifest:
    """What a packed dataset holds; `digest` is the sha256 of its canonical JSON."""

    columns: list[ColumnInfo]
    shards: list[ShardInfo]
    site: str | None = None
    source: str = ""
    format: str = FORMAT

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1) + "\n"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str, where: str = "manifest.json") -> "DatasetManifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise DataError(f"{where}: format {raw.get('format')!r} is not {FORMAT!r}")
            return cls(columns=[ColumnInfo(**c) for c in raw["columns"]],
                       shards=[ShardInfo(**s) for s in raw["shards"]],
                       site=raw.get("site"), source=raw.get("source", ""), format=raw["format"])
        except DataError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError(f"{where} is not a dataset manifest: {type(err).__name__}: {err}") from None


def read_manifest(store: Store) -> DatasetManifest:
    """The manifest at the root of ``store``; DataError when there is none (not packed, or half-written)."""
    if not store.exists(MANIFEST):
        raise DataError(f"{store.url} has no {MANIFEST}: not a packed dataset, or its packing did not finish "
                        f"(pack it with `hfleet data pack SRC {store.url}`)")
    return DatasetManifest.from_json(store.get_bytes(MANIFEST).decode(), f"{store.url}/{MANIFEST}")
