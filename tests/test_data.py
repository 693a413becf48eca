"""Packed site datasets: pack, read, verify, order, resume, cache (hybridfleet.data)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from hybridfleet.data import GlobalOrder, SiteCache, open_dataset, pack, read_manifest
from hybridfleet.data.pack import pack_arrays
from hybridfleet.errors import DataError
from hybridfleet.store import open_store
from tests.needs import missing

pytest_plugins = ["tests.seaweed"]
REPO = Path(__file__).resolve().parents[1]


def rows(n: int = 300, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"id": np.arange(n), "x": rng.random((n, 4, 4), dtype=np.float32),
            "y": rng.integers(0, 10, n).astype(np.int64)}


@pytest.fixture
def packed(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    data = rows()
    pack_arrays(data, tmp_path / "ds", shard_bytes=4096, site="hospital")
    return tmp_path / "ds", data


# -- pack and read --------------------------------------------------------------------------------
def test_arrays_round_trip_across_shards_as_zero_copy_views(packed):
    path, data = packed
    ds = open_dataset(path)
    assert len(ds.manifest.shards) > 3 and len(ds) == 300
    for i in (0, 77, 299):
        row = ds[i]
        assert row["id"] == i and np.array_equal(row["x"], data["x"][i]) and row["y"] == data["y"][i]
    assert not ds[5]["x"].flags.owndata  # a view of the memory map, not a copy
    idx = [299, 3, 150, 3]
    batch = ds.take(idx)
    assert np.array_equal(batch["x"], data["x"][idx]) and np.array_equal(batch["id"], idx)


def test_every_source_kind_packs_and_reads_back(tmp_path):
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = pa.table({"a": np.arange(20), "b": np.linspace(0, 1, 20)})
    pq.write_table(table, tmp_path / "t.parquet")
    pcsv.write_csv(table, tmp_path / "t.csv")
    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.float32).reshape(20, 2))
    (tmp_path / "files" / "sub").mkdir(parents=True)
    (tmp_path / "files" / "one.bin").write_bytes(b"\x00\x01")
    (tmp_path / "files" / "sub" / "two.txt").write_bytes(b"hello")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "dataset_info.json").write_text("{}")
    with pa.ipc.new_stream(str(hf / "data-00000-of-00001.arrow"), table.schema) as writer:  # HF save_to_disk layout
        writer.write_table(table)
    for src in ("t.parquet", "t.csv", "hf"):
        ds = open_dataset(pack(tmp_path / src, tmp_path / f"out-{src}") and tmp_path / f"out-{src}")
        assert len(ds) == 20 and ds[7]["a"] == 7 and ds.take([19])["b"][0] == pytest.approx(1.0)
    npy = open_dataset(pack(tmp_path / "t.npy", tmp_path / "out-npy") and tmp_path / "out-npy")
    assert np.array_equal(npy[3]["x"], [6.0, 7.0])
    files = open_dataset(pack(tmp_path / "files", tmp_path / "out-files") and tmp_path / "out-files")
    assert [files[i]["path"] for i in range(2)] == ["one.bin", "sub/two.txt"] and files[1]["data"] == b"hello"


def test_the_shipped_digits_sites_are_what_pack_sites_writes(tmp_path):
    for site in ("site-a", "site-b"):
        committed = read_manifest(open_store(REPO / "examples/digits/data" / site))
        assert committed.rows > 700 and committed.site in ("hospital", "cloud")
    sys.path.insert(0, str(REPO / "examples/digits"))
    try:
        from digits_data import load_site, split_rows
    finally:
        sys.path.pop(0)
    x_packed, y_packed = load_site(str(REPO / "examples/digits/data/site-a"))
    x_split, y_split = split_rows("digits:site-a")
    assert np.array_equal(x_packed, x_split) and np.array_equal(y_packed, y_split)


# -- bad input -----------------------------------------------------------------------------------
def test_an_interrupted_pack_leaves_no_dataset(tmp_path, monkeypatch):
    from hybridfleet.store.file import FileStore

    real = FileStore.put_bytes
    calls = []

    def failing(self, path, data):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, path, data)

    monkeypatch.setattr(FileStore, "put_bytes", failing)
    with pytest.raises(OSError, match="No space"):
        pack_arrays(rows(), tmp_path / "ds", shard_bytes=4096)
    monkeypatch.undo()
    with pytest.raises(DataError, match="has no manifest.json: not a packed dataset, or its packing did not finish"):
        open_dataset(tmp_path / "ds")


def test_pack_refuses_an_existing_dataset_and_leaves_it_unchanged(packed):
    path, _ = packed
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(DataError, match="already holds a packed dataset; .* --overwrite"):
        pack_arrays(rows(seed=1), path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


@pytest.mark.parametrize("bad, message", [
    ({"a": np.arange(3), "b": np.arange(4)}, "same number of rows"),
    ({}, "no arrays to pack"),
])
def test_bad_arrays_are_refused_and_nothing_is_written(tmp_path, bad, message):
    with pytest.raises(DataError, match=message):
        pack_arrays(bad, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_a_corrupt_local_shard_is_a_clear_error(packed):
    path, _ = packed
    shard = path / "shard-00001.arrow"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    ds = open_dataset(path)
    assert ds[0]["id"] == 0  # other shards still read
    with pytest.raises(DataError, match=r"shard shard-00001.arrow of .* does not match its sha256 .* corrupt"):
        ds.take(np.arange(len(ds)))


def test_a_truncated_shard_names_both_sizes(packed):
    path, _ = packed
    shard = path / "shard-00000.arrow"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match=f"is 100 bytes, the manifest says {size}: truncated"):
        open_dataset(path)[0]


def test_a_manifest_whose_columns_differ_from_the_shards_is_refused(packed):
    path, _ = packed
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["columns"][0]["name"] = "renamed"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"has columns \['id', 'x', 'y'\], the manifest says \['renamed', 'x', 'y'\]"):
        open_dataset(path)[0]


def test_a_worker_may_read_only_its_own_sites_dataset(packed, tmp_path, monkeypatch):
    path, _ = packed
    pack_arrays(rows(), tmp_path / "cloud", site="cloud")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\nframework: torch\nentrypoint: {REPO / 'examples/digits/train_torch.py'}\nmode: ps\n"
                   f"sites:\n  hospital: {{workers: 1, data: {path}}}\n  cloud: {{workers: 1, data: {tmp_path / 'cloud'}}}\n")
    monkeypatch.setenv("HFLEET_JOB", str(job))
    monkeypatch.setenv("HFLEET_SITE", "hospital")
    assert len(open_dataset(path)) == 300
    with pytest.raises(DataError, match="was packed for site 'cloud'; a worker of site 'hospital' may read only"):
        open_dataset(tmp_path / "cloud")
    pack_arrays(rows(), tmp_path / "other")  # packed without a site: the job's sites.<s>.data decides
    with pytest.raises(DataError, match=r"may read only its site's dataset .* \(sites.hospital.data\)"):
        open_dataset(tmp_path / "other")


# -- order and resume ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_global_order_is_the_same_for_any_number_of_ranks_without_overlap(world):
    n, batch = 100, 4
    reference = GlobalOrder(n, seed=7).remaining()
    ranks = [GlobalOrder(n, seed=7, rank=r, world=world).remaining() for r in range(world)]
    assert sum(len(r) for r in ranks) == n - n % world
    assert len(set(np.concatenate(ranks).tolist())) == n - n % world  # no row read twice
    for step in range(len(ranks[0]) // batch):
        together = sorted(np.concatenate([r[step * batch:(step + 1) * batch] for r in ranks]).tolist())
        assert together == sorted(reference[step * batch * world:(step + 1) * batch * world].tolist())


def test_epochs_reshuffle_and_depend_only_on_seed_and_epoch():
    a, b = GlobalOrder(50, seed=1), GlobalOrder(50, seed=1)
    a.advance(50)
    assert a.epoch == 1 and not np.array_equal(a.remaining(), b.remaining())
    b.load_state_dict({**b.state_dict(), "epoch": 1})
    assert np.array_equal(a.remaining(), b.remaining())


def test_a_sampler_state_for_other_data_is_refused_and_changes_nothing():
    order = GlobalOrder(50, seed=1)
    with pytest.raises(DataError, match="sampler state is for 60 rows with seed 1, this order has 50 rows"):
        order.load_state_dict({"num_rows": 60, "seed": 1, "epoch": 3, "position": 10})
    assert (order.epoch, order.position) == (0, 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sigkill_then_resume_reads_exactly_the_uninterrupted_sequence(packed, tmp_path, world):
    path, _ = packed
    script = [sys.executable, str(REPO / "tests/data_resume_script.py"), str(path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    steps = 30  # crosses an epoch boundary for every world size (300 rows, batches of 7)
    for rank in range(world):
        clean = subprocess.run([*script, str(tmp_path / f"clean-{world}-{rank}"), "--rank", str(rank),
                                "--world", str(world), "--steps", str(steps)],
                               capture_output=True, text=True, env=env, timeout=120, check=True)
        kill_at = random.Random(world * 10 + rank).randint(2, steps - 2)
        ckpt = str(tmp_path / f"killed-{world}-{rank}")
        args = [*script, ckpt, "--rank", str(rank), "--world", str(world), "--steps", str(steps)]
        victim = subprocess.Popen([*args, "--pause-after", str(kill_at)], stdout=subprocess.PIPE, text=True, env=env)
        assert victim.stdout.readline().strip() == f"SAVED {kill_at}"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        resumed = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=True)
        assert json.loads(resumed.stdout.splitlines()[-1]) == json.loads(clean.stdout.splitlines()[-1])


@pytest.mark.torch
def test_torch_loaders_read_the_same_sequence_with_any_number_of_workers(packed):
    import torch
    from torch.utils.data import DataLoader

    import hybridfleet.data.torch as hfd

    path, _ = packed
    ds = open_dataset(path)
    expected = GlobalOrder(len(ds), seed=5, rank=1, world=2).remaining().tolist()
    for workers in (0, 1, 2, 3):
        sampler = hfd.OrderSampler(GlobalOrder(len(ds), seed=5, rank=1, world=2))
        got = [int(i) for b in DataLoader(hfd.MapDataset(ds), batch_size=8, sampler=sampler, num_workers=workers)
               for i in b["id"]]
        assert got == expected
        it = hfd.BatchIterable(ds, GlobalOrder(len(ds), seed=5, rank=1, world=2), batch_size=8)
        batches = list(DataLoader(it, batch_size=None, num_workers=workers))
        assert [int(i) for b in batches for i in b["id"]] == expected
        assert isinstance(batches[0]["x"], torch.Tensor) and batches[0]["x"].shape == (8, 4, 4)


@pytest.mark.paddle
def test_paddle_loaders_read_the_same_sequence_with_any_number_of_workers(packed):
    from paddle.io import BatchSampler, DataLoader

    import hybridfleet.data.paddle as hfd

    path, _ = packed
    ds = open_dataset(path)
    expected = GlobalOrder(len(ds), seed=5, rank=0, world=3).remaining().tolist()
    for workers in (0, 2):
        sampler = hfd.OrderSampler(GlobalOrder(len(ds), seed=5, rank=0, world=3))
        loader = DataLoader(hfd.MapDataset(ds), batch_sampler=BatchSampler(sampler=sampler, batch_size=8),
                            num_workers=workers)
        assert [int(i) for b in loader for i in np.asarray(b["id"]).reshape(-1)] == expected
        it = hfd.BatchIterable(ds, GlobalOrder(len(ds), seed=5, rank=0, world=3), batch_size=8)
        got = [int(i) for b in DataLoader(it, batch_size=None, num_workers=workers) for i in np.asarray(b["id"]).reshape(-1)]
        assert got == expected


# -- site cache ------------------------------------------------------------------------------------------
@pytest.fixture
def remote(seaweed, s3_url):
    data = rows(600)
    manifest = pack_arrays(data, s3_url, shard_bytes=8192, **seaweed.options)
    return s3_url, seaweed, manifest, data


def test_a_remote_dataset_reads_through_the_cache_once(remote, tmp_path):
    url, seaweed, manifest, data = remote
    cache = SiteCache(tmp_path / "cache", budget_bytes=10 << 20)
    ds = open_dataset(url, cache=cache, **seaweed.options)
    assert np.array_equal(ds.take(np.arange(600))["x"], data["x"])
    assert cache.stats.misses == len(manifest.shards) and cache.stats.bytes_fetched == manifest.bytes
    again = open_dataset(url, cache=cache, **seaweed.options)
    again.take(np.arange(600))
    assert cache.stats.hits == len(manifest.shards) and cache.stats.misses == len(manifest.shards)
    from hybridfleet.data.dataset import cache_stats  # what a worker's final metrics record carries

    assert cache_stats()["bytes_fetched"] >= manifest.bytes and cache_stats()["hits"] >= len(manifest.shards)


def test_the_cache_evicts_lru_within_its_budget_but_never_pinned_or_local_only(remote, tmp_path):
    url, seaweed, manifest, _ = remote
    largest = max(s.bytes for s in manifest.shards)
    cache = SiteCache(tmp_path / "cache", budget_bytes=3 * largest)
    store = open_store(url, **seaweed.options)
    first = manifest.shards[0]
    cache.fetch(store, first.name, first.sha256, first.bytes, pin=True)
    for shard in manifest.shards[1:]:
        cache.fetch(store, shard.name, shard.sha256, shard.bytes)
        assert cache.used_bytes() <= cache.budget_bytes
    assert cache.entry_path(first.sha256).exists()  # pinned: never evicted
    assert cache.stats.evictions >= len(manifest.shards) - 3


def test_a_budget_smaller_than_one_shard_names_both_sizes(remote, tmp_path):
    url, seaweed, manifest, _ = remote
    shard = manifest.shards[0]
    cache = SiteCache(tmp_path / "cache", budget_bytes=100)
    with pytest.raises(DataError, match=f"cache budget of 100 bytes .* smaller than shard {shard.name} of {shard.bytes} bytes"):
        open_dataset(url, cache=cache, **seaweed.options)[0]
    assert cache.entries() == {} and not list((tmp_path / "cache").rglob("*.arrow"))


def test_a_corrupt_cached_shard_is_fetched_again(remote, tmp_path):
    url, seaweed, manifest, data = remote
    cache = SiteCache(tmp_path / "cache", budget_bytes=10 << 20)
    open_dataset(url, cache=cache, **seaweed.options)[0]
    entry = cache.entry_path(manifest.shards[0].sha256)
    blob = bytearray(entry.read_bytes())
    blob[-20] ^= 0xFF
    entry.write_bytes(bytes(blob))
    ds = open_dataset(url, cache=cache, **seaweed.options)
    assert np.array_equal(ds[0]["x"], data["x"][0])
    assert cache.stats.misses == 2  # the first fetch and the refetch of the corrupt copy


def test_a_remote_shard_that_does_not_match_its_hash_is_never_published(remote, tmp_path):
    url, seaweed, manifest, _ = remote
    store = open_store(url, **seaweed.options)
    shard = manifest.shards[0]
    store.put_bytes(shard.name, b"x" * shard.bytes)  # replaced remotely behind the manifest's back
    cache = SiteCache(tmp_path / "cache", budget_bytes=10 << 20)
    with pytest.raises(DataError, match="fetching .* into the cache failed"):
        cache.fetch(store, shard.name, shard.sha256, shard.bytes)
    assert not cache.entry_path(shard.sha256).exists() and cache.entries() == {}


def test_a_full_disk_during_fetch_publishes_nothing(remote, tmp_path):
    url, seaweed, manifest, _ = remote
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(mount)]).returncode != 0:
        missing("mounting a tmpfs needs root; CI runs as root")
    try:
        cache = SiteCache(mount / "cache", budget_bytes=10 << 20)
        shard = max(manifest.shards, key=lambda s: s.bytes)
        with pytest.raises(DataError, match="No space left on device"):
            cache.fetch(open_store(url, **seaweed.options), shard.name, shard.sha256, shard.bytes)
        assert not cache.entry_path(shard.sha256).exists()
        assert not list((mount / "cache").rglob("*.part")) and cache.entries() == {}
    finally:
        subprocess.run(["umount", str(mount)])


def test_two_processes_fetching_the_same_shard_download_it_once(remote, tmp_path):
    url, seaweed, manifest, _ = remote
    code = (
        "import sys, json; from hybridfleet.data import SiteCache, open_dataset\n"
        f"c = SiteCache({str(tmp_path / 'cache')!r}, budget_bytes=10 << 20)\n"
        f"ds = open_dataset({url!r}, cache=c, **{seaweed.options!r}); ds.take(range(len(ds)))\n"
        "print(json.dumps(c.stats.__dict__))\n"
    )
    env = {**os.environ, "AWS_ACCESS_KEY_ID": seaweed.key, "AWS_SECRET_ACCESS_KEY": seaweed.secret}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    stats = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    assert sum(s["misses"] for s in stats) == len(manifest.shards)  # each shard downloaded by one of them
    assert sum(s["hits"] for s in stats) == len(manifest.shards)


# -- CLI ------------------------------------------------------------------------------------------------
def test_cli_pack_ls_verify(tmp_path):
    np.savez(tmp_path / "rows.npz", **rows(50))
    hfleet = [sys.executable, "-m", "hybridfleet.cli.app", "data"]
    out = subprocess.run([*hfleet, "pack", str(tmp_path / "rows.npz"), str(tmp_path / "ds"), "--site", "bank"],
                         capture_output=True, text=True, check=True).stdout
    assert "packed 50 rows into 1 shard(s)" in out
    listing = subprocess.run([*hfleet, "ls", str(tmp_path / "ds")], capture_output=True, text=True, check=True).stdout
    assert "site bank" in listing and "x" in listing and "(4, 4)" in listing
    assert "valid: 50 rows" in subprocess.run([*hfleet, "verify", str(tmp_path / "ds")], capture_output=True,
                                              text=True, check=True).stdout
    (tmp_path / "ds" / "shard-00000.arrow").write_bytes(b"broken")
    bad = subprocess.run([*hfleet, "verify", str(tmp_path / "ds")], capture_output=True, text=True)
    assert bad.returncode == 14 and "truncated or replaced" in bad.stderr and "Traceback" not in bad.stderr
