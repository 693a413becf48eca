"""`hfleet serve` against a minimal uvicorn + onnxruntime server, and the canary share it routes.

    OMP_NUM_THREADS=1 python bench/serve.py [--quick] [--requests 400] [--canary-requests 10000]

Both servers run as their own process on 127.0.0.1 and serve the same ONNX export of the
digits MLP (64-128-10) and of the larger example model (``--hidden 2048,512``, 1.2M
parameters); 4 client threads send OIP v2 JSON infer requests of batch 1 and 32.
`hfleet serve` runs as users run it: token auth on and a canary at 10 % (so every
request is routed). The canary share is counted over ``--canary-requests`` unkeyed
requests. Same settings on both sides: one uvicorn worker, onnxruntime with one intra-op
and one inter-op thread, the same ONNX file and bodies; the anchor has no auth, routing,
input checks or metrics by its nature, and runs inference on the event loop. Ends with one JSON line: ``throughput_vs_minimal`` (hfleet / minimal, the
lowest over the four settings), ``p50_vs_minimal`` (hfleet / minimal, the highest) and
``canary_share_error_pp`` (|observed - 10| percentage points).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "examples" / "digits"), str(REPO)]
CLIENTS = 4
WEIGHT = 10.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], port: int, headers: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/models/digits/ready", headers=headers, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 120 s")


def _load(port: int, headers: dict[str, str], body: bytes, requests: int) -> dict:
    """4 clients, ``requests`` each: latencies (ms) and throughput (requests/s)."""
    latencies: list[float] = []
    versions: dict[str, int] = {}
    failures = [0]
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={**headers, "content-type": "application/json"}) as c:
            mine, seen = [], {}
            for _ in range(requests):
                t0 = time.perf_counter()
                r = c.post("/v2/models/digits/infer", content=body)
                mine.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    failures[0] += 1
                    continue
                v = r.json().get("model_version", "")
                seen[v] = seen.get(v, 0) + 1
            with lock:
                latencies.extend(mine)
                for k, n in seen.items():
                    versions[k] = versions.get(k, 0) + n

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {"p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
            "throughput_rps": len(latencies) / wall, "failures": failures[0], "versions": versions}  # fmt: skip


def _prepare(root: Path, hidden: str) -> tuple[object, Path]:
    """A registry with two exported versions of the ``hidden`` MLP, prod -> v1 with v2 as a 10 % canary."""
    import torch
    from digits_model import build_torch

    from hybridfleet.ckpt.run_model import ModelCheckpointer
    from hybridfleet.registry import Registry
    from hybridfleet.serve.export import export_version

    reg = Registry(f"sqlite:///{root}/registry.db")
    for seed in (0, 1):
        torch.manual_seed(seed)
        ckpt = ModelCheckpointer(str(root / f"run-{seed}"), "torch", keep_last=1)
        ckpt.final(1, build_torch(hidden), {})
        info = reg.register("digits", ckpt.store.url)
        export_version(reg, f"digits@{info.version}", "onnx", root / f"export-{info.version}",
                       f"{REPO / 'examples/digits/digits_model.py'}:build_torch", {"hidden": hidden})  # fmt: skip
    reg.move_alias("digits", "prod", 1)
    reg.rollout("digits", "prod", canary=2, weight=WEIGHT)
    return reg, root / "export-1" / "digits" / "1" / "model.onnx"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits model only, 100 requests per client, 1,000 canary requests")
    parser.add_argument("--requests", type=int, default=400, help="requests per client per setting")
    parser.add_argument("--canary-requests", type=int, default=10_000)
    args = parser.parse_args()
    if args.requests < 10:
        parser.error(f"--requests: must be >= 10 (got {args.requests})")
    if args.canary_requests < 100:
        parser.error(f"--canary-requests: must be >= 100 (got {args.canary_requests})")
    if args.quick:
        args.requests, args.canary_requests = 100, 1000
    from digits_data import load_test

    rows = load_test()[0]
    results, share = [], None
    for label, hidden in [("digits", "128")] + ([] if args.quick else [("digits-1.2M", "2048,512")]):
        with tempfile.TemporaryDirectory() as tmp:
            reg, onnx_path = _prepare(Path(tmp), hidden)
            token = reg.add_principal("bench", "service")
            reg.grant("bench", "reader", "default/digits")
            auth = {"Authorization": f"Bearer {token}"}
            ports = {"hfleet": _port(), "minimal": _port()}
            servers = {
                "hfleet": _start([sys.executable, "-m", "hybridfleet", "serve", "digits@prod", "-r", reg.db_url, "--port",
                                  str(ports["hfleet"]), "--insecure-plaintext", "--cache-dir", f"{tmp}/cache"], ports["hfleet"], auth),
                "minimal": _start([sys.executable, str(REPO / "bench" / "_minimal_oip.py"), str(onnx_path), str(ports["minimal"])],
                                  ports["minimal"], {}),
            }  # fmt: skip
            try:
                for batch in (1, 32):
                    x = rows[:batch]
                    body = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                                   "data": x.reshape(-1).tolist()}]}).encode()  # fmt: skip
                    row = {"model": label, "batch": batch}
                    for side in ("minimal", "hfleet"):  # interleaved per setting: both see the same machine load
                        _load(ports[side], auth if side == "hfleet" else {}, body, 10)  # warm-up
                        row[side] = _load(ports[side], auth if side == "hfleet" else {}, body, args.requests)
                    results.append(row)
                    print(f"{label:<12} batch {batch:>2}  minimal p50 {row['minimal']['p50_ms']:6.2f} ms p99 "
                          f"{row['minimal']['p99_ms']:6.2f} ms {row['minimal']['throughput_rps']:7.0f} req/s | hfleet p50 "
                          f"{row['hfleet']['p50_ms']:6.2f} ms p99 {row['hfleet']['p99_ms']:6.2f} ms "
                          f"{row['hfleet']['throughput_rps']:7.0f} req/s")  # fmt: skip
                if share is None:
                    x = rows[:1]
                    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                                   "data": x.reshape(-1).tolist()}]}).encode()  # fmt: skip
                    counted = _load(ports["hfleet"], auth, body, args.canary_requests // CLIENTS)
                    total = sum(counted["versions"].values())
                    share = 100.0 * counted["versions"].get("2", 0) / total
                    print(f"canary share over {total} requests: {share:.2f} % (weight {WEIGHT:g} %), failures {counted['failures']}")
            finally:
                for proc in servers.values():
                    proc.terminate()
                    proc.wait(timeout=30)
    throughput = min(r["hfleet"]["throughput_rps"] / r["minimal"]["throughput_rps"] for r in results)
    p50 = max(r["hfleet"]["p50_ms"] / r["minimal"]["p50_ms"] for r in results)
    print(json.dumps({"bench": "serve", "sides": "hfleet serve (auth, 10% canary routing) vs minimal uvicorn+onnxruntime",
                      "throughput_vs_minimal": round(throughput, 3), "p50_vs_minimal": round(p50, 3),
                      "canary_share_error_pp": round(abs(share - WEIGHT), 3), "canary_requests": args.canary_requests,
                      "clients": CLIENTS, "quick": args.quick, "settings": results}))  # fmt: skip


if __name__ == "__main__":
    main()
