"""`pack(src, dest)`: arrays, a folder of files, a Parquet/CSV table or an HF-style Arrow
dataset into Arrow IPC shards of about ``shard_bytes`` each, plus the manifest, last.

Each shard is one Arrow IPC *file* holding one record batch, so a reader memory-maps
it and takes every column as one contiguous array without copying. Tensor columns
(numpy arrays of shape ``(rows, *shape)``) become fixed-size lists of their dtype with
the per-row shape in the manifest.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from hybridfleet.data.manifest import MANIFEST, ColumnInfo, DatasetManifest, ShardInfo
from hybridfleet.errors import DataError
from hybridfleet.store import open_store, sha256_parts

DEFAULT_SHARD_BYTES = 64 << 20


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def _from_arrays(arrays: dict[str, np.ndarray]) -> tuple[pa.Table, dict[str, list[int]]]:
    if not arrays:
        raise DataError("no arrays to pack")
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise DataError(f"arrays must have the same number of rows (first dimension): {lengths}")
    columns, shapes = {}, {}
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype == object or arr.dtype.kind in "USV":
            columns[name] = pa.array(arr.tolist())
            continue
        if arr.ndim == 1:
            columns[name] = pa.array(arr)
        else:
            shapes[name] = list(arr.shape[1:])
            flat = pa.array(arr.reshape(-1))
            columns[name] = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(arr.shape[1:])))
    return pa.table(columns), shapes


def _from_folder_of_files(root: Path) -> pa.Table:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise DataError(f"{root} holds no files to pack")
    return pa.table({"path": pa.array([str(p.relative_to(root)) for p in files]),
                     "data": pa.array([p.read_bytes() for p in files], type=pa.large_binary())})


def _from_arrow_dataset(root: Path) -> pa.Table:
    """An HF-style saved dataset: ``*.arrow`` files in Arrow IPC stream (or file) format."""
    tables = []
    for path in sorted(root.glob("*.arrow")):
        with pa.memory_map(str(path)) as source:
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                source.seek(0)
                tables.append(pa.ipc.open_file(source).read_all())
    return pa.concat_tables(tables)


def read_source(src: str | os.PathLike[str]) -> tuple[pa.Table, dict[str, list[int]]]:
    """The rows of ``src`` as one Arrow table, and the per-row shape of its tensor columns."""
    path = Path(src)
    if not path.exists():
        raise DataError(f"source {src} does not exist")
    if path.is_dir():
        if any(path.glob("*.arrow")) and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            return _from_arrow_dataset(path), {}
        return _from_folder_of_files(path), {}
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                return _from_arrays({k: npz[k] for k in npz.files})
        if suffix == ".npy":
            return _from_arrays({"x": np.load(path, allow_pickle=False)})
        if suffix == ".parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path), {}
        if suffix == ".csv":
            import pyarrow.csv as pcsv
            return pcsv.read_csv(path), {}
    except (ValueError, OSError, pa.ArrowException) as err:
        raise DataError(f"cannot read {src}: {err}") from None
    raise DataError(f"unsupported source {src}: give a .npz/.npy file, a .parquet or .csv table, "
                    "a folder of files, or a saved Arrow dataset folder")


def _column_info(field: pa.Field, shapes: dict[str, list[int]]) -> ColumnInfo:
    t = field.type
    value = t.value_type if pa.types.is_fixed_size_list(t) else t
    dtype = None
    if pa.types.is_integer(value) or pa.types.is_floating(value) or pa.types.is_boolean(value):
        # an empty array's numpy dtype: DataType.to_pandas_dtype imports pandas on pyarrow 25 (Python 3.10)
        dtype = pa.array([], type=value).to_numpy(zero_copy_only=False).dtype.str
    shape = shapes.get(field.name) or ([t.list_size] if pa.types.is_fixed_size_list(t) else [])
    return ColumnInfo(name=field.name, arrow_type=str(t), dtype=dtype, shape=shape)


def pack_table(table: pa.Table, dest, shapes: dict[str, list[int]] | None = None, *, site: str | None = None,
               source: str = "", shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
               **store_options) -> DatasetManifest:
    """Write ``table`` as shards at ``dest`` (a path or URL), then the manifest; returns the manifest.

    ``store_options`` (endpoint_url, key, secret) go to `open_store`."""
    if shard_bytes <= 0:
        raise DataError(f"shard size must be > 0 bytes (got {shard_bytes})")
    if table.num_rows == 0:
        raise DataError("the source has no rows")
    store = open_store(dest, **store_options)
    if store.exists(MANIFEST) and not overwrite:
        raise DataError(f"{store.url} already holds a packed dataset; choose another destination or pass --overwrite")
    table = table.combine_chunks()
    row_bytes = max(1, table.nbytes // table.num_rows)
    rows_per_shard = max(1, shard_bytes // row_bytes)
    shards = []
    if overwrite and store.exists(MANIFEST):
        store.rm(MANIFEST)  # the old dataset stops existing before its shards are replaced
    for index, start in enumerate(range(0, table.num_rows, rows_per_shard)):
        batch = table.slice(start, rows_per_shard).combine_chunks().to_batches()[0]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_batch(batch)
        data = sink.getvalue()
        digest, size = sha256_parts([data])
        store.put_bytes(shard_name(index), data)
        shards.append(ShardInfo(name=shard_name(index), rows=batch.num_rows, bytes=size, sha256=digest))
    manifest = DatasetManifest(columns=[_column_info(f, shapes or {}) for f in table.schema],
                               shards=shards, site=site, source=source)
    store.put_bytes(MANIFEST, manifest.to_json().encode())
    return manifest


def pack(src, dest, *, site: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
         **store_options) -> DatasetManifest:
    """Pack ``src`` (see `read_source`) into ``dest``; the manifest is written last."""
    table, shapes = read_source(src)
    return pack_table(table, dest, shapes, site=site, source=os.path.basename(os.fspath(src)),
                      shard_bytes=shard_bytes, overwrite=overwrite, **store_options)


def pack_arrays(arrays: dict[str, np.ndarray], dest, **kwargs) -> DatasetManifest:
    """Pack in-memory arrays (same number of rows each) into ``dest``."""
    table, shapes = _from_arrays(arrays)
    return pack_table(table, dest, shapes, **kwargs)
