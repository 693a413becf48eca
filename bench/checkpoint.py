"""Checkpoint benchmark: our format vs torch.save/load, paddle.save/load and plain safetensors.

    OMP_NUM_THREADS=1 python bench/checkpoint.py [--quick] [--size-mb 1024] [--dir DIR]

Durable saves (every method's files are fsync'd before the clock stops) and loads
into framework tensors; every method's tensors then get every element read (a sum), so
lazy memory maps are really loaded. What our loads verify, before any tensor is used:

- ``load_ours`` (`open_tensors`, the streaming view): the size and CRC-32 (zlib's
  polynomial, ISA-L) of every file, each file checked before any of its tensors is
  handed out, in background threads while the caller sums the tensors already checked.
- ``load_ours_eager`` (`load_tensors_checkpoint`): the same size and CRC-32 checks on
  every file before the call returns (all or nothing, falls back to an older checkpoint).

Neither checks sha256 (that is `hfleet ckpt verify` and `open_tensors(check_sha256=True)`):
the CRC-32 catches any flipped byte or truncation, not a deliberate forgery. Also
measured: `dd oflag=direct` on the same disk as the physical write limit, and the training
stall of an async save (steady state, host buffers reused) vs a synchronous save. Loads read
a warm page cache for every method alike (each file is read once before the timed
loads; best of the repeats). Prints a table, then one
JSON line: {"bench": "checkpoint", "save_vs_torch": t_torch / t_ours, "load_vs_safetensors": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TENSOR_MB = 64


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd_direct_bw(work: Path, size_bytes: int) -> float:
    """Bytes/s of `dd oflag=direct` writing ``size_bytes`` to the benchmark's disk."""
    target = work / "dd.bin"
    count = max(1, size_bytes // (64 << 20))
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"],
                         capture_output=True, text=True, check=True).stderr  # fmt: skip
    target.unlink()
    seconds = float(re.search(r"copied, ([0-9.]+) s", out).group(1))
    return count * (64 << 20) / seconds


def warm_page_cache(root: Path) -> None:
    """Read every file under ``root`` once, so its loads find it in the page cache.

    Saves written with O_DIRECT (ours) leave nothing cached, buffered ones (the rest) do;
    this puts every method on the same footing even with a single repeat.
    """
    paths = [root] if root.is_file() else [Path(folder) / name for folder, _, files in os.walk(root) for name in files]
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def touch_pages(tensors) -> None:
    """Read every element of every tensor (a sum), so lazily mapped loads really load every byte."""
    for t in tensors.values():
        flat = t.reshape([-1])
        if flat.shape[0]:
            float(flat.sum())


def make_state(size_bytes: int, tensor_bytes: int = TENSOR_MB << 20):
    import torch

    rng = np.random.default_rng(0)
    per = min(size_bytes, tensor_bytes) // 4
    count = max(1, size_bytes // (per * 4))
    arrays = {f"layer{i:03d}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(count)}
    return arrays, {k: torch.from_numpy(v) for k, v in arrays.items()}


def bench(size_bytes: int, work: Path, repeats: int, tensor_bytes: int = TENSOR_MB << 20) -> dict[str, float]:
    import paddle
    import torch
    from safetensors.torch import load_file, save_file

    from hybridfleet.ckpt import AsyncCheckpointer, load_tensors_checkpoint, open_tensors, save_tensors_checkpoint
    from hybridfleet.frameworks import get_adapter

    arrays, torch_state = make_state(size_bytes, tensor_bytes)
    total = sum(a.nbytes for a in arrays.values())
    paddle_state = {k: paddle.to_tensor(v) for k, v in arrays.items()}
    torch_adapter = get_adapter("torch")
    results: dict[str, float] = {"state_bytes": total}

    def best(name: str, fn) -> float:
        times = []
        for i in range(repeats):
            times.append(timed(lambda: fn(work / f"{name}-{i}")))
        results[name] = min(times)
        return results[name]

    def ours_save(path: Path) -> None:
        save_tensors_checkpoint(str(path), 1, {k: torch_adapter.to_numpy(v) for k, v in torch_state.items()})

    def torch_save(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(torch_state, f)
            f.flush()
            os.fsync(f.fileno())

    def paddle_save(path: Path) -> None:
        paddle.save(paddle_state, str(path))
        fsync_path(path)

    def st_save(path: Path) -> None:
        save_file(torch_state, str(path))
        fsync_path(path)

    for name, fn in [("save_ours", ours_save), ("save_torch", torch_save), ("save_paddle", paddle_save), ("save_safetensors", st_save)]:
        best(name, fn)

    for name in ("ours", "torch", "paddle", "safetensors"):
        warm_page_cache(work / f"save_{name}-0")

    def ours_load(path: Path) -> None:
        with open_tensors(str(work / "save_ours-0")) as view:
            for name, array in view.items():  # each file verified before its tensors come out
                touch_pages({name: torch_adapter.from_numpy(array)})

    def ours_eager_load(path: Path) -> None:
        _, tensors, _ = load_tensors_checkpoint(str(work / "save_ours-0"))
        touch_pages({k: torch_adapter.from_numpy(v) for k, v in tensors.items()})

    def torch_load(path: Path) -> None:
        touch_pages(torch.load(work / "save_torch-0", weights_only=True))

    def paddle_load(path: Path) -> None:
        touch_pages(paddle.load(str(work / "save_paddle-0")))

    def st_load(path: Path) -> None:
        touch_pages(load_file(str(work / "save_safetensors-0")))

    for name, fn in [("load_ours", ours_load), ("load_ours_eager", ours_eager_load), ("load_torch", torch_load), ("load_paddle", paddle_load), ("load_safetensors", st_load)]:
        best(name, fn)

    # Async: steady-state stall (second save onward reuses the host buffers) vs a sync save.
    stalls = []
    with AsyncCheckpointer(str(work / "async")) as saver:
        for step in range(1, repeats + 2):
            stalls.append(saver.save(step, tensors=arrays))
            saver.wait()
    results["async_stall"] = min(stalls[1:])
    results["dd_bw"] = dd_direct_bw(work, total)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB state, one repeat (< 1 min)")
    parser.add_argument("--size-mb", type=int, default=None, help="state size in MiB (default 1024)")
    parser.add_argument("--dir", default=None, help="work directory on the disk to measure (default: a temp dir under .)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tensor-mb", type=int, default=TENSOR_MB, help=f"size of each tensor in MiB (default {TENSOR_MB})")
    args = parser.parse_args()
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/checkpoint.py", {"torch": "PyTorch", "paddle": "PaddlePaddle", "safetensors": "safetensors"})
    size_mb = args.size_mb or (64 if args.quick else 1024)
    repeats = args.repeats or (1 if args.quick else 2)
    os.environ.setdefault("HFLEET_LOG_LEVEL", "warning")
    from hybridfleet.obs.log import configure

    configure(level="warning")
    work = Path(tempfile.mkdtemp(prefix="hfleet-bench-ckpt-", dir=args.dir or "."))
    try:
        r = bench(size_mb << 20, work, repeats, args.tensor_mb << 20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = r["state_bytes"] / 1e9
    print(f"checkpoint benchmark: {r['state_bytes'] / 2**20:.0f} MiB float32 state, best of {repeats}, disk {work.parent}")
    print(f"{'method':<14}{'save s':>9}{'save GB/s':>11}{'load s':>9}{'load GB/s':>11}")
    for name in ("ours", "torch", "paddle", "safetensors"):
        s, l = r[f"save_{name}"], r[f"load_{name}"]
        print(f"{name:<14}{s:>9.3f}{gb / s:>11.2f}{l:>9.3f}{gb / l:>11.2f}")
    print(f"{'ours, eager':<14}{'':>9}{'':>11}{r['load_ours_eager']:>9.3f}{gb / r['load_ours_eager']:>11.2f}")
    print(f"{'dd direct':<14}{gb * 1e9 / r['dd_bw']:>9.3f}{r['dd_bw'] / 1e9:>11.2f}")
    print(f"async save stall {r['async_stall']:.3f} s vs sync save {r['save_ours']:.3f} s")
    summary = {
        "bench": "checkpoint",
        "save_vs_torch": round(r["save_torch"] / r["save_ours"], 3),
        "save_vs_paddle": round(r["save_paddle"] / r["save_ours"], 3),
        "load_vs_torch": round(r["load_torch"] / r["load_ours"], 3),
        "load_vs_paddle": round(r["load_paddle"] / r["load_ours"], 3),
        "load_vs_safetensors": round(r["load_safetensors"] / r["load_ours"], 3),
        "load_eager_vs_safetensors": round(r["load_safetensors"] / r["load_ours_eager"], 3),
        "load_verified": "size + CRC-32 of every file before its tensors are used",
        "async_stall_fraction": round(r["async_stall"] / r["save_ours"], 3),
        "disk_fraction": round((r["state_bytes"] / r["save_ours"]) / r["dd_bw"], 3),
        "state_bytes": int(r["state_bytes"]),
    }
    print(json.dumps(summary))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
