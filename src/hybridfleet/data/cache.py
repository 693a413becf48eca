"""A site's shard cache: shards fetched from a remote store into a local folder under a
byte budget, verified on arrival, published atomically, shared by the site's processes.

Rules, each tested:
- an entry is content-addressed by its sha256 and checked against it on arrival; a
  partial download is never visible under its final name (``download_verified``
  writes ``.part`` and renames);
- the budget counts published and in-flight entries; before a fetch, least-recently
  used entries are evicted, never a pinned one and never one without a remote copy; a
  shard larger than the whole budget is refused with both sizes;
- two processes asking for the same shard download it once (a lock file per entry),
  and the index is read-modified-written under a lock of its own (``fcntl.flock``);
- the location is the caller's (``HFLEET_DATA_CACHE`` or the project's ``.hfleet/cache/data``),
  never a fixed /tmp path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from hybridfleet.errors import DataError, StoreError
from hybridfleet.paths import state_dir
from hybridfleet.store import Store, download_verified

INDEX = "index.json"


def default_cache_dir() -> Path:
    """``HFLEET_DATA_CACHE``, else the project's ``.hfleet/cache/data`` (`hybridfleet.paths`)."""
    if os.environ.get("HFLEET_DATA_CACHE"):
        return Path(os.environ["HFLEET_DATA_CACHE"])
    return state_dir() / "cache" / "data"


def default_budget_bytes(path: Path) -> int:
    """``HFLEET_DATA_CACHE_BYTES``, else half the free space where the cache lives."""
    if os.environ.get("HFLEET_DATA_CACHE_BYTES"):
        return int(os.environ["HFLEET_DATA_CACHE_BYTES"])
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free // 2


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    evictions: int = 0


@contextlib.contextmanager
def _flock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class SiteCache:
    """Local copies of remote shards under ``budget_bytes``; see the module docstring for the rules."""

    def __init__(self, path: str | os.PathLike[str] | None = None, budget_bytes: int | None = None):
        self.path = Path(path) if path is not None else default_cache_dir()
        self.budget_bytes = int(budget_bytes if budget_bytes is not None else default_budget_bytes(self.path))
        if self.budget_bytes <= 0:
            raise DataError(f"cache budget must be > 0 bytes (got {self.budget_bytes})")
        self.path.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()

    # -- index --------------------------------------------------------------------------
    def _read_index(self) -> dict[str, dict]:
        try:
            return json.loads((self.path / INDEX).read_text())
        except FileNotFoundError:
            return {}
        except ValueError:
            return {}  # a torn index only loses LRU order; entries are re-found on disk by name

    def _write_index(self, index: dict[str, dict]) -> None:
        tmp = self.path / f".{INDEX}.{os.getpid()}"
        tmp.write_text(json.dumps(index, sort_keys=True))
        os.replace(tmp, self.path / INDEX)

    def entry_path(self, sha256: str) -> Path:
        return self.path / "blobs" / sha256[:2] / sha256

    def used_bytes(self) -> int:
        """Bytes of published and in-flight entries."""
        return sum(e["size"] for e in self._read_index().values())

    def entries(self) -> dict[str, dict]:
        return self._read_index()

    # -- operations -----------------------------------------------------------------------
    def fetch(self, store: Store, path: str, sha256: str, size: int, pin: bool = False) -> Path:
        """The local path of ``store/path`` (sha256 ``sha256``, ``size`` bytes), fetched when not cached."""
        target = self.entry_path(sha256)
        if self._touch(sha256, target, size, pin):
            self.stats.hits += 1
            return target
        if size > self.budget_bytes:
            raise DataError(f"cache budget of {self.budget_bytes} bytes at {self.path} is smaller than shard "
                            f"{path} of {size} bytes; raise HFLEET_DATA_CACHE_BYTES to at least {size}")
        with _flock(self.path / "locks" / f"{sha256}.lock"):  # one download per entry across processes
            if self._touch(sha256, target, size, pin):
                self.stats.hits += 1
                return target
            self._reserve(sha256, size, store, path, pin)
            try:
                download_verified(store, path, target, sha256, size=size, durable=False)  # re-verified when opened
            except BaseException as err:
                Path(f"{target}.part").unlink(missing_ok=True)  # a failed fetch leaves nothing behind
                self._forget(sha256)
                if isinstance(err, StoreError):
                    raise DataError(f"fetching {store.url}/{path} into the cache failed: {err}") from None
                if isinstance(err, OSError):
                    raise DataError(f"fetching {store.url}/{path} into the cache at {self.path} failed: {err}") from None
                raise
            self._publish(sha256)
        self.stats.misses += 1
        self.stats.bytes_fetched += size
        return target

    def _touch(self, sha256: str, target: Path, size: int, pin: bool) -> bool:
        if not target.exists() or target.stat().st_size != size:
            return False
        with _flock(self.path / ".index.lock"):
            index = self._read_index()
            entry = index.setdefault(sha256, {"size": size, "remote": None, "pinned": False, "state": "ready"})
            entry["used"] = time.time()
            entry["pinned"] = entry.get("pinned", False) or pin
            self._write_index(index)
        return True

    def _reserve(self, sha256: str, size: int, store: Store, path: str, pin: bool) -> None:
        with _flock(self.path / ".index.lock"):
            index = self._read_index()
            used = sum(e["size"] for e in index.values())
            victims = sorted((e["used"], key) for key, e in index.items()
                             if not e.get("pinned") and e.get("remote") and e.get("state") == "ready")
            while used + size > self.budget_bytes and victims:
                _, key = victims.pop(0)
                self.entry_path(key).unlink(missing_ok=True)
                used -= index.pop(key)["size"]
                self.stats.evictions += 1
            if used + size > self.budget_bytes:
                raise DataError(f"cache at {self.path} cannot fit {path} ({size} bytes): {used} of "
                                f"{self.budget_bytes} bytes are pinned, in flight or have no remote copy")
            index[sha256] = {"size": size, "remote": f"{store.url}/{path}", "pinned": pin, "state": "fetching",
                             "used": time.time()}
            self._write_index(index)

    def _publish(self, sha256: str) -> None:
        with _flock(self.path / ".index.lock"):
            index = self._read_index()
            index[sha256]["state"] = "ready"
            self._write_index(index)

    def _forget(self, sha256: str) -> None:
        with _flock(self.path / ".index.lock"):
            index = self._read_index()
            index.pop(sha256, None)
            self._write_index(index)

    def pin(self, sha256: str, pinned: bool = True) -> None:
        """Keep (or stop keeping) an entry whatever the budget pressure."""
        with _flock(self.path / ".index.lock"):
            index = self._read_index()
            if sha256 not in index:
                raise DataError(f"no cache entry {sha256[:12]} in {self.path}")
            index[sha256]["pinned"] = pinned
            self._write_index(index)

    def invalidate(self, sha256: str) -> None:
        """Drop an entry found corrupt so the next fetch downloads it again."""
        with _flock(self.path / ".index.lock"):
            self.entry_path(sha256).unlink(missing_ok=True)
            index = self._read_index()
            index.pop(sha256, None)
            self._write_index(index)
