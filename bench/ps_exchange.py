"""Dense push+pull through one parameter-server shard vs gloo all_reduce vs raw TCP.

    python bench/ps_exchange.py            # 64 MB parameter set, 5 rounds
    python bench/ps_exchange.py --quick    # 16 MB, 3 rounds (under a minute)
    python bench/ps_exchange.py --grpc     # also over gRPC
    python bench/ps_exchange.py --python-tls   # also with Python's ssl module instead of the C record loop
    python bench/ps_exchange.py --mb 1024 --shards 4 --optimizer adam   # a large model's memory bounds

Two workers push a dense fp32 gradient of the whole parameter set and pull the
updated parameters (BSP, server-side SGD) through ONE shard on its bulk data plane
(TLS socket) with tokens (the default security), then the same without TLS and tokens
(``tls_vs_plaintext`` = TLS time / plaintext time of this run). The anchor is
torch's gloo ``all_reduce`` of the same tensors in 2 processes started by
torchrun, and the physical yardstick is raw TCP throughput on loopback for the
bytes the shard moves.

One shard must move 4x the tensor bytes per round (2 pushes in, 2 pulls out)
while ring all-reduce moves 2x per process, so ratio ~1.4 is the floor here.
The last line is JSON: ps_s and gloo_s are median seconds per round,
ratio = ps_s / gloo_s, wire_efficiency = (bytes through the shard / ps_s) /
raw TCP bytes per second. ``native_tls`` says whether the bulk plane's TLS ran in the
C extension (hybridfleet.ps.wire.tls) or in Python's ssl module, ``records`` whether its
bytes travelled in sealed records or TLS records (``HFLEET_SEALED_RECORDS=0``).

The parameter server's round includes the optimizer step (on the shards); all_reduce alone
does not. ``gloo_step_s`` times what a DDP iteration does after its backward, in the same
torchrun processes: all_reduce of the gradients, their mean, and torch.optim's step of the
shards' optimizer and lr (torch's defaults) on every process; ``ratio_to_ddp_step`` =
ps_s / gloo_step_s. ``ratio`` keeps the all_reduce-only anchor.

Memory (TLS run): ``shard_rss_over_slice`` is the largest shard's peak RSS over its slice
of the parameters, ``shard_rss_over_target`` its peak RSS over 1.25 x (slice + optimizer
slots) + 128 MiB, ``worker_rss_over_model`` a worker's peak RSS over the model's bytes (the
worker holds its parameters and gradients besides what the session keeps).
``worker_framework_rss_mib`` is "framework": a worker's resident set after importing the
job's framework (torch), numpy and the worker session, before any tensor exists;
``worker_rss_over_target`` = a worker's peak RSS / (2 x model + framework), at most 1 when the
worker holds no more than its parameters and one gradient's worth of bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from hybridfleet.launch.preflight import free_port
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan
from hybridfleet.ps.wire.tls import ENV_SWITCH, native_available, records_between_native_ends
from _proc import status_field  # bench/ is sys.path[0] when a bench runs

HERE = Path(__file__).resolve().parent
TENSORS = 16
BLOCK_BYTES = 64 << 20
SLOTS = {"sgd": 0, "adam": 2}  # optimizer state arrays shaped like the parameters
LR = 0.01  # the shards' optimizer's, and the DDP anchor's


def raw_tcp_bytes_per_s(total_bytes: int, chunk: int = 1 << 20) -> float:
    """Throughput of one TCP stream on loopback between two processes' worth of sockets (threads here)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def sink():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        while received[0] < total_bytes:
            n = conn.recv_into(view)
            if not n:
                break
            received[0] += n
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    payload = os.urandom(chunk)
    client = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    sent = 0
    while sent < total_bytes:
        client.sendall(payload)
        sent += chunk
    client.shutdown(socket.SHUT_WR)
    t.join()
    elapsed = time.perf_counter() - t0
    client.close()
    server.close()
    return received[0] / elapsed


def peak_rss_bytes(pid: int) -> int:
    """A running process's peak resident set (VmHWM), in bytes."""
    kib = status_field("VmHWM", pid)
    if kib is None:
        raise RuntimeError(f"no VmHWM for process {pid}")
    return kib * 1024


def slice_bytes(numel: int, shards: int) -> list[int]:
    """Each shard's float32 bytes of the bench's parameter set."""
    params = [ParamSpec(f"layer{i}.weight", (numel // TENSORS,)) for i in range(TENSORS)]
    plan = ShardingPlan.build(params, shards, BLOCK_BYTES)
    return [sum((b.stop - b.start) * 4 for b in plan.blocks_for_shard(i)) for i in range(shards)]


def run_ps(numel: int, rounds: int, plaintext: bool, workdir: Path, transport: str = "auto",
           native_tls: bool = True, shards: int = 1, optimizer: str = "sgd") -> dict:
    job = {
        "name": "bench-ps-exchange", "framework": "torch", "entrypoint": "unused.py",
        "sites": {"w0": {"workers": 1}, "w1": {"workers": 1}},
        "ps": {"shards": shards, "sync": "bsp", "optimizer": {"name": optimizer, "lr": LR},
               "block_size_bytes": BLOCK_BYTES, "heartbeat_timeout_s": 60, "transport": transport},
        "security": {"tls": "off" if plaintext else "auto", "tokens": "off" if plaintext else "auto"},
    }
    job_path = workdir / "job.yaml"
    job_path.write_text(yaml.safe_dump(job))
    from hybridfleet.launch.psjob import prepare_security, worker_env
    from hybridfleet.spec import load_spec

    spec = load_spec(job_path)
    layout = prepare_security(spec, workdir)
    env = dict(os.environ, OMP_NUM_THREADS="1", HFLEET_LOG_LEVEL="warning")
    if not native_tls:
        env[ENV_SWITCH] = "0"
    shard_procs, port_files = [], []
    for i in range(shards):
        port_file = workdir / f"shard-{i}.port"
        argv = [sys.executable, "-m", "hybridfleet", "ps", "serve", str(job_path), "--shard", str(i), "--port", "0",
                "--port-file", str(port_file), "--expected-workers", "2"]
        argv += ["--insecure-plaintext", "--no-auth"] if plaintext else ["--certs", str(layout.certs_dir)]
        shard_procs.append(subprocess.Popen(argv, env=env))
        port_files.append(port_file)
    try:
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in port_files):
            if time.monotonic() > deadline or any(p.poll() is not None for p in shard_procs):
                raise RuntimeError("shard did not start")
            time.sleep(0.05)
        layout.shard_addresses = [f.read_text().strip() for f in port_files]
        procs = []
        for rank, site in enumerate(spec.sites):
            wenv = dict(env, **worker_env(spec, job_path, layout, site, rank, 0),
                        HFLEET_BENCH_SHARD_PIDS=",".join(str(p.pid) for p in shard_procs))
            procs.append(subprocess.Popen([sys.executable, str(HERE / "_ps_exchange_worker.py"), str(job_path),
                                           str(rank), str(rounds), str(numel), str(TENSORS)],
                                          env=wenv, stdout=subprocess.PIPE, text=True))
        results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        shard_rss = [peak_rss_bytes(p.pid) for p in shard_procs]
    finally:
        for p in shard_procs:
            p.terminate()
        for p in shard_procs:
            p.wait(10)
    per_round = [max(a, b) for a, b in zip(results[0]["round_s"], results[1]["round_s"])]
    slices = slice_bytes(numel, shards)
    slots = SLOTS[optimizer]
    shard_cpu = results[0]["shard_rounds_cpu_s"]
    return {"round_s": per_round, "median_s": statistics.median(per_round),
            # CPU-seconds of the timed rounds (warm-up, start-up and handshakes left out): both
            # workers' own, and the shards' over rank 0's timed rounds
            "rounds_cpu_s": sum(r["rounds_cpu_s"] for r in results) + (shard_cpu or 0.0),
            "shard_rss_bytes": max(shard_rss), "worker_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "shard_rss_over_slice": max(r / s for r, s in zip(shard_rss, slices)),
            "shard_rss_over_target": max(r / (1.25 * s * (1 + slots) + (128 << 20)) for r, s in zip(shard_rss, slices)),
            "worker_rss_over_model": max(r["peak_rss_bytes"] for r in results) / (numel * 4),
            "worker_framework_rss_bytes": max(r["framework_rss_bytes"] for r in results),
            "worker_rss_over_target": max(r["peak_rss_bytes"] / (2 * numel * 4 + r["framework_rss_bytes"])
                                          for r in results)}


def run_gloo(numel: int, rounds: int, optimizer: str = "sgd") -> dict:
    """gloo's all_reduce rounds (``median_s``) and DDP-iteration rounds (``step_median_s``: all_reduce,
    mean and torch.optim's step of ``optimizer`` at the shards' lr) of the same tensors."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(HERE / "_gloo_worker.py"), str(rounds), str(numel),
                          str(TENSORS), optimizer, str(LR)], env=env, capture_output=True, text=True, timeout=600,
                         check=True)
    line = next(l for l in out.stdout.splitlines() if l.startswith("GLOO "))
    got = json.loads(line[5:])
    return {"round_s": got["round_s"], "median_s": statistics.median(got["round_s"]),
            "step_median_s": statistics.median(got["step_round_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 MB, 3 rounds")
    ap.add_argument("--mb", "--size-mb", dest="mb", type=int, default=None,
                    help="parameter set size in MB (default 64); --size-mb is the same flag")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--python-tls", action="store_true", help="also measure TLS in Python's ssl module")
    ap.add_argument("--grpc", action="store_true", help="also measure Push/Pull over gRPC instead of the bulk data plane")
    ap.add_argument("--shards", type=int, default=1, help="shard processes (default 1)")
    ap.add_argument("--optimizer", choices=sorted(SLOTS), default="sgd", help="the shards' optimizer (default sgd)")
    args = ap.parse_args()
    size_flag = "--size-mb" if any(a.startswith("--size-mb") for a in sys.argv[1:]) else "--mb"  # as typed
    for flag, value, least in ((size_flag, args.mb, 1), ("--rounds", args.rounds, 1), ("--shards", args.shards, 1)):
        if value is not None and value < least:
            ap.error(f"{flag}: must be >= {least} (got {value})")
    from _anchors import require  # bench/ is sys.path[0] when a bench runs

    require("bench/ps_exchange.py", {"torch": "PyTorch"})
    mb = args.mb or (16 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 5)
    numel = mb * (1 << 20) // 4
    tensor_bytes = numel * 4
    with tempfile.TemporaryDirectory() as tmp:
        ps = run_ps(numel, rounds, False, Path(tmp), shards=args.shards, optimizer=args.optimizer)
    with tempfile.TemporaryDirectory() as tmp:
        ps_plain = run_ps(numel, rounds, True, Path(tmp), shards=args.shards, optimizer=args.optimizer)
    ps_pytls = None
    if args.python_tls:
        with tempfile.TemporaryDirectory() as tmp:
            ps_pytls = run_ps(numel, rounds, False, Path(tmp), native_tls=False)
    ps_grpc = None
    if args.grpc:
        with tempfile.TemporaryDirectory() as tmp:
            ps_grpc = run_ps(numel, rounds, False, Path(tmp), transport="grpc")
    gloo = run_gloo(numel, rounds, args.optimizer)
    shard_bytes = 4 * tensor_bytes  # 2 pushes in + 2 pulls out
    tcp = raw_tcp_bytes_per_s(shard_bytes)
    ratio = ps["median_s"] / gloo["median_s"]
    eff = (shard_bytes / ps["median_s"]) / tcp
    print(f"parameter set: {mb} MB in {TENSORS} tensors, 2 workers, {args.shards} shard(s), {args.optimizer}, "
          f"{rounds} rounds (median)")
    print(f"{'side':<44}{'s/round':>10}{'GB/s through shard':>22}")
    tls_kind = "C record loop" if native_available() else "Python ssl"
    print(f"{f'hybridfleet PS (TLS + tokens, {tls_kind})':<44}{ps['median_s']:>10.3f}"
          f"{shard_bytes / ps['median_s'] / 1e9:>22.2f}")
    print(f"{'hybridfleet PS (plaintext)':<44}{ps_plain['median_s']:>10.3f}{shard_bytes / ps_plain['median_s'] / 1e9:>22.2f}")
    if ps_pytls:
        print(f"{'hybridfleet PS (TLS + tokens, Python ssl)':<44}{ps_pytls['median_s']:>10.3f}"
              f"{shard_bytes / ps_pytls['median_s'] / 1e9:>22.2f}")
    if ps_grpc:
        print(f"{'hybridfleet PS over gRPC (TLS)':<44}{ps_grpc['median_s']:>10.3f}"
              f"{shard_bytes / ps_grpc['median_s'] / 1e9:>22.2f}")
    print(f"{'torch gloo all_reduce (torchrun)':<44}{gloo['median_s']:>10.3f}{'':>22}")
    print(f"{f'torch gloo all_reduce + {args.optimizer} step (DDP)':<44}{gloo['step_median_s']:>10.3f}{'':>22}")
    print(f"{'raw TCP loopback (same bytes)':<44}{shard_bytes / tcp:>10.3f}{tcp / 1e9:>22.2f}")
    result = {"bench": "ps_exchange", "mb": mb, "ps_s": round(ps["median_s"], 4), "gloo_s": round(gloo["median_s"], 4),
              "ratio": round(ratio, 3), "wire_efficiency": round(eff, 3), "raw_tcp_gb_s": round(tcp / 1e9, 3),
              "native_tls": native_available(), "records": records_between_native_ends(),
              "tls_vs_plaintext": round(ps["median_s"] / ps_plain["median_s"], 3),
              "ps_plaintext_s": round(ps_plain["median_s"], 4),
              "ratio_plaintext": round(ps_plain["median_s"] / gloo["median_s"], 3),
              "wire_efficiency_plaintext": round((shard_bytes / ps_plain["median_s"]) / tcp, 3),
              "gloo_step_s": round(gloo["step_median_s"], 4),
              "ratio_to_ddp_step": round(ps["median_s"] / gloo["step_median_s"], 3)}
    result.update({"shards": args.shards, "optimizer": args.optimizer,
                   "shard_rss_mib": round(ps["shard_rss_bytes"] / (1 << 20), 1),
                   "worker_rss_mib": round(ps["worker_rss_bytes"] / (1 << 20), 1),
                   "worker_framework_rss_mib": round(ps["worker_framework_rss_bytes"] / (1 << 20), 1),
                   **{k: round(ps[k], 3) for k in ("shard_rss_over_slice", "shard_rss_over_target",
                                                    "worker_rss_over_model", "worker_rss_over_target")}})
    print(f"peak RSS: shard {result['shard_rss_mib']} MiB ({result['shard_rss_over_slice']} x its slice, "
          f"{result['shard_rss_over_target']} x 1.25 (slice + slots) + 128 MiB), worker {result['worker_rss_mib']} "
          f"MiB ({result['worker_rss_over_model']} x the model, {result['worker_rss_over_target']} x 2 x model + "
          f"framework {result['worker_framework_rss_mib']} MiB)")
    if ps_pytls:
        result["ps_python_tls_s"] = round(ps_pytls["median_s"], 4)
        result["python_tls_vs_plaintext"] = round(ps_pytls["median_s"] / ps_plain["median_s"], 3)
    if ps_grpc:
        result["ps_grpc_s"] = round(ps_grpc["median_s"], 4)
        result["ratio_grpc"] = round(ps_grpc["median_s"] / gloo["median_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
