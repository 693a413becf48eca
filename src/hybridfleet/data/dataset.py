"""`PackedDataset`: the rows of a packed dataset, memory-mapped, as numpy views.

Shards are opened lazily and mapped, never read into Python objects: a tensor column
of one shard is one contiguous numpy view of the map, and a row is a slice of it. A
worker process therefore holds no per-sample Python objects (no copy-on-write growth
when a DataLoader forks), and `take` gathers a whole batch with one numpy call per
column and shard.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from hybridfleet.data.cache import SiteCache
from hybridfleet.data.manifest import DatasetManifest, ShardInfo, read_manifest
from hybridfleet.errors import DataError
from hybridfleet.store import Store, open_store, sha256_parts
from hybridfleet.store.file import FileStore


class PackedDataset:
    """Map-style access to a packed dataset (local folder, or remote through a `SiteCache`).

    ``verify``: check each shard's sha256 when it is first opened in this process (a
    corrupt local shard is a clear error; a corrupt cached one is fetched again).
    """

    def __init__(self, store: Store, manifest: DatasetManifest, cache: SiteCache | None = None,
                 verify: bool = True):
        self.store = store
        self.manifest = manifest
        self.cache = cache
        self.verify = verify
        self.url = store.url
        self.offsets = np.cumsum([0] + [s.rows for s in manifest.shards])
        self._columns: dict[int, dict[str, np.ndarray | pa.Array]] = {}
        self._maps: dict[int, pa.MemoryMappedFile] = {}
        self.shapes = {c.name: tuple(c.shape) for c in manifest.columns}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.manifest.columns]

    # -- shards -------------------------------------------------------------------------
    def _local_path(self, shard: ShardInfo) -> Path:
        if isinstance(self.store, FileStore):
            return self.store._full(shard.name)
        if self.cache is None:
            self.cache = SiteCache()
        _CACHES[id(self.cache)] = self.cache
        return self.cache.fetch(self.store, shard.name, shard.sha256, shard.bytes)

    def _check(self, shard: ShardInfo, path: Path) -> None:
        size = path.stat().st_size if path.exists() else -1
        if size != shard.bytes:
            raise DataError(f"shard {shard.name} of {self.url} is {size} bytes, the manifest says {shard.bytes}: "
                            "truncated or replaced; pack the dataset again")
        if self.verify:
            with pa.memory_map(str(path)) as mm:
                digest, _ = sha256_parts([memoryview(mm.read_buffer())])
            if digest != shard.sha256:
                raise DataError(f"shard {shard.name} of {self.url} does not match its sha256 "
                                f"({digest[:12]} != {shard.sha256[:12]}): corrupt; pack the dataset again")

    def _open(self, index: int) -> dict[str, np.ndarray | pa.Array]:
        cols = self._columns.get(index)
        if cols is not None:
            return cols
        shard = self.manifest.shards[index]
        path = self._local_path(shard)
        try:
            self._check(shard, path)
        except DataError:
            if self.cache is None or isinstance(self.store, FileStore):
                raise
            self.cache.invalidate(shard.sha256)  # remote copy exists: fetch it again, once
            path = self._local_path(shard)
            self._check(shard, path)
        mm = pa.memory_map(str(path))
        batch = pa.ipc.open_file(mm).get_batch(0)
        expected = [c.name for c in self.manifest.columns]
        if batch.schema.names != expected:
            raise DataError(f"shard {shard.name} of {self.url} has columns {batch.schema.names}, "
                            f"the manifest says {expected}")
        cols = {}
        for name, column in zip(batch.schema.names, batch.columns):
            cols[name] = self._as_numpy(name, column)
        self._maps[index] = mm
        self._columns[index] = cols
        return cols

    def _as_numpy(self, name: str, column: pa.Array) -> np.ndarray | pa.Array:
        t = column.type
        if pa.types.is_fixed_size_list(t) and column.null_count == 0:
            values = column.values.slice(column.offset * t.list_size, len(column) * t.list_size)
            if pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
                flat = _numeric_view(values)
                return flat.reshape((len(column), *(self.shapes.get(name) or (t.list_size,))))
        if (pa.types.is_integer(t) or pa.types.is_floating(t)) and column.null_count == 0:
            return _numeric_view(column)
        return column  # binary/string/nested: kept as Arrow, converted per row

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for a dataset of {n} rows")
        i %= n
        shard = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return shard, i - int(self.offsets[shard])

    # -- rows -------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> dict:
        """Row ``i``: numpy views for numeric columns, Python values for the others."""
        shard, row = self._locate(int(i))
        out = {}
        for name, col in self._open(shard).items():
            out[name] = col[row] if isinstance(col, np.ndarray) else col[row].as_py()
        return out

    def take(self, indices) -> dict:
        """Rows ``indices`` as batched numpy arrays (one gather per column and shard)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row indices out of range for a dataset of {len(self)} rows")
        shards = np.searchsorted(self.offsets, idx, side="right") - 1
        out: dict[str, list] = {name: [] for name in self.column_names}
        order = []
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            order.append(where)
            local = idx[where] - self.offsets[shard]
            for name, col in self._open(int(shard)).items():
                out[name].append(np.take(col, local, axis=0) if isinstance(col, np.ndarray)
                                 else col.take(pa.array(local)).to_pylist())
        if len(order) == 1:
            return {k: v[0] for k, v in out.items()}
        inverse = np.argsort(np.concatenate(order), kind="stable")
        result = {}
        for name, parts in out.items():
            if parts and isinstance(parts[0], np.ndarray):
                result[name] = np.concatenate(parts)[inverse]
            else:
                flat = [x for part in parts for x in part]
                result[name] = [flat[j] for j in inverse]
        return result

    def close(self) -> None:
        self._columns.clear()
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()

    def __getstate__(self):  # a forked or spawned DataLoader worker maps the shards itself
        state = self.__dict__.copy()
        state["_columns"], state["_maps"] = {}, {}
        return state


_OPENED: dict[str, str] = {}  # url -> manifest sha256 of every dataset this process opened


_CACHES: dict[int, SiteCache] = {}  # the site caches this process read through


def _numeric_view(values: pa.Array) -> np.ndarray:
    """A read-only numpy view of a null-free integer or float Arrow array, without copying (what
    ``Array.to_numpy(zero_copy_only=True)`` gives, without the pandas import it brings)."""
    dtype = np.dtype(values.type.to_pandas_dtype())
    return np.frombuffer(values.buffers()[1], dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize)


def cache_stats() -> dict[str, int]:
    """Hits, misses, bytes fetched and evictions of the site caches this process read through."""
    total: dict[str, int] = {}
    for cache in _CACHES.values():
        for key, value in vars(cache.stats).items():
            total[key] = total.get(key, 0) + value
    return total


def opened_digests() -> dict[str, str]:
    """The manifest sha256 of each packed dataset this process opened, by URL (a run records what it read)."""
    return dict(_OPENED)


def _check_site_access(url: str, manifest: DatasetManifest) -> None:
    """A worker of a job (HFLEET_JOB and HFLEET_SITE set) may read only its own site's dataset."""
    site = os.environ.get("HFLEET_SITE")
    if not site:
        return
    if manifest.site and manifest.site != site:
        raise DataError(f"dataset {url} was packed for site {manifest.site!r}; a worker of site {site!r} "
                        f"may read only its own site's data")
    job_path = os.environ.get("HFLEET_JOB")
    if job_path:
        from hybridfleet.spec.load import load_spec

        own = load_spec(job_path).sites[site].data
        if own and not _same_url(own, url):
            raise DataError(f"a worker of site {site!r} may read only its site's dataset {own!r} "
                            f"(sites.{site}.data); got {url!r}")


def _same_url(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def open_dataset(url: str | os.PathLike[str], *, cache: SiteCache | None = None, verify: bool = True,
                 **store_options) -> PackedDataset:
    """Open a packed dataset at a path, ``file://`` or ``s3://`` URL (remote shards go through ``cache``,
    by default a `SiteCache` at its default location); ``store_options`` go to `open_store`."""
    text = os.fspath(url)
    store = open_store(text, **store_options)
    manifest = read_manifest(store)
    _check_site_access(text, manifest)
    _OPENED[text] = manifest.digest
    return PackedDataset(store, manifest, cache=cache, verify=verify)
