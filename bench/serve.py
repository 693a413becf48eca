"""`hfleet serve` against a minimal uvicorn + onnxruntime server, and the canary share it routes.

    OMP_NUM_THREADS=1 python bench/serve.py [--quick] [--requests 400] [--repeats 3] [--canary-requests 10000]
                                            [--anchor-json orjson|json]

Three servers, each its own process on 127.0.0.1, serve the same ONNX export of each
setting's model: the digits MLP (64-128-10), the larger digits MLP (``--hidden 2048,512``,
1.2M parameters) and the Fashion ResNet with BatchNorm (width 16, 0.3M parameters, on
Fashion-MNIST test images; left out, and named so in the JSON, where Debian's
dataset-fashion-mnist is not installed); 4 client threads send OIP v2 JSON infer requests
of batch 1 and 32. ``--quick`` runs the digits MLP only. The sides:

- ``minimal``, the anchor (`bench/_minimal_oip.py`): no auth, routing, input checks or
  metrics by its nature, every inference on the event loop;
- ``hfleet``: `hfleet serve` as users run it, token auth on, serving an alias that names
  one version (the anchor's model work: one model);
- ``hfleet-canary``: `hfleet serve` on an alias with a 10 % canary, so every request is
  routed between two loaded models (the canary share is counted on it over
  ``--canary-requests`` unkeyed requests).

Same settings on every side: one uvicorn worker, onnxruntime with one intra-op and one
inter-op thread, the same ONNX file and bodies, the same JSON library (orjson; with
``--anchor-json json`` the anchor uses the standard library's, as a plainer server would).
Each side is measured ``--repeats`` times per setting, interleaved with the order rotating,
and each side's medians are compared (one measurement swings by up to 20 % on a 2-core
machine). Ends with one JSON line, each ratio the worst over the settings:
``throughput_vs_minimal`` (hfleet / minimal, the lowest), ``p50_vs_minimal`` (the highest),
``server_cpu_vs_minimal`` (server CPU-seconds per request, the highest: the server's own
cost, whichever way the two cores were shared with the clients), the same three for the
canary side (``canary_throughput_vs_minimal``, ``canary_p50_vs_minimal``,
``canary_server_cpu_vs_minimal``), and ``canary_share_error_pp`` (|observed - 10|
percentage points).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
from _proc import cpu_s  # bench/ is sys.path[0] when a bench runs

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "examples" / "digits"), str(REPO / "examples" / "fashion"), str(REPO)]
CLIENTS = 4
WEIGHT = 10.0
FIGURES = ("p50_ms", "p99_ms", "throughput_rps", "cpu_us_per_request")
SIDES = ("minimal", "hfleet", "hfleet-canary")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], port: int, headers: dict[str, str], model: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/models/{model}/ready", headers=headers, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 120 s")


def _server_cpu_s(proc: subprocess.Popen) -> float:
    """CPU-seconds (user + system, every thread) the server process has used so far."""
    return cpu_s(proc.pid)


def _load(port: int, headers: dict[str, str], body: bytes, requests: int, model: str,
          server: subprocess.Popen | None = None) -> dict:  # fmt: skip
    """4 clients, ``requests`` each: latencies (ms), throughput (requests/s) and, given the ``server``'s
    process, its CPU time per answered request (µs): the figure that does not depend on how the
    two cores were shared between the clients and the server."""
    latencies: list[float] = []
    versions: dict[str, int] = {}
    failures = [0]
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={**headers, "content-type": "application/json"}) as c:
            mine, seen = [], {}
            for _ in range(requests):
                t0 = time.perf_counter()
                r = c.post(f"/v2/models/{model}/infer", content=body)
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
    cpu_before = _server_cpu_s(server) if server is not None else None
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    cpu_us = None if server is None else (_server_cpu_s(server) - cpu_before) * 1e6 / len(latencies)
    return {"p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
            "throughput_rps": len(latencies) / wall, "cpu_us_per_request": cpu_us, "failures": failures[0],
            "versions": versions}  # fmt: skip


def _median_run(runs: list[dict]) -> dict:
    """One side's figures over its repeats: the median of each of FIGURES, each repeat kept under ``repeats``."""
    out = {key: float(np.median([r[key] for r in runs])) for key in FIGURES}
    versions: dict[str, int] = {}
    for r in runs:
        for v, n in r["versions"].items():
            versions[v] = versions.get(v, 0) + n
    return {**out, "failures": sum(r["failures"] for r in runs), "versions": versions,
            "repeats": [{key: round(r[key], 3) for key in FIGURES} for r in runs]}


@dataclass(frozen=True)
class Setting:
    """One served model: the example factory, its arguments and real input rows."""

    label: str
    model: str  # the registered name, also the served one
    factory: str  # FILE.py:FUNC under examples/
    args: dict[str, str]
    rows: Callable[[], np.ndarray]


def _digits_rows() -> np.ndarray:
    from digits_data import load_test

    return load_test()[0]


def _fashion_rows() -> np.ndarray:
    from fashion_data import load_test

    return load_test(64)[0]


SETTINGS = {
    "digits": Setting("digits", "digits", "digits/digits_model.py:build_torch", {"hidden": "128"}, _digits_rows),
    "digits-1.2M": Setting("digits-1.2M", "digits", "digits/digits_model.py:build_torch", {"hidden": "2048,512"}, _digits_rows),
    "fashion-resnet": Setting("fashion-resnet", "fashion", "fashion/fashion_model.py:build_torch", {"width": "16"}, _fashion_rows),
}


def _prepare(root: Path, setting: Setting) -> tuple[object, Path]:
    """A registry with two exported versions of the setting's model: stable -> v1, and prod -> v1 with v2
    as a 10 % canary."""
    import torch

    from hybridfleet.ckpt.run_model import ModelCheckpointer
    from hybridfleet.registry import Registry
    from hybridfleet.serve.export import export_version
    from hybridfleet.serve.factory import build_model, load_factory

    reg = Registry(f"sqlite:///{root}/registry.db")
    factory = f"{REPO / 'examples' / setting.factory}"
    for seed in (0, 1):
        torch.manual_seed(seed)
        ckpt = ModelCheckpointer(str(root / f"run-{seed}"), "torch", keep_last=1)
        ckpt.final(1, build_model(load_factory(factory), setting.args)[0], {})
        info = reg.register(setting.model, ckpt.store.url)
        export_version(reg, f"{setting.model}@{info.version}", "onnx", root / f"export-{info.version}", factory, setting.args)
    reg.move_alias(setting.model, "stable", 1)
    reg.move_alias(setting.model, "prod", 1)
    reg.rollout(setting.model, "prod", canary=2, weight=WEIGHT)
    return reg, root / "export-1" / setting.model / "1" / "model.onnx"


def _body(x: np.ndarray) -> bytes:
    """An OIP v2 JSON infer request of the rows ``x``."""
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits model only, 100 requests per client, 1,000 canary requests")
    parser.add_argument("--requests", type=int, default=400, help="requests per client per setting")
    parser.add_argument("--canary-requests", type=int, default=10_000)
    parser.add_argument("--anchor-json", choices=("orjson", "json"), default="orjson",
                        help="the anchor's JSON library: orjson as hfleet serve uses (the fair anchor), or the standard library's")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side and setting, interleaved; the median is reported")
    args = parser.parse_args()
    if args.requests < 10:
        parser.error(f"--requests: must be >= 10 (got {args.requests})")
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1 (got {args.repeats})")
    if args.canary_requests < 100:
        parser.error(f"--canary-requests: must be >= 100 (got {args.canary_requests})")
    if args.quick:
        args.requests, args.canary_requests, args.repeats = 100, 1000, 1
    labels = ["digits"] if args.quick else list(SETTINGS)
    results, share, skipped = [], None, {}
    for label in labels:
        setting = SETTINGS[label]
        try:
            rows = setting.rows()
        except FileNotFoundError as err:  # Fashion-MNIST not installed: the setting is left out and named
            skipped[label] = str(err)
            print(f"{label}: left out ({err})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            reg, onnx_path = _prepare(Path(tmp), setting)
            token = reg.add_principal("bench", "service")
            reg.grant("bench", "reader", f"default/{setting.model}")
            auth = {"Authorization": f"Bearer {token}"}
            headers = {"minimal": {}, "hfleet": auth, "hfleet-canary": auth}
            ports = {side: _port() for side in SIDES}
            hfleet = [sys.executable, "-m", "hybridfleet", "serve", "-r", reg.db_url, "--insecure-plaintext", "--cache-dir", f"{tmp}/cache"]
            servers = {
                "minimal": _start([sys.executable, str(REPO / "bench" / "_minimal_oip.py"), str(onnx_path), str(ports["minimal"]),
                                   setting.model, args.anchor_json], ports["minimal"], {}, setting.model),
                "hfleet": _start([*hfleet, f"{setting.model}@stable", "--port", str(ports["hfleet"])], ports["hfleet"], auth,
                                 setting.model),
                "hfleet-canary": _start([*hfleet, f"{setting.model}@prod", "--port", str(ports["hfleet-canary"])],
                                        ports["hfleet-canary"], auth, setting.model),
            }  # fmt: skip
            try:
                for batch in (1, 32):
                    body = _body(rows[:batch])
                    row = {"model": label, "batch": batch}
                    for side in SIDES:
                        _load(ports[side], headers[side], body, 10, setting.model)  # warm-up
                    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
                    for repeat in range(args.repeats):  # interleaved, the order rotating: every side sees the same load
                        for side in SIDES[repeat % 3:] + SIDES[:repeat % 3]:
                            runs[side].append(_load(ports[side], headers[side], body, args.requests, setting.model, servers[side]))
                    for side, measured in runs.items():
                        row[side] = _median_run(measured)
                    results.append(row)
                    print(f"{label:<14} batch {batch:>2}  " + " | ".join(
                        f"{side} p50 {row[side]['p50_ms']:6.2f} ms p99 {row[side]['p99_ms']:6.2f} ms "
                        f"{row[side]['throughput_rps']:6.0f} req/s {row[side]['cpu_us_per_request']:6.0f} us CPU" for side in SIDES))
                if share is None:
                    counted = _load(ports["hfleet-canary"], auth, _body(rows[:1]), args.canary_requests // CLIENTS, setting.model)
                    total = sum(counted["versions"].values())
                    share = 100.0 * counted["versions"].get("2", 0) / total
                    print(f"canary share over {total} requests: {share:.2f} % (weight {WEIGHT:g} %), failures {counted['failures']}")
            finally:
                for proc in servers.values():
                    proc.terminate()
                    proc.wait(timeout=30)

    def worst(side: str, figure: str, pick) -> float:
        return round(pick(r[side][figure] / r["minimal"][figure] for r in results), 3)

    print(json.dumps({"bench": "serve", "sides": "hfleet serve (auth; one version, and a 10% canary) vs minimal uvicorn+onnxruntime",
                      "throughput_vs_minimal": worst("hfleet", "throughput_rps", min), "p50_vs_minimal": worst("hfleet", "p50_ms", max),
                      "canary_share_error_pp": round(abs(share - WEIGHT), 3),
                      "server_cpu_vs_minimal": worst("hfleet", "cpu_us_per_request", max),
                      "canary_throughput_vs_minimal": worst("hfleet-canary", "throughput_rps", min),
                      "canary_p50_vs_minimal": worst("hfleet-canary", "p50_ms", max),
                      "canary_server_cpu_vs_minimal": worst("hfleet-canary", "cpu_us_per_request", max),
                      "anchor_json": args.anchor_json, "canary_requests": args.canary_requests,
                      "clients": CLIENTS, "repeats": args.repeats, "quick": args.quick, "settings_run": [r["model"] for r in results[::2]],
                      "settings_left_out": skipped, "settings": results}))  # fmt: skip


if __name__ == "__main__":
    main()
